"""Performance accounting (`marl_jax.train.perf`): the FLOP count against a hand count, the
device table, and the `perf/*` and `timing/*` fields of a synthetic run's rows, the phases run
as programs of their own giving the fused step's metrics."""
import copy
import json
import re

import numpy as np
import pytest

from marl_jax import models
from marl_jax.models.heads import ScalarHeadModel
from marl_jax.train import perf
from marl_jax.train import ppo as ppo_lib
from marl_jax.train.metrics import MetricsWriter, read_metrics
from marl_jax.train.ppo_types import PPOStatic

from train_util import trained_tiny_pipeline

# A 2-layer Llama: width 32, 2 query heads and 1 KV head of 16, MLP 64, vocabulary 100.
TINY = dict(family="llama", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
            num_kv_heads=1, head_dim=16, vocab_size=100, max_position_embeddings=64)
# Per layer, by hand: q 32 x 2 x 16 = 1024, k and v 32 x 1 x 16 = 512 each, o 2 x 16 x 32 = 1024,
# gate, up and down 32 x 64 = 2048 each: 9216; two layers 18432.
BODY = 18432


def _config(**fields):
    values = dict(TINY)
    return models.ModelConfig.for_family(values.pop("family"), **values).replace(**fields)


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_is_the_hand_count(tied):
    policy = models.CausalLM(_config(tie_word_embeddings=tied))
    got = perf.model_flops(policy)
    # The head is 32 x 100 whether it is the embedding table or its own matrix; the embedding
    # lookup costs nothing.
    assert (got.body, got.head) == (BODY, 3200)
    # 10 positions, each reading 10 keys, the head at 4 of them: 2 x 18432 x 10 + 2 x 3200 x 4
    # + 4 x 2 layers x 2 heads x 16 x 10 x 10.
    assert got.forward(10, 10, 4) == 368640 + 25600 + 25600
    assert got.train(10, 10, 4) == 3 * (368640 + 25600 + 25600)
    # A 5-token prompt (head at its last position), then 3 decoded tokens reading 6, 7 and 8
    # keys: 2 x (18432 + 3200) x 3 + 4 x 2 x 2 x 16 x 21.
    assert got.prefill(5) == 2 * BODY * 5 + 2 * 3200 + 4 * 2 * 2 * 16 * 25
    assert got.generation(5, 3) == 2 * (BODY + 3200) * 3 + 4 * 2 * 2 * 16 * 21
    critic = perf.model_flops(ScalarHeadModel(_config()))
    assert (critic.body, critic.head) == (BODY, 32)


def test_ppo_step_flops_is_the_hand_count():
    policy = perf.ModelFlops(body=1000, head=300, num_layers=2, num_heads=2, head_dim=4)
    critic = perf.ModelFlops(body=1000, head=10, num_layers=2, num_heads=2, head_dim=4)
    reward = perf.ModelFlops(body=2000, head=10, num_layers=1, num_heads=1, head_dim=8)
    # 4 rows, 2 samples of each of 2 prompts of 3 positions, responses of 5 tokens, top-k (the
    # actor scores its own samples), 2 epochs.
    static = PPOStatic(batch_size=4, response_length=5, eos_id=1, pad_id=0, top_k=50,
                       group_size=2, ppo_epochs=2)
    got = perf.ppo_step_flops(static, policy, critic, reward, prompt_length=3,
                              generated_tokens=16, response_length_mean=4.0)
    attention = lambda layers, width, positions, keys: 4 * layers * width * positions * keys
    # Rollout: 2 prefills of 3 positions (head once each), 16 tokens = 4 rows of 4, each row's
    # tokens reading 4, 5, 6 and 7 keys.
    rollout = 2 * (2 * 1000 * 3 + 2 * 300 + attention(2, 8, 3, 3)) \
        + 4 * (2 * 1300 * 4 + attention(2, 8, 1, 22))
    # Score over 4 x 8 positions reading 8 keys: reward model, actor and reference (LM head at
    # the 4 x 5 response positions), critic.
    forward = lambda m, width, head_positions: 2 * m.body * 32 + 2 * m.head * head_positions \
        + attention(m.num_layers, width, 32, 8)
    score = forward(reward, 8, 32) + 2 * forward(policy, 8, 20) + forward(critic, 8, 32)
    update = 2 * 3 * (forward(policy, 8, 20) + forward(critic, 8, 32))
    assert got == pytest.approx(dict(rollout=rollout, score=score, advantages=0.0, update=update,
                                     total=rollout + score + update), rel=1e-12)
    # A critic-free estimator trains and scores no critic; reused sampler logprobs skip the
    # actor's scoring pass (float32, no top-k / top-p).
    lean = perf.ppo_step_flops(PPOStatic(batch_size=4, response_length=5, eos_id=1, pad_id=0,
                                         top_k=0, estimator="grpo", group_size=2, ppo_epochs=2),
                               policy, critic, reward, 3, 16, 4.0)
    assert lean["score"] == pytest.approx(forward(reward, 8, 32) + forward(policy, 8, 20))
    assert lean["update"] == pytest.approx(2 * 3 * forward(policy, 8, 20))


