"""Best-of-k SFT data, annotator-labelled pairs, the samples on disk, and the config sizes."""
import numpy as np
import pytest

from marl_jax import config as config_lib
from marl_jax.train import sampled_data


def _samples(n=3, k=3, r=4, p=2):
    prompts = dict(ids=np.arange(n * p, dtype=np.int32).reshape(n, p) + 100,
                   mask=np.ones((n, p), np.int32))
    # Response j of prompt i is the tokens 10 * i + j (distinct), except prompt 2's samples 0
    # and 1, which are the same tokens.
    ids = (10 * np.arange(n)[:, None, None] + np.arange(k)[None, :, None]
           + np.zeros((1, 1, r), np.int64)).astype(np.int32)
    ids[2, 1] = ids[2, 0]
    mask = np.ones((n, k, r), np.int32)
    mask[:, :, -1] = 0
    return prompts, ids, mask


def test_best_of_k_takes_the_highest_gold_response_first_on_ties():
    prompts, ids, mask = _samples()
    gold = np.array([[0.1, 0.9, 0.3], [0.5, 0.2, 0.5], [0.0, 0.0, 0.0]])
    sft = sampled_data.best_of_k(prompts, ids, mask, gold)
    np.testing.assert_array_equal(sft["response_ids"][:, 0], [1, 10, 20])
    np.testing.assert_array_equal(sft["prompt_ids"], prompts["ids"])
    with pytest.raises(ValueError, match="gold \\(3, 2\\) \\[N, k\\]"):
        sampled_data.best_of_k(prompts, ids, mask, gold[:, :2])


def test_pairs_by_the_gold_alone_and_with_annotator_noise():
    prompts, ids, mask = _samples()
    gold = np.array([[0.1, 0.9, 0.3], [0.5, 0.2, 0.5], [0.4, 0.8, 0.1]])
    exact = sampled_data.labelled_pairs(prompts, ids, mask, gold, temperature=0.0,
                                        rng=np.random.default_rng(0))
    # Prompt 0: 3 pairs; prompt 1: (0, 2) ties on the gold; prompt 2: samples 0 and 1 are the
    # same tokens (their gold differs only by construction here): both left out.
    assert list(zip(exact["prompt_index"], exact["a_index"], exact["b_index"])) == [
        (0, 0, 1), (0, 0, 2), (0, 1, 2), (1, 0, 1), (1, 1, 2), (2, 0, 2), (2, 1, 2)]
    assert exact["gold_agrees"].all()
    # chosen = the higher-gold response: prompt 0 pairs -> 1, 2, 1; prompt 1 -> 0, 2; 2 -> 0, 1
    # (prompt 2's sample 1 holds sample 0's tokens, 20).
    np.testing.assert_array_equal(exact["chosen_ids"][:, 0], [1, 2, 1, 10, 12, 20, 20])
    np.testing.assert_array_equal(exact["rejected_ids"][:, 0], [0, 0, 2, 11, 11, 22, 22])
    np.testing.assert_array_equal(exact["prompt_ids"][:, 0], [100, 100, 100, 102, 102, 104, 104])

    # A noisy annotator prefers a with probability sigmoid((g_a - g_b) / T): over many draws of
    # one pair with g_a - g_b = 0.1 and T = 0.1 the agreement is sigmoid(1) = 0.731.
    n = 4000
    p2 = dict(ids=np.zeros((n, 1), np.int32), mask=np.ones((n, 1), np.int32))
    ids2 = np.zeros((n, 2, 2), np.int32)
    ids2[:, 1] = 1
    noisy = sampled_data.labelled_pairs(p2, ids2, np.ones_like(ids2),
                                        np.tile([[0.6, 0.5]], (n, 1)), temperature=0.1,
                                        rng=np.random.default_rng(1))
    assert abs(noisy["gold_agrees"].mean() - 1 / (1 + np.exp(-1.0))) < 0.025
    # pairs_per_prompt keeps that many of each prompt's pairs.
    few = sampled_data.labelled_pairs(prompts, ids, mask, gold, temperature=0.0,
                                      rng=np.random.default_rng(0), pairs_per_prompt=1)
    assert list(few["prompt_index"]) == [0, 1, 2]
    with pytest.raises(ValueError, match="no preference pair"):
        sampled_data.labelled_pairs(prompts, ids, mask, np.zeros((3, 3)), temperature=0.0,
                                    rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="temperature=-1"):
        sampled_data.labelled_pairs(prompts, ids, mask, gold, temperature=-1,
                                    rng=np.random.default_rng(0))


