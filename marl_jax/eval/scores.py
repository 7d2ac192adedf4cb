"""Statistics and plots of reward-model scores of generated responses (the paper's Figure 3)."""
from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence, Union

import numpy as np


def _as_scores(scores, name: str) -> np.ndarray:
    array = np.asarray(scores, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of numbers, got shape "
                         f"{array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return array


def score_summary(scores: Sequence[float], bins: Union[int, Sequence[float]] = 20) -> dict:
    """Summary of scores `[N]`: mean, std (population, ddof=0), min, max, n, and a histogram
    (`hist_counts` [bins], `hist_edges` [bins + 1], as `np.histogram`). Plain Python numbers
    and lists, ready for JSON."""
    array = _as_scores(scores, "scores")
    counts, edges = np.histogram(array, bins=bins)
    return {"mean": float(array.mean()), "std": float(array.std()), "min": float(array.min()),
            "max": float(array.max()), "n": int(array.size),
            "hist_counts": counts.astype(int).tolist(), "hist_edges": edges.tolist()}


def plot_score_histogram(scores_by_name: Mapping[str, Sequence[float]], path: str, *,
                         bins: int = 30, title: Optional[str] = None,
                         xlabel: str = "RM score") -> str:
    """Overlaid score histograms, one colour per arm / model, on shared bin edges, with each
    arm's mean as a dashed line; saved as a PNG at `path` (parent folders created). Returns
    the path. Uses matplotlib's Agg canvas directly (no pyplot state, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not scores_by_name:
        raise ValueError("scores_by_name is empty")
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    arrays = {str(name): _as_scores(s, f"scores_by_name[{name!r}]")
              for name, s in scores_by_name.items()}
    low = min(a.min() for a in arrays.values())
    high = max(a.max() for a in arrays.values())
    edges = np.linspace(low, high if high > low else low + 1.0, bins + 1)

    figure = Figure(figsize=(6.4, 4.2), dpi=120)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    colours = [f"C{i % 10}" for i in range(len(arrays))]
    for (name, array), colour in zip(arrays.items(), colours):
        axes.hist(array, bins=edges, alpha=0.45, color=colour, edgecolor=colour,
                  label=f"{name} (mean {array.mean():.3f})")
        axes.axvline(array.mean(), color=colour, linestyle="--", linewidth=1.2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("count")
    if title:
        axes.set_title(title)
    axes.legend(frameon=False)
    figure.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    figure.savefig(path, format="png")
    return path
