"""The sampler/trainer mismatch measured inside the PPO step, the old-logprobs choice, and the
rollout correction applied in the one jitted step.

A random 4-layer model of width 128 shows the bfloat16 mismatch on CPUs too (its sampler and
scoring pass round differently); the default synthetic model (width 32, 2 layers) is too small
for that on CPUs (its two programs agree to ~1e-6 on most steps).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marl_jax import config_check
from marl_jax import models
from marl_jax import stages
from marl_jax.models.config import ModelConfig
from marl_jax.train import phases, ppo_core as core, ppo_types
from marl_jax.train.metrics import read_metrics

from train_util import tiny_config

MISMATCH = ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/ratio_outside_clip")
VOCAB, EOS = 64, 0
HPARAMS = ppo_types.RunHparams(lam=jnp.float32(0.95), gamma=jnp.float32(1.0), ngram=jnp.int32(3),
                          variant=jnp.int32(0))


def _model(dtype):
    cfg = ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_layers=4, num_heads=4, num_kv_heads=4, head_dim=32,
                      max_position_embeddings=128, tie_word_embeddings=True, dtype=dtype)
    return models.CausalLM(cfg)


@functools.lru_cache(maxsize=None)
def _params():
    params = models.init_params(_model("float32"), jax.random.key(0))
    return jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, params)  # a sharper policy


def _gold(documents, ids, mask):
    return ((ids % 3 == 0) * mask).sum(axis=1).astype(jnp.float32) / 8.0


def _setup(dtype, **fields):
    fields = dict(dict(estimator="reinforce_pp", reward_source="gold", batch_size=8,
                       response_length=24, eos_id=EOS, pad_id=EOS, top_k=0,
                       compute_dtype=dtype), **fields)
    static = ppo_types.PPOStatic(**fields)
    mods = ppo_types.Models(policy=_model(dtype), critic=None, reward=None,
                       actor_optimizer=optax.adam(1e-3), critic_optimizer=optax.adam(1e-3),
                       gold_fn=_gold)
    params = _params()
    state = ppo_types.PPOState(
        step=jnp.zeros((), jnp.int32), actor_params=params,
        actor_opt_state=mods.actor_optimizer.init(params), critic_params={},
        critic_opt_state={}, key=jax.random.key_data(jax.random.key(0)),
        kl_coef=jnp.float32(0.05), skipped_updates=jnp.zeros((), jnp.float32),
        generated_tokens=jnp.zeros((), jnp.float32), prefill_tokens=jnp.zeros((), jnp.float32))
    frozen = ppo_types.Frozen(params, None, jnp.float32(0.0), jnp.float32(1.0))
    prompts = jax.random.randint(jax.random.key(1), (static.prompts_per_step, 8), 1, VOCAB)
    return static, mods, state, frozen, prompts, jnp.ones_like(prompts)


def _rollout(dtype, **fields):
    static, mods, state, frozen, ids, mask = _setup(dtype, **fields)
    exp, metrics = jax.jit(functools.partial(core.rollout_phase, static, mods))(
        state, frozen, ids, mask)
    return static, exp, metrics


def test_bfloat16_has_a_mismatch_that_float32_with_trainer_logprobs_does_not():
    _, _, bf16 = _rollout("bfloat16")
    _, _, fp32 = _rollout("float32", old_logprobs="trainer")
    print({k: (float(bf16[k]), float(fp32[k])) for k in MISMATCH})
    # float32 agrees to float32 rounding; bfloat16 (2^-9 relative rounding) by far more.
    assert float(fp32["rollout/logprob_diff_max"]) < 1e-4
    assert float(bf16["rollout/logprob_diff_max"]) > 1e-4
    assert float(bf16["rollout/logprob_diff_max"]) > 100 * float(fp32["rollout/logprob_diff_max"])
    assert float(bf16["rollout/logprob_diff_max"]) > float(bf16["rollout/logprob_diff_mean"])
    assert float(fp32["rollout/ratio_outside_clip"]) == 0.0


def test_mismatch_metrics_by_hand():
    trainer = jnp.array([[-1.0, -2.0, -0.5], [-0.1, 0.0, 0.0]])
    sampler = jnp.array([[-1.5, -2.0, -0.4], [-0.3, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 1], [1, 0, 0]])
    m = phases.score.rollout_mismatch(trainer, sampler, mask, 0.2)
    np.testing.assert_allclose(m["rollout/logprob_diff_mean"], (0.5 + 0 + 0.1 + 0.2) / 4,
                               rtol=1e-6)
    np.testing.assert_allclose(m["rollout/logprob_diff_max"], 0.5, rtol=1e-6)
    # exp(0.5) = 1.65 and exp(0.2) = 1.22 lie outside [0.8, 1.2]; exp(-0.1) = 0.90 does not.
    np.testing.assert_allclose(m["rollout/ratio_outside_clip"], 0.5)


def test_default_old_logprobs_are_the_trainers_in_bfloat16_and_under_top_k():
    base = dict(batch_size=8, response_length=4, eos_id=0, pad_id=0, top_k=0)
    assert ppo_types.PPOStatic(**base).reuses_sampler_logprobs
    assert not ppo_types.PPOStatic(**base, compute_dtype="bfloat16").reuses_sampler_logprobs
    assert not ppo_types.PPOStatic(**dict(base, top_k=50)).reuses_sampler_logprobs
    assert not ppo_types.PPOStatic(**base, rollout_correction="token").reuses_sampler_logprobs
    assert ppo_types.PPOStatic(**base, compute_dtype="bfloat16",
                          old_logprobs="sampler").reuses_sampler_logprobs


def _first_update(dtype, **fields):
    static, mods, state, frozen, ids, mask = _setup(dtype, **fields)
    exp, roll = jax.jit(functools.partial(core.rollout_phase, static, mods))(
        state, frozen, ids, mask)
    _, metrics = jax.jit(functools.partial(core.update_phase, static, mods))(
        state, exp, roll, HPARAMS, None, frozen)
    return exp, roll, metrics


def test_trainer_old_logprobs_make_the_first_ratio_one_in_bfloat16():
    """One epoch of one minibatch: the ratio is taken before any update, so with the trainer's
    old logprobs it is 1 up to the rounding of the gradient program (bfloat16 rounds to 2^-9
    relative: mean squared log-ratios of order 1e-5 at most)."""
    _, roll, metrics = _first_update("bfloat16", old_logprobs="trainer")
    print(float(metrics["val/ratio"]), float(metrics["policy/approxkl_avg"]))
    assert float(roll["rollout/logprob_diff_max"]) > 1e-4  # the sampler's are not the same
    assert abs(float(metrics["val/ratio"]) - 1.0) < 1e-3
    assert float(metrics["policy/approxkl_avg"]) < 1e-5
    assert float(metrics["policy/clipfrac_avg"]) == 0.0


def test_sampler_old_logprobs_measure_the_first_step_only():
    static, mods, state, frozen, ids, mask = _setup("bfloat16", old_logprobs="sampler")
    rollout = jax.jit(functools.partial(core.rollout_phase, static, mods))
    _, first = rollout(state, frozen, ids, mask)
    _, later = rollout(state.replace(step=jnp.int32(1)), frozen, ids, mask)
    assert float(first["rollout/logprob_diff_max"]) > 1e-4
    assert all(np.isnan(float(later[k])) for k in MISMATCH)


@pytest.mark.parametrize("estimator,level,term", [
    ("reinforce_pp", "token", "fixed"), ("grpo", "sequence", "fixed"),
    ("macro_mc", "macro", "randomized"), ("dr_grpo", "macro", "perplexity")])
def test_correction_weights_in_the_step_match_their_own_computation(estimator, level, term):
    fields = dict(estimator=estimator, rollout_correction=level, rollout_is_cap=1.0,
                  variants=((term, "equal", "weighted"),), mc_rollouts=2, mc_branch_points=2)
    if estimator in ("grpo", "dr_grpo"):
        fields["group_size"] = 2
    exp, roll, metrics = _first_update("bfloat16", **fields)
    assert exp.sampler_logprobs is not None
    static = ppo_types.PPOStatic(batch_size=8, response_length=24, eos_id=EOS, pad_id=EOS,
                            **{k: v for k, v in fields.items() if k == "variants"})
    key = ppo_types.step_keys(_setup("bfloat16")[2])[1]
    segments = phases.advantages.segment_ids_for(static, HPARAMS, exp, key)[term]
    t = np.asarray(exp.old_logprobs, np.float64)
    s = np.asarray(exp.sampler_logprobs, np.float64)
    valid = np.asarray(exp.response_mask) != 0
    diff = np.where(valid, t - s, 0.0)
    if level == "sequence":
        diff = np.broadcast_to(diff.sum(axis=1, keepdims=True), diff.shape)
    elif level == "macro":
        seg = np.asarray(segments)
        diff = np.stack([[diff[b][(seg[b] == seg[b, j]) & valid[b]].sum()
                          for j in range(diff.shape[1])] for b in range(diff.shape[0])])
    raw = np.exp(diff)
    np.testing.assert_allclose(metrics["rollout/is_weight_mean"],
                               np.minimum(raw, 1.0)[valid].mean(), rtol=1e-4)
    np.testing.assert_allclose(metrics["rollout/is_weight_capped_frac"],
                               (raw > 1.0)[valid].mean(), atol=1e-6)
    assert 0 < float(metrics["rollout/is_weight_capped_frac"]) < 1


@pytest.mark.parametrize("field,value,allowed", [
    ("ppo.rollout_correction", "row", "('none', 'token', 'sequence', 'macro', 'turn')"),
    ("ppo.old_logprobs", "actor", "('auto', 'trainer', 'sampler')"),
    ("ppo.rollout_is_cap", 0.5, ">= 1"),
    ("ppo.loss_aggregation", "mean", "token_sum"),
])
def test_bad_values_get_one_line_naming_the_field(field, value, allowed):
    with pytest.raises(ValueError) as err:
        config_check.validate_config(tiny_config(**{field: value}))
    message = str(err.value)
    assert "\n" not in message and f"config.{field}=" in message and allowed in message


def test_a_bfloat16_pipeline_logs_mismatch_and_weights_every_ppo_row(tmp_path):
    stages.run(tiny_config(**{"ppo.eval_every": 0, "model.dtype": "bfloat16",
                                    "ppo.rollout_correction": "macro"}), str(tmp_path))
    rows = [r for r in read_metrics(str(tmp_path)) if r.get("stage") == "ppo"]
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/logprob_diff_max"] >= row["rollout/logprob_diff_mean"] >= 0
        assert 0 < row["rollout/is_weight_mean"] <= 2.0
        assert 0 <= row["rollout/is_weight_capped_frac"] <= 1