def test_samples_on_disk_are_reused_and_other_settings_refused(tmp_path):
    prompts, ids, mask = _samples()
    gold = np.random.default_rng(0).random((3, 3))
    settings = dict(model="m.gguf", temperature=0.8, num_prompts=3)
    assert sampled_data.load_samples(str(tmp_path), "sft", settings) is None
    texts = [f"text {i}" for i in range(9)]
    sampled_data.save_samples(str(tmp_path), "sft", settings, ids, mask, gold, texts)
    got_ids, got_mask, got_gold = sampled_data.load_samples(str(tmp_path), "sft", settings)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_array_equal(got_mask, mask)
    np.testing.assert_array_equal(got_gold, gold)
    lines = (tmp_path / "sampled" / "sft.jsonl").read_text().splitlines()
    assert len(lines) == 9 and '"text": "text 4"' in lines[4] and '"prompt": 1' in lines[4]
    assert sorted(p.name for p in (tmp_path / "sampled").iterdir()) == ["sft.jsonl", "sft.npz"]
    with pytest.raises(ValueError, match=r"other settings \(\['temperature'\]: \[0.8\] there, "
                                         r"\[1.0\] now\)"):
        sampled_data.load_samples(str(tmp_path), "sft", dict(settings, temperature=1.0))


def _sized_config():
    import ml_collections

    c = ml_collections.ConfigDict(dict(
        ppo=dict(steps=4, batch_size=8), seeds=(0,), size="cpu", size_applied="",
        sizes=dict(cpu=dict(), accelerator=dict(ppo=dict(steps=100, batch_size=64),
                                                seeds=(0, 1, 2, 3, 4)))))
    return c


def test_sizes_apply_their_presets_and_the_command_line_wins():
    file_config = _sized_config()
    config = _sized_config()
    config.size = "accelerator"
    config.ppo.steps = 10  # as if --config.ppo.steps=10
    config_lib.resolve_size(config, file_config=file_config)
    assert (config.ppo.steps, config.ppo.batch_size, config.seeds) == (10, 64, (0, 1, 2, 3, 4))
    assert config.size_applied == "accelerator"
    config.ppo.batch_size = 32  # resolved once: later changes stay
    config_lib.resolve_size(config)
    assert config.ppo.batch_size == 32
    cpu = config_lib.resolve_size(_sized_config())
    assert (cpu.ppo.steps, cpu.ppo.batch_size) == (4, 8)
    # A field named on the command line keeps its value even where it equals the file's.
    named = _sized_config()
    named.size = "accelerator"
    named_value = named.ppo.batch_size
    config_lib.resolve_size(named, overridden=["size", "ppo.batch_size"])
    assert (named.ppo.batch_size, named.ppo.steps) == (named_value, 100)
    bad = _sized_config()
    bad.size = "tpu"
    with pytest.raises(ValueError, match=r"config.size='tpu': must be one of \('accelerator', "
                                         r"'cpu'\)"):
        config_lib.resolve_size(bad)
    missing = _sized_config()
    missing.sizes.cpu = dict(ppo=dict(epochs=2))
    with pytest.raises(ValueError, match="config.sizes.cpu.ppo.epochs: config.ppo.epochs does "
                                         "not exist"):
        config_lib.resolve_size(missing)


def test_samples_name_their_model_by_file_not_by_where_it_lies(tmp_path):
    for where in ("env_a", "env_b"):
        (tmp_path / where).mkdir()
        (tmp_path / where / "m.gguf").write_bytes(b"x" * 10)
    a, b = (sampled_data.model_identity(str(tmp_path / w / "m.gguf")) for w in ("env_a", "env_b"))
    assert a == b == "m.gguf (10 bytes)"
    (tmp_path / "env_b" / "m.gguf").write_bytes(b"x" * 11)
    assert sampled_data.model_identity(str(tmp_path / "env_b" / "m.gguf")) != a
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"y" * 5)
    assert sampled_data.model_identity(str(tmp_path / "hf")) == \
        "hf [('config.json', 2), ('model.safetensors', 5)]"
