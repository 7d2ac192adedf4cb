"""The review task through the pipeline: a reward model on gold-labelled pairs beats chance on
held-out prompts, and a tiny slice of the window size of configs/real_text_smollm2.py (bfloat16)
runs end to end with SmolLM2's tokenizer and chat template."""
import json
import pathlib
import subprocess
import sys
import types

import numpy as np
import pytest
import real_util

from marl_jax.data import reviews
from marl_jax.eval.review_gold import ReviewGold
from marl_jax.train import sampled_data

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_GOOD = ("wonderful", "excellent", "lovely", "great")
_BAD = ("terrible", "awful", "dirty", "disappointing")
_OTHER = ("place", "visit")


def _candidates(spec, rng, k):
    """k hand-templated responses to `spec`: tone, aspects and ending drawn at random."""
    out = []
    for _ in range(k):
        nouns = [a if rng.random() < 0.5 else rng.choice(_OTHER) for a in spec.aspects]
        adjectives = [rng.choice(_GOOD if rng.random() < 0.5 else _BAD) for _ in nouns]
        end = spec.closing if rng.random() < 0.5 else "later"
        out.append(f"The {nouns[0]} was {adjectives[0]} and the {nouns[1]} was {adjectives[1]}. "
                   f"I will tell you more {end}.")
    return out


def _pairs(tokenizer, specs, rng, temperature, k=4):
    from marl_jax.data import collate

    texts = [t for s in specs for t in _candidates(s, rng, k)]
    gold = ReviewGold().score([s for s in specs for _ in range(k)], texts).reshape(-1, k)
    prompt_ids, prompt_mask = collate.encode_prompts(tokenizer, [s.prompt for s in specs], 40)
    ids, mask = collate.encode_responses(tokenizer, texts, 24)
    shape = (len(specs), k, 24)
    return sampled_data.labelled_pairs(
        dict(ids=prompt_ids, mask=prompt_mask), ids.reshape(shape), mask.reshape(shape), gold,
        temperature=temperature, rng=rng)


def test_reward_model_on_noisy_gold_pairs_beats_chance_on_held_out_prompts(tmp_path,
                                                                          smollm2_gguf):
    """A 2-layer reward model from scratch, on 96 prompts' pairs labelled by the noisy
    annotator, ranks the pairs of 32 other prompts (labelled by the gold alone) better than
    chance."""
    from marl_jax import models
    from marl_jax.config import base_config
    from marl_jax.train import build, metrics, sharding
    from marl_jax.train.reward import PAIR_KEYS, pair_agreement, run_rm

    tokenizer = models.load_tokenizer(str(smollm2_gguf))
    parts = reviews.review_prompts(5, {"train": 96, "held_out": 32})
    specs = {k: [reviews.spec_from_record(r) for r in v] for k, v in parts.items()}
    rng = np.random.default_rng(0)
    train = _pairs(tokenizer, specs["train"], rng, temperature=0.05)
    held_out = _pairs(tokenizer, specs["held_out"], rng, temperature=0.0)
    assert held_out["gold_agrees"].all() and 0.7 < train["gold_agrees"].mean() < 1.0

    config = base_config()
    config.model.config.update(dict(family="llama", hidden_size=32, intermediate_size=64,
                                    num_layers=2, num_heads=2, num_kv_heads=2, head_dim=16,
                                    max_position_embeddings=64))
    config.rm.update(dict(steps=120, batch_size=16, learning_rate=3e-3, warmup_ratio=0.05))
    config.checkpoint_every = 1000
    reward_model = build.reward_module(build.model_config(config, tokenizer))
    init = models.init_params(reward_model, __import__("jax").random.key(0))
    mesh = sharding.make_mesh(config.mesh)
    writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
    task = types.SimpleNamespace(rm={k: train[k] for k in PAIR_KEYS})
    untrained = pair_agreement(reward_model, init, held_out, batch_size=16)
    params = run_rm(config, task, reward_model, init, mesh=mesh, writer=writer,
                    workdir=str(tmp_path))
    writer.close()
    agreement = pair_agreement(reward_model, params, held_out, batch_size=16)
    n = len(held_out["gold_agrees"])
    # 0.5 + 3 standard errors of a coin on n pairs.
    assert agreement > 0.5 + 3 * 0.5 / np.sqrt(n), (agreement, untrained, n)


SLICE = {
    "task.num_eval_prompts": 2, "task.num_rm_eval": 2, "task.num_sft": 2, "task.num_pairs": 2,
    "task.num_rl_prompts": 4, "task.samples_per_prompt": 2, "task.sample_batch_size": 2,
    "ppo.response_length": 8, "sft.steps": 1, "sft.batch_size": 2, "rm.steps": 1,
    "rm.batch_size": 2, "ppo.steps": 1, "ppo.batch_size": 2, "ppo.eval_every": 1,
    "seeds": "(3,)", "checkpoint_every": 1,
    "mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1,
    "model.scan_layers": True, "sft.num_layers_unfrozen": -1, "rm.num_layers_unfrozen": -1,
    "ppo.num_layers_unfrozen": -1,
}


