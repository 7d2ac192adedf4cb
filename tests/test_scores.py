"""RM-score statistics and the Figure-3 style histogram."""
import numpy as np
import pytest

from marl_jax.eval import scores


def test_score_summary_matches_numpy():
    values = np.random.default_rng(0).normal(0.3, 1.7, size=257)
    summary = scores.score_summary(values.tolist(), bins=12)
    counts, edges = np.histogram(values, bins=12)
    assert summary["n"] == 257
    assert summary["mean"] == pytest.approx(values.sum() / 257, rel=1e-12)
    assert summary["std"] == pytest.approx(np.sqrt(np.mean((values - values.mean()) ** 2)),
                                           rel=1e-12)
    assert (summary["min"], summary["max"]) == (values.min(), values.max())
    assert summary["hist_counts"] == counts.tolist() and sum(summary["hist_counts"]) == 257
    np.testing.assert_allclose(summary["hist_edges"], edges)


def test_score_summary_by_hand():
    summary = scores.score_summary([1.0, 2.0, 3.0, 6.0], bins=[0, 2, 4, 8])
    assert summary["mean"] == 3.0
    assert summary["std"] == pytest.approx(np.sqrt((4 + 1 + 0 + 9) / 4))
    assert summary["hist_counts"] == [1, 2, 1]
    for bad in ([], [1.0, float("nan")], [[1.0, 2.0]]):
        with pytest.raises(ValueError, match="scores"):
            scores.score_summary(bad)


def test_histogram_png(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "figs" / "rm_scores.png"
    out = scores.plot_score_histogram({"PPO": rng.normal(0, 1, 300),
                                       "MA-PPO (n=5)": rng.normal(0.8, 1, 300)},
                                      str(path), title="TL;DR RM scores")
    assert out == str(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    import matplotlib.image
    image = matplotlib.image.imread(str(path))
    assert image.shape[:2] == (int(4.2 * 120), int(6.4 * 120))
    # two arms drawn in two colours: both the C0 blue and C1 orange tints are present
    rgb = image[..., :3].reshape(-1, 3)
    assert np.any((rgb[:, 2] > rgb[:, 0] + 0.2)) and np.any((rgb[:, 0] > rgb[:, 2] + 0.2))
    with pytest.raises(ValueError, match="empty"):
        scores.plot_score_histogram({}, str(path))