def test_a_multi_turn_step_counts_the_work_its_tokens_count():
    """A multi-turn row's tokens are every row's prompt, the observations its rollout prefilled
    and the action tokens; its FLOPs count the same work: 4 prompt prefills (each sample plays
    its own episode, not one prefill per group of 2) and the 6 observation tokens, by hand."""
    import types

    policy_module, critic_module = models.CausalLM(_config()), ScalarHeadModel(_config())
    mods = types.SimpleNamespace(policy=policy_module, critic=critic_module,
                                 reward=critic_module)
    static = PPOStatic(batch_size=4, response_length=10, eos_id=1, pad_id=0, top_k=50,
                       group_size=2, reward_source="env", estimator="gae")
    policy, critic = perf.model_flops(policy_module), perf.model_flops(critic_module)
    row = {"budget/generated_tokens": 12.0, "budget/prefill_tokens": 4 * 3 + 6.0,
           "val/response_length": 3.0, "multiturn/turns_avg": 2.0,
           "multiturn/observation_tokens_avg": 1.5}
    tokens, flops = ppo_lib.step_cost(static, mods, 3)(row)
    assert tokens == 12 + 18
    attention = lambda positions, keys: 4 * 2 * 2 * 16 * positions * keys  # noqa: E731
    # 4 prompts of 3 positions (head at the last); 6 observation positions, no head, each
    # reading 3 + 10 / 2 keys; 12 decoded tokens, 4 rows of 3 reading 4, 5 and 6 keys.
    rollout = 4 * (2 * BODY * 3 + 2 * 3200 + attention(3, 3)) \
        + 2 * BODY * 6 + attention(6, 8) + 4 * (2 * (BODY + 3200) * 3 + attention(1, 15))
    no_turns = {k: v for k, v in row.items() if not k.startswith("multiturn/")}
    single = perf.ppo_step_flops(static, policy, critic, critic, 3, 12.0, 3.0)
    assert flops == pytest.approx(rollout + single["score"] + single["update"], rel=1e-12)
    assert ppo_lib.step_cost(static, mods, 3)(no_turns)[1] == pytest.approx(single["total"])


def test_device_table():
    h200 = perf.device_kind("NVIDIA H200")
    assert (h200.bfloat16_flops, h200.hbm_bandwidth) == (989e12, 4.8e12)
    assert perf.device_kind("cpu") is None and perf.peak_flops("cpu") is None
    fields = perf.step_fields(2.0, 1000, 4e12, peak=8e12)
    assert fields == {"perf/step_s": 2.0, "perf/tokens_per_s": 500.0, "perf/tflops_per_s": 2.0,
                      "perf/mfu": 0.25}
    assert "perf/mfu" not in perf.step_fields(2.0, 1000, 4e12, peak=None)