def test_tiny_slice_of_the_window_size(tmp_path, smollm2_gguf):
    """One PPO step of every arm of the window size (ppo, ma_ppo and its matched control, in
    bfloat16 over rematerialised scanned layers) at tiny shapes, through sampling, SFT, the
    reward model, the evaluations and the report, with the size's runs per program (`bench.py
    memory` checks the window's program of three vmapped SmolLM2 runs on a v5e-8). The
    cpu_study size is the cpu size's float32 pipeline (test_configs) that test_kill_real_text
    runs end to end."""
    size, dtype = "window", "bfloat16"
    from marl_jax import models
    from marl_jax.train.metrics import read_metrics

    workdir = tmp_path / "run"
    config = real_util.tiny_real_text_config(tmp_path, smollm2_gguf)
    env = real_util.one_device_run_env()
    flags = [f"--config.{k}={v}" for k, v in SLICE.items()]
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "run.py"),
         f"--config={config}", f"--config.size={size}",
         f"--workdir={workdir}", *flags], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=1200)
    assert result.returncode == 0, result.stderr[-5000:]
    rows = read_metrics(str(workdir))
    # bfloat16 compute: the samples record the dtype, and `auto` precision is then `default`.
    precision = {"float32": "highest", "bfloat16": "default"}[dtype]
    assert f"matmul precision {precision};" in result.stdout + result.stderr
    with np.load(workdir / "sampled" / "sft.npz") as f:
        assert json.loads(str(f["settings"]))["dtype"] == dtype

    # The sampled responses: texts are the decoded tokens, and their gold is the review gold of
    # the part's prompts (rebuilt here from the word lists: eval, rm_eval, sft, rm, rl).
    tokenizer = models.load_tokenizer(str(smollm2_gguf))
    from configs import real_text_smollm2
    seed = real_text_smollm2.get_config().task.data_seed
    parts = reviews.review_prompts(seed, {"eval": 2, "rm_eval": 2, "sft": 2, "rm": 2, "rl": 4})
    for part in ("rm_eval", "sft", "rm"):
        with np.load(workdir / "sampled" / f"{part}.npz") as f:
            ids, mask, gold = f["ids"], f["mask"], f["gold"]
        assert ids.shape == (2, 2, 8) and gold.shape == (2, 2)
        lines = [json.loads(x) for x in (workdir / "sampled" / f"{part}.jsonl").read_text()
                 .splitlines()]
        texts = [tokenizer.decode(ids[i, j][mask[i, j] == 1], skip_special_tokens=True)
                 for i in range(2) for j in range(2)]
        assert [x["text"] for x in lines] == texts
        want = ReviewGold().score([r for r in parts[part] for _ in range(2)], texts)
        np.testing.assert_allclose(gold.reshape(-1), want)
        np.testing.assert_allclose([x["gold"] for x in lines], want)

    agreement = [r for r in rows if r["stage"] == "rm" and "rm/gold_agreement" in r]
    assert len(agreement) == 1 and agreement[0]["step"] == 1
    with np.load(workdir / "sampled" / "rm_eval.npz") as f:
        g, ids, mask = f["gold"], f["ids"], f["mask"]
    distinct = sum(g[i, 0] != g[i, 1] and not (np.array_equal(mask[i, 0], mask[i, 1]) and
                                               np.array_equal(ids[i, 0] * mask[i, 0],
                                                              ids[i, 1] * mask[i, 1]))
                   for i in range(2))
    assert agreement[0]["rm/gold_pairs"] == distinct
    assert agreement[0]["rm/gold_agreement"] in {k / distinct for k in range(distinct + 1)}
    with np.load(workdir / "sampled" / "sft.npz") as f:
        best = f["gold"].max(axis=1)
    assert agreement[0]["sampled/best_of_k_gold"] == pytest.approx(best.mean())

    finals = {r["arm"]: r for r in rows if r["stage"] == "final"}
    assert set(finals) == {"sft", "ppo", "ma_ppo", "ma_ppo_ctrl"}
    for r in finals.values():
        assert r["seed"] == 3 and len(r["gold_per_prompt"]) == 2
        assert all(0.0 <= x <= 1.0 for x in r["gold_per_prompt"])
    # Every arm starts from the one SFT policy on the same prompts and keys: one step-0 result.
    step0 = [r for r in rows if r["stage"] == "eval" and r["step"] == 0]
    assert [r["arm"] for r in step0] == ["ppo", "ma_ppo", "ma_ppo_ctrl"]
    assert len({r["gold"] for r in step0}) == 1
    assert step0[0]["gold"] == pytest.approx(np.mean(finals["sft"]["gold_per_prompt"]))
    # The control trains with kl_coef / 5 (the mean aggregation over 5-token macros).
    kl_coef = {r["arm"]: r["objective/kl_coef"] for r in rows if r["stage"] == "ppo"}
    assert kl_coef["ma_ppo_ctrl"] == pytest.approx(kl_coef["ppo"] / 5)
    assert kl_coef["ma_ppo"] == pytest.approx(kl_coef["ppo"])
    report = json.loads((workdir / "report.json").read_text())
    assert report["plan"]["controls"] == {"ma_ppo": "ma_ppo_ctrl"}
    assert set(report["comparisons"]["ma_ppo"]["versus_control"]) == {
        "final_gold", "J", "auc_gold", "kl", "rm_score"}