# `jax.Device.device_kind` as the runtimes report it (CUDA's device names; TPU v5p reports
# "TPU v5", v5e "TPU v5 lite", v6e "TPU v6 lite") -> the row it is.
KINDS = {
    "NVIDIA L4": "l4",
    "NVIDIA L40": "l40",
    "NVIDIA L40S": "l40s",
    "NVIDIA A10": "a10",
    "NVIDIA A10G": "a10g",
    "NVIDIA A100-SXM4-40GB": "a100",
    "NVIDIA A100-SXM4-80GB": "a100",
    "NVIDIA A100 80GB PCIe": "a100",
    "NVIDIA A100-PCIE-40GB": "a100",
    "NVIDIA A800-SXM4-80GB": "a800",
    "NVIDIA H100 80GB HBM3": "h100",
    "NVIDIA H100 PCIe": "h100 pcie",
    "NVIDIA H800": "h800",
    "NVIDIA H200": "h200",
    "NVIDIA GH200 480GB": "gh200",
    "NVIDIA B200": "b200",
    "NVIDIA GB200": "gb200",
    "Tesla V100-SXM2-16GB": "v100",
    "TPU v2": "tpu v2",
    "TPU v3": "tpu v3",
    "TPU v4": "tpu v4",
    "TPU v5 lite": "tpu v5 lite",
    "TPU v5": "tpu v5",
    "TPU v5p": "tpu v5p",
    "TPU v6 lite": "tpu v6 lite",
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_device_kind_maps_to_its_own_row(kind):
    assert perf.device_kind(kind).match == KINDS[kind]


def test_each_row_is_matched_by_its_own_name_and_unknown_kinds_by_none():
    # No row hides another, whatever the table's order.
    for row in perf.DEVICE_KINDS:
        assert perf.device_kind(row.match) is row, row.match
    for kind in ("cpu", "NVIDIA A40", "NVIDIA RTX A6000", "Tesla T4", "TPU v7x", "NVIDIA L20"):
        assert perf.device_kind(kind) is None, kind
        assert perf.peak_flops(kind, "bfloat16") is None


# (kind, dtype, precision) -> peak FLOP/s, from the datasheets' dense rates (half the
# sparse rates they print): H100 SXM bf16 989, TF32 989 / 2, FP32 67; H100 PCIe bf16 756,
# TF32 756 / 2, FP32 51; A100 bf16 312, TF32 312 / 2, FP32 19.5; L40 bf16 181, TF32 181 / 2,
# FP32 90.5; L40S TF32 366 / 2; L4 TF32 120 / 2; A10 TF32 125 / 2, FP32 31.2; A10G bf16 140 / 2,
# TF32 70 / 2, FP32 35; V100 FP32 15.7 at every precision (no TF32); TPU v5e bf16 197.
PEAKS = [
    ("NVIDIA H100 80GB HBM3", "bfloat16", "default", 989e12),
    ("NVIDIA H100 80GB HBM3", "bfloat16", "highest", 989e12),
    ("NVIDIA H100 80GB HBM3", "float32", "default", 494.5e12),
    ("NVIDIA H100 80GB HBM3", "float32", "high", 494.5e12),
    ("NVIDIA H100 80GB HBM3", "float32", "highest", 67e12),
    ("NVIDIA H100 80GB HBM3", "float32", None, 67e12),  # highest, as the models resolve it
    ("NVIDIA H100 PCIe", "bfloat16", None, 756e12),
    ("NVIDIA H100 PCIe", "float32", "default", 378e12),
    ("NVIDIA H100 PCIe", "float32", "highest", 51e12),
    ("NVIDIA H200", "float32", "high", 494.5e12),
    ("NVIDIA H200", "float32", "highest", 67e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", None, 312e12),
    ("NVIDIA A100-SXM4-80GB", "float32", "default", 156e12),
    ("NVIDIA A100-SXM4-80GB", "float32", "highest", 19.5e12),
    ("NVIDIA L40", "bfloat16", None, 181e12),
    ("NVIDIA L40", "float32", "default", 90.5e12),
    ("NVIDIA L40", "float32", "highest", 90.5e12),
    ("NVIDIA L40S", "float32", "high", 183e12),
    ("NVIDIA L4", "float32", "default", 60e12),
    ("NVIDIA A10", "float32", "default", 62.5e12),
    ("NVIDIA A10", "float32", "highest", 31.2e12),
    ("NVIDIA A10G", "bfloat16", None, 70e12),
    ("NVIDIA A10G", "float32", "default", 35e12),
    ("NVIDIA A10G", "float32", "highest", 35e12),
    ("Tesla V100-SXM2-16GB", "float32", "default", 15.7e12),
    ("Tesla V100-SXM2-16GB", "float32", "highest", 15.7e12),
    ("NVIDIA B200", "bfloat16", None, 2.25e15),
    ("NVIDIA B200", "float32", "default", None),  # no float32 rate in the table
    ("NVIDIA B200", "float32", "highest", None),
    # TPUs: bfloat16 on the MXU at every precision; float32 at default is one bfloat16 pass,
    # at high and highest several, which no datasheet rates.
    ("TPU v5 lite", "bfloat16", None, 197e12),
    ("TPU v5 lite", "bfloat16", "highest", 197e12),
    ("TPU v5 lite", "float32", "default", 197e12),
    ("TPU v5 lite", "float32", "high", None),
    ("TPU v5 lite", "float32", "highest", None),
    ("TPU v4", "float32", None, None),
    ("TPU v4", "float32", "default", 275e12),
    ("TPU v6 lite", "bfloat16", "default", 918e12),
    ("cpu", "float32", "highest", None),
]


@pytest.mark.parametrize("kind,dtype,precision,peak", PEAKS)
def test_peak_follows_the_dtype_and_the_matmul_precision_that_ran(kind, dtype, precision, peak):
    assert perf.peak_flops(kind, dtype, precision) == peak


def test_mfu_of_a_float32_run_at_default_precision_is_against_tf32():
    """An H100 doing 200 TFLOP/s of model FLOPs in float32 at default precision runs TF32:
    200 / 494.5 = 0.404 of its peak (not 200 / 67 = 2.99, an MFU above 1)."""
    peak = perf.peak_flops("NVIDIA H100 80GB HBM3", "float32", "default")
    fields = perf.step_fields(1.0, 1000, 200e12, peak)
    assert fields["perf/mfu"] == pytest.approx(200 / 494.5)
    with pytest.raises(ValueError, match="tensorfloat32"):
        perf.peak_flops("NVIDIA H100 80GB HBM3", "float32", "tensorfloat32")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from trained_tiny_pipeline(tmp_path_factory.mktemp("tiny"))


def _run_ppo(pipe, sft, rm, stats, workdir, **ppo_fields):
    config = copy.deepcopy(pipe.config)
    config.ppo.update(dict(steps=3, eval_every=2, **ppo_fields))
    with MetricsWriter(workdir, tensorboard=False) as writer:
        ppo_lib.run_ppo(config, pipe.task, pipe.policy, pipe.critic, pipe.reward_model, sft, rm,
                        stats, mesh=pipe.mesh, writer=writer, workdir=str(workdir))
    return read_metrics(workdir)


def test_run_rows_say_what_each_step_costs(tiny, tmp_path, capfd):
    pipe, sft, rm, stats = tiny
    rows = _run_ppo(pipe, sft, rm, stats, tmp_path / "phases")
    progress = capfd.readouterr().err
    ppo_rows = [r for r in rows if r["stage"] == "ppo"]
    assert [r["step"] for r in ppo_rows] == [1, 2, 3]
    static = ppo_lib.static_from_config(pipe.config, pipe.task.tokenizer)
    flops = [perf.model_flops(m) for m in (pipe.policy, pipe.critic, pipe.reward_model)]
    phases = ("rollout", "score", "advantages", "update")
    for row in ppo_rows:
        # Every row's prompt (the synthetic prompts have no padding) and response tokens.
        tokens = static.batch_size * pipe.task.prompt_length + row["budget/generated_tokens"]
        assert row["perf/tokens_per_s"] == pytest.approx(tokens / row["perf/step_s"])
        total = perf.ppo_step_flops(static, *flops, pipe.task.prompt_length,
                                    row["budget/generated_tokens"],
                                    row["val/response_length"])["total"]
        assert row["perf/tflops_per_s"] == pytest.approx(total / row["perf/step_s"] / 1e12)
        assert "perf/mfu" not in row  # no peak is known for a CPU
        assert min(row[f"timing/{p}_s"] for p in phases) > 0 and row["timing/eval_s"] >= 0
        # The phases are waited on one after the other inside the step.
        assert sum(row[f"timing/{p}_s"] for p in phases) <= row["perf/step_s"]
    # Held-out evaluations run after steps 2 and 3 (eval_every=2, and the last step).
    assert ppo_rows[0]["timing/eval_s"] == 0 < ppo_rows[1]["timing/eval_s"]
    assert re.search(r"\[ppo\] step 3/3 .*tokens_per_s=[\d.e+]+", progress), progress[-2000:]

    fused = [r for r in _run_ppo(pipe, sft, rm, stats, tmp_path / "fused", phase_timing=False)
             if r["stage"] == "ppo"]
    assert not [k for r in fused for k in r if k.startswith("timing/") and k != "timing/eval_s"]
    for a, b in zip(ppo_rows, fused):
        keys = [k for k in a if not k.startswith(("perf/", "timing/")) and k != "stage"]
        assert keys == [k for k in b if not k.startswith(("perf/", "timing/")) and k != "stage"]
        for k in keys:
            np.testing.assert_allclose(a[k], b[k], rtol=2e-5, atol=1e-6, err_msg=k)


def test_supervised_rows_carry_perf(tiny):
    pipe, *_ = tiny
    c = pipe.config
    prompt = pipe.task.prompt_length
    for stage, widths in (("sft", (prompt + pipe.task.sft["response_ids"].shape[1],)),
                          ("rm", (prompt + pipe.task.rm["chosen_ids"].shape[1],
                                  prompt + pipe.task.rm["rejected_ids"].shape[1]))):
        rows = [r for r in read_metrics(pipe.workdir) if r["stage"] == stage]
        assert len(rows) == c[stage].steps
        for row in rows:
            tokens = c[stage].batch_size * sum(widths)
            assert row["perf/tokens_per_s"] == pytest.approx(tokens / row["perf/step_s"])
            assert row["perf/tflops_per_s"] > 0


# ---- bench.py ppo ---------------------------------------------------------------------------
LAST_LINE = re.compile(r"iteration_s=(\S+) rollout_s=(\S+) score_s=(\S+) update_s=(\S+) "
                       r"tokens_per_s=(\S+) tflops_per_s=(\S+)")


def _bench(*args):
    import subprocess
    import sys

    from train_util import ROOT

    return subprocess.run([sys.executable, str(ROOT / "experiments" / "bench.py"), "ppo", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)


def test_bench_ppo_small_prints_its_last_line():
    import sys

    from train_util import ROOT

    proc = _bench("--shape=w1", "--small", "--repeats=3")
    assert proc.returncode == 0, proc.stdout[-3000:]
    lines = proc.stdout.strip().splitlines()
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    iteration, rollout, score, update, tokens_per_s, tflops_per_s = map(float, match.groups())
    result = json.loads(lines[-2])
    split = result["ma_ppo"]["phase_s"]
    assert (rollout, score) == pytest.approx((split["rollout"], split["score"]), rel=1e-3)
    assert update == pytest.approx(split["advantages"] + split["update"], rel=1e-3)
    # 64 prompts of 16 tokens, each answered with its whole budget of 16 (fixed lengths).
    assert result["generated_tokens"] == 64 * 16 and result["full_lengths"]
    assert tokens_per_s * iteration == pytest.approx(64 * (16 + 16), rel=1e-3)
    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_ppo

    config = bench_ppo.config_of(bench_ppo.setup_of("w1", True))
    policy, critic, reward = bench_ppo.modules(config)
    static = ppo_lib.static_from_config(config, policy.config)
    flops = perf.ppo_step_flops(static, *(perf.model_flops(m) for m in (policy, critic, reward)),
                                16, 64 * 16, 16)
    assert tflops_per_s * iteration * 1e12 == pytest.approx(flops["total"], rel=1e-3)
    assert "mfu=" not in lines[-1]  # no peak is known for a CPU
    # The phases are parts of the iteration: on a quiet machine they add up to it within a few
    # percent (docs/accelerators.md); here only that they are of its order.
    assert 0.5 < result["phases_vs_iteration"] < 2


def test_bench_ppo_refuses_what_cannot_run():
    proc = _bench("--shape=w3")
    assert proc.returncode == 2 and proc.stdout.strip() == (
        "bench.py ppo: --shape='w3': the shapes are w1, w2")
    # Four Gemma-2B-shaped models, their AdamW states and frozen copies exceed 40 GiB.
    proc = _bench("--shape=w2", "--capacity-gib=40")
    assert proc.returncode == 2, proc.stdout[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("bench.py ppo: --shape=w2 (four Gemma-2B-shaped models, 256 x (512 "
                           "prompt + 128 new) tokens") and "74.7 GiB" in line
    assert "of 40.0 GiB per device" in line and "what fits: --shape=w1, or --small" in line


def _small_w1_step(new_tokens: int):
    """`bench.py ppo --shape=w1 --small`'s PPO step in bfloat16, 4 prompts of 6 tokens and
    `new_tokens` new ones, on random weights: (static, models, state, actor params, RM params)."""
    import sys

    import jax

    from train_util import ROOT

    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_ppo

    config = bench_ppo.config_of(bench_ppo.Setup("w1", True, "bfloat16", 4, 6, new_tokens))
    policy, critic, reward = bench_ppo.modules(config)
    static = ppo_lib.static_from_config(config, type("T", (), dict(eos_token_id=1,
                                                                   pad_token_id=0)))
    mods = ppo_lib.make_models(config, policy, critic, reward)
    actor = models.init_params(policy, jax.random.key(0))
    rm = models.init_params(reward, jax.random.key(1))
    state = ppo_lib.initial_state(config, mods, actor, ppo_lib.initial_critic_params(
        config, critic, actor, rm, jax.random.key(2)), seed=0)
    return static, mods, state, actor, rm


def test_frozen_models_in_the_compute_dtype_score_the_same():
    """The reference and reward model held in bfloat16 (cast once per run) score exactly as the
    float32 weights cast at every forward: the same Experience, bit for bit."""
    import jax
    import jax.numpy as jnp

    from marl_jax.rollout.engine import SampleOutput
    from marl_jax.train import ppo_core
    from marl_jax.train.ppo_types import Frozen

    static, mods, state, actor, rm = _small_w1_step(new_tokens=5)
    cast = ppo_lib.frozen_models(mods, actor, rm, {"mean": 0.5, "std": 2.0})
    kernel = cast.ref_params["backbone"]["layers"]["mlp"]["up"]["kernel"]
    assert kernel.dtype == jnp.bfloat16 and actor["backbone"]["layers"]["mlp"]["up"][
        "kernel"].dtype == jnp.float32
    plain = Frozen(actor, rm, jnp.float32(0.5), jnp.float32(2.0))
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(3, 512, (4, 6)), jnp.int32)
    sample = SampleOutput(jnp.asarray(rng.integers(3, 512, (4, 5)), jnp.int32),
                          jnp.zeros((4, 5), jnp.float32), jnp.ones((4, 5), jnp.int32),
                          jnp.zeros((4, 5), jnp.float32))
    score = jax.jit(lambda frozen: ppo_core.score_phase(static, mods, state, frozen, ids,
                                                        jnp.ones_like(ids), sample))
    (exp_cast, m_cast), (exp_plain, m_plain) = score(cast), score(plain)
    for name in ("ref_logprobs", "ref_base_logprobs", "scores", "rewards", "old_logprobs"):
        np.testing.assert_array_equal(getattr(exp_cast, name), getattr(exp_plain, name), name)
    assert float(m_cast["objective/kl"]) == float(m_plain["objective/kl"])


def test_every_whole_sequence_pass_of_a_step_takes_the_fused_attention(monkeypatch):
    """Traced for a GPU in bfloat16, the scoring passes (actor, reference, critic, reward model)
    and the update's passes (actor and critic, forward and rematerialised) all call cuDNN's
    fused attention, never the reference einsums: recorded by replacing both."""
    import jax
    import jax.numpy as jnp

    from marl_jax.models import attention
    from marl_jax.rollout.engine import SampleOutput
    from marl_jax.train import phases, ppo_core

    static, mods, state, actor, rm = _small_w1_step(new_tokens=6)
    frozen = ppo_lib.frozen_models(mods, actor, rm, {"mean": 0.0, "std": 1.0})
    calls = []

    def fused(q, k, v, *, implementation, **kwargs):
        calls.append(implementation)
        return jnp.zeros(q.shape, v.dtype)

    monkeypatch.setattr(attention.jax.nn, "dot_product_attention", fused)
    monkeypatch.setattr(attention, "reference", lambda *a, **k: pytest.fail("reference einsums"))
    ids = jnp.ones((4, 6), jnp.int32)
    sample = SampleOutput(jnp.ones((4, 6), jnp.int32), jnp.zeros((4, 6)),
                          jnp.ones((4, 6), jnp.int32), jnp.zeros((4, 6)))
    with attention.target_platform("gpu"):
        exp, _ = jax.eval_shape(lambda: ppo_core.score_phase(static, mods, state, frozen, ids,
                                                            jnp.ones_like(ids), sample))
        assert len(calls) >= 4 and set(calls) == {"cudnn"}  # each model's layer scan
        scoring = len(calls)
        adv = phases.advantages.Advantages(*(jnp.zeros((4, 6)),) * 2, None,
                                           jnp.zeros((4, 6), jnp.int32))
        exp = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), exp)
        jax.eval_shape(lambda: phases.update.update(static, mods, state, exp, adv,
                                                    jax.random.key(3), frozen))
    assert len(calls) > scoring and set(calls) == {"cudnn"}
