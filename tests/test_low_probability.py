"""Low-probability termination (SAE): segments of hand cases and of a per-row reference loop
(threshold and quantile, isolate_last, padding, within turns), the rule inside a PPO step (its
advantages are macro GAE on segments cut by hand from the step's old logprobs; the entropy rule
beside it, selected by the traced variant; the experiment's measured macro length), and the
settings refused in one line."""
import dataclasses
import fractions
import functools
import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from test_masked_spans import _trajectory
from test_termination import assert_valid_segment_ids, mask_from_lengths
from train_util import ppo_setup, tiny_config

from marl_jax import experiment
from marl_jax.config_check import validate_config
from marl_jax.macro import advantage
from marl_jax.macro.termination import low_probability, segment
from marl_jax.train import ppo as ppo_lib, ppo_core as core

B, T = 6, 16  # one shape for the loop comparisons, so each setting compiles once


def reference_ids(logprobs, mask, *, quantile=None, threshold=None, isolate_last=True,
                  turn_ids=None):
    """The rule token by token: over a row's valid (action) tokens in order, a macro starts at
    the first, after a low-probability token, at a turn change and, with `isolate_last`, at the
    last token of the row (of each turn). Low: probability below `threshold`, or among the k =
    ceil(quantile * L) lowest logprobs of the row's L tokens (ties with the k-th included), k in
    exact rational arithmetic."""
    out = np.zeros(mask.shape, np.int32)
    for b in range(mask.shape[0]):
        where = [t for t in range(mask.shape[1]) if mask[b, t]]
        if not where:
            continue
        lp = [float(logprobs[b, t]) for t in where]
        turn = [0 if turn_ids is None else int(turn_ids[b, t]) for t in where]
        if threshold is not None:
            low = [x < math.log(threshold) for x in lp]
        else:
            q = fractions.Fraction(quantile).limit_denominator(1000)
            k = max(1, math.ceil(q * len(lp)))
            low = [x <= sorted(lp)[k - 1] for x in lp]
        macro = 0
        for i, t in enumerate(where):
            last_of_turn = i == len(where) - 1 or turn[i + 1] != turn[i]
            if i > 0 and (low[i - 1] or turn[i] != turn[i - 1]
                          or (isolate_last and last_of_turn)):
                macro += 1
            out[b, t] = macro
    return out


def test_hand_cases():
    p = np.array([[0.9, 0.05, 0.8, 0.7, 0.01, 0.6, 0.5, 0.02],
                  [0.5, 0.5, 0.02, 0.9, 0.01, 0.01, 0.01, 0.01],
                  [0.03, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]], np.float32)
    logprobs, mask = np.log(p), mask_from_lengths([7, 4, 1], 8)
    # Threshold 0.1: tokens 1 (0.05) and 4 (0.01) of row 0 end macros; the 0.02 at 7 is padding.
    # Row 1: token 2 ends one, then the last token 3 is alone anyway.
    np.testing.assert_array_equal(low_probability(logprobs, mask, threshold=0.1), [
        [0, 0, 1, 1, 1, 2, 3, 0],
        [0, 0, 0, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(
        low_probability(logprobs, mask, threshold=0.1, isolate_last=False), [
            [0, 0, 1, 1, 1, 2, 2, 0],
            [0, 0, 0, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0]])
    # Quantile 0.3: k = ceil(2.1) = 3 in row 0 (0.01, 0.05, 0.5: token 6, the last, ends
    # nothing); k = ceil(1.2) = 2 in row 1, where 0.02 and the two tied 0.5 all end macros.
    np.testing.assert_array_equal(
        low_probability(logprobs, mask, quantile=0.3, isolate_last=False), [
            [0, 0, 1, 1, 1, 2, 2, 0],
            [0, 1, 2, 3, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0]])
    # A higher threshold cuts more: 0.55 adds 0.5 (token 6 of row 0, the last) and row 1's 0.5s.
    np.testing.assert_array_equal(
        segment("low_probability", mask, logprobs=logprobs, low_probability_threshold=0.55,
                low_probability_quantile=0.9, isolate_last=False), [
            [0, 0, 1, 1, 1, 2, 2, 0],
            [0, 1, 2, 3, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0, 0]])


@pytest.mark.parametrize("isolate_last", [True, False])
def test_segments_equal_the_reference_loop(isolate_last):
    rng = np.random.default_rng(0)
    mask = mask_from_lengths([16, 9, 1, 0, 4, 12], T)
    for seed in range(3):
        logprobs = np.log(rng.random((B, T))).astype(np.float32)
        if seed == 2:  # ties at the quantile's cut
            logprobs = np.round(logprobs, 0)
        # What padding holds is never read.
        padded = np.where(mask != 0, logprobs, -50.0).astype(np.float32)
        for quantile in (0.1, 0.2, 1 / 3, 0.5, 1.0):
            want = reference_ids(logprobs, mask, quantile=quantile, isolate_last=isolate_last)
            got = low_probability(padded, mask, quantile=quantile, isolate_last=isolate_last)
            assert_valid_segment_ids(got, mask, isolate_last)
            np.testing.assert_array_equal(got, want, err_msg=f"quantile {quantile}")
        for threshold in (0.05, 0.3, 0.8):
            want = reference_ids(logprobs, mask, threshold=threshold, isolate_last=isolate_last)
            got = low_probability(padded, mask, threshold=threshold, isolate_last=isolate_last)
            np.testing.assert_array_equal(got, want, err_msg=f"threshold {threshold}")
    # Quantile 1: every token ends a macro, token-level segments.
    np.testing.assert_array_equal(low_probability(logprobs, mask, quantile=1.0),
                                  segment("fixed", mask, n=1))


def test_traced_quantile_and_threshold_under_jit():
    logprobs = np.log(np.random.default_rng(1).random((B, T))).astype(np.float32)
    mask = mask_from_lengths([16, 9, 1, 0, 4, 12], T)
    by_quantile = jax.jit(lambda lp, m, q: low_probability(lp, m, quantile=q))
    by_threshold = jax.jit(lambda lp, m, p: low_probability(lp, m, threshold=p))
    for level in (0.2, 0.5):
        np.testing.assert_array_equal(by_quantile(logprobs, mask, level),
                                      reference_ids(logprobs, mask, quantile=level))
        np.testing.assert_array_equal(by_threshold(logprobs, mask, level),
                                      reference_ids(logprobs, mask, threshold=level))


def test_within_turns_equals_the_reference_loop():
    # By hand: turns of 3, 2 and 3 action tokens; threshold 0.1 marks tokens 0 and 5 (action
    # ranks 0 and 3): [0][1 2] | [3][4] | [5 6 7] without isolating; with it each turn's last
    # token is alone: [0][1][2] | [3][4] | [5 6][7].
    kinds, turn = "aaaooaaoaaa", [0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    mask = np.array([[k == "a" for k in kinds]], np.int32)
    p = np.array([[0.05, 0.9, 0.9, 1, 1, 0.01, 0.9, 1, 0.9, 0.9, 0.9]], np.float32)
    ids = segment("low_probability", mask, logprobs=np.log(p), turn_ids=np.array([turn]),
                  low_probability_threshold=0.1, isolate_last=False)
    np.testing.assert_array_equal(np.asarray(ids)[0][mask[0] != 0], [0, 1, 1, 2, 3, 4, 4, 4])
    ids = segment("low_probability", mask, logprobs=np.log(p), turn_ids=np.array([turn]),
                  low_probability_threshold=0.1)
    np.testing.assert_array_equal(np.asarray(ids)[0][mask[0] != 0], [0, 1, 2, 3, 4, 5, 5, 6])
    for seed in range(3):
        mask, turn_ids, logprobs, _ = _trajectory(seed)
        for isolate_last in (True, False):
            for knobs, kwargs in ((dict(quantile=0.3), dict(low_probability_quantile=0.3)),
                                  (dict(threshold=0.1), dict(low_probability_threshold=0.1))):
                got = segment("low_probability", mask, logprobs=logprobs, turn_ids=turn_ids,
                              isolate_last=isolate_last, **kwargs)
                np.testing.assert_array_equal(got, reference_ids(
                    logprobs, mask, turn_ids=turn_ids, isolate_last=isolate_last, **knobs))


def test_bad_input_names_the_argument():
    mask = mask_from_lengths([3, 2], 4)
    logprobs = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="exactly one of quantile and threshold"):
        low_probability(logprobs, mask)
    with pytest.raises(ValueError, match="exactly one of quantile and threshold"):
        low_probability(logprobs, mask, quantile=0.2, threshold=0.1)
    for bad in (0.0, -0.1, 1.5, np.array([0.2, 0.3])):
        with pytest.raises(ValueError, match="quantile must be a scalar in"):
            low_probability(logprobs, mask, quantile=bad)
        with pytest.raises(ValueError, match="threshold must be a scalar in"):
            low_probability(logprobs, mask, threshold=bad)
    with pytest.raises(ValueError, match="logprobs"):
        low_probability(np.zeros((2, 5)), mask, quantile=0.2)
    with pytest.raises(ValueError, match="response_mask"):
        low_probability(logprobs, np.array([[1, 0, 1, 0], [1, 1, 0, 0]]), quantile=0.2)
    with pytest.raises(ValueError, match="logprobs .* is required for the low_probability"):
        segment("low_probability", mask)


@pytest.mark.parametrize("field, value, message", [
    ("low_probability_quantile", 0.0, "must be in \\(0, 1\\]"),
    ("low_probability_quantile", 1.5, "must be in \\(0, 1\\]"),
    ("low_probability_threshold", -0.1, "must be in \\[0, 1\\]"),
    ("low_probability_threshold", 2.0, "must be in \\[0, 1\\]"),
    ("entropy_quantile", 0.0, "must be in \\(0, 1\\]"),
    ("temperature", 0.0, "ppo.temperature=0 decodes greedily"),
])
def test_bad_settings_are_one_line(field, value, message):
    config = tiny_config(**{"ppo.termination": "low_probability"})
    validate_config(config)
    config.ppo[field] = value
    with pytest.raises(ValueError, match=message) as error:
        validate_config(config)
    assert "\n" not in str(error.value) and str(error.value).startswith("config.ppo.")
    # The same settings as an experiment arm's overrides fail when the runs are planned.
    config = tiny_config()
    config.experiment.arms = ("ppo", "low_probability")
    if field == "temperature":
        config.ppo.temperature = 0.0
        overrides = {}
    else:
        overrides = {field: value}
    config.ppo.arm_overrides = ml_collections.ConfigDict({"low_probability": overrides})
    with pytest.raises(ValueError, match=f"arm 'low_probability': .*{message}"):
        experiment.plan_runs(config)


def test_arms_set_the_terminations_and_their_knobs():
    config = tiny_config()
    config.experiment.arms = ("ppo", "low_probability", "entropy")
    config.experiment.add_controls = True
    config.ppo.arm_overrides = ml_collections.ConfigDict({
        "low_probability": {"low_probability_threshold": 0.25},
        "entropy": {"entropy_quantile": 0.4}})
    runs = {r.arm: r for r in experiment.plan_runs(config) if r.seed == 0}
    assert list(runs) == ["ppo", "low_probability", "low_probability_ctrl", "entropy",
                          "entropy_ctrl"]
    # Their lengths are measured on the first rollouts, the controls share their arm's group.
    assert runs["low_probability"].ppo["mean_macro_length"] is None
    assert runs["low_probability_ctrl"].group == runs["low_probability"].group
    assert runs["entropy_ctrl"].group == runs["entropy"].group != runs["ppo"].group
    for arm, field, value in (("low_probability", "low_probability_threshold", 0.25),
                              ("entropy", "entropy_quantile", 0.4)):
        group = experiment.group_config(config, runs[arm])
        static = ppo_lib.static_from_config(group, _Tokenizer())
        assert getattr(static, field) == value
    config.ppo.arm_overrides = ml_collections.ConfigDict({"low_probability": {
        "termination": "low_prob"}})
    with pytest.raises(ValueError, match="arm 'low_probability': termination='low_prob'"):
        experiment.plan_runs(config)


class _Tokenizer:
    eos_token_id, pad_token_id = 1, 0


@pytest.fixture(scope="module")
def tiny_pipe(tmp_path_factory):
    """The tiny pipeline's models as initialised, untrained (the rule needs a policy's samples,
    not good ones): (pipeline, policy params, reward-model params, reward statistics)."""
    from marl_jax import pipeline as pipeline_lib
    from marl_jax.train import build

    pipe = pipeline_lib.Pipeline(tiny_config(), str(tmp_path_factory.mktemp("low_probability")))
    rm = build.models.init_params(pipe.reward_model, jax.random.key(1))
    yield pipe, pipe.initial_params(), rm, {"mean": 0.0, "std": 1.0}
    pipe.close()


def test_ppo_step_advantages_are_macro_gae_on_hand_cut_segments(tiny_pipe):
    pipe = tiny_pipe[0]
    cfg, static, mods, state, frozen = ppo_setup(
        tiny_pipe, termination="low_probability", low_probability_quantile=0.3,
        entropy_quantile=0.25)
    # Both rules in one program, the traced variant picks one.
    weighting, aggregation = cfg.ppo.value_weighting, cfg.ppo.reward_aggregation
    static = dataclasses.replace(static, variants=(
        ("entropy", weighting, aggregation), ("low_probability", weighting, aggregation)))
    ids, mask = pipe.task.rl["ids"][:8], pipe.task.rl["mask"][:8]
    exp, _ = jax.jit(functools.partial(core.rollout_phase, static, mods))(state, frozen, ids,
                                                                          mask)
    resp = np.asarray(exp.response_mask)
    logprobs, entropies = np.asarray(exp.old_logprobs), np.asarray(exp.entropies)
    want = {"low_probability": reference_ids(logprobs, resp, quantile=0.3),
            "entropy": _entropy_reference(entropies, resp, 0.25)}
    assert not np.array_equal(want["low_probability"], want["entropy"])
    adv_phase = jax.jit(functools.partial(core.advantages_phase, static, mods))
    for variant, (name, _, _) in enumerate(static.variants):
        hparams = ppo_lib.hparams_from_config(cfg.ppo, variant)
        adv, metrics = adv_phase(state, frozen, hparams, exp)
        np.testing.assert_array_equal(adv.segment_ids, want[name], err_msg=name)
        ref_adv, ref_ret = advantage.macro_gae(
            np.asarray(exp.values, np.float64), np.asarray(exp.rewards, np.float64), resp,
            want[name], gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, value_weighting=weighting,
            reward_aggregation=aggregation)
        np.testing.assert_allclose(adv.advantages, ref_adv, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(adv.returns, ref_ret, atol=1e-5, err_msg=name)
        length = resp.sum() / (want[name].max(axis=1) + 1)[resp.sum(axis=1) > 0].sum()
        np.testing.assert_allclose(metrics["macro/len_avg"], length, rtol=1e-6)
    # The experiment's measured L of a low_probability arm: its first rollout, cut the same way.
    measured = jax.jit(functools.partial(experiment._mean_macro_length_at_start, static, mods))(
        state, frozen, ppo_lib.hparams_from_config(cfg.ppo, 1), ids, mask, None)
    np.testing.assert_allclose(measured, length, rtol=1e-6)
    # A threshold instead of the quantile (probability below 0.3), on the same rollout made a
    # trajectory of two turns: tokens 5 and 6 an observation span, turn 1 from token 7 on.
    static = dataclasses.replace(static, low_probability_threshold=0.3)
    positions = np.arange(resp.shape[1])[None]
    actions = resp * ((positions < 5) | (positions >= 7))
    turns = np.broadcast_to(positions >= 7, resp.shape).astype(np.int32)
    adv, _ = jax.jit(functools.partial(core.advantages_phase, static, mods))(
        state, frozen, ppo_lib.hparams_from_config(cfg.ppo, 1),
        exp.replace(action_mask=jnp.asarray(actions), turn_ids=jnp.asarray(turns)))
    want = reference_ids(logprobs, actions, threshold=0.3, turn_ids=turns)
    assert want.max() > 2
    np.testing.assert_array_equal(np.asarray(adv.segment_ids) * actions, want)
    ref_adv, _ = advantage.macro_gae(
        np.asarray(exp.values, np.float64), np.asarray(exp.rewards, np.float64), actions, want,
        gamma=cfg.ppo.gamma, lam=cfg.ppo.lam, value_weighting=weighting,
        reward_aggregation=aggregation)
    np.testing.assert_allclose(adv.advantages, ref_adv, atol=1e-5)


def _entropy_reference(entropies, mask, quantile):
    """Entropy rule by a loop: a macro starts at token 0, at the k = ceil(quantile * L) highest
    entropies (ties included) and at the last token."""
    out = np.zeros(mask.shape, np.int32)
    for b in range(mask.shape[0]):
        length = int(mask[b].sum())
        if length == 0:
            continue
        q = fractions.Fraction(quantile).limit_denominator(1000)
        cut = sorted(entropies[b, :length].tolist(), reverse=True)[max(1, math.ceil(
            q * length)) - 1]
        macro = 0
        for t in range(length):
            if t > 0 and (entropies[b, t] >= cut or t == length - 1):
                macro += 1
            out[b, t] = macro
    return out


def test_bfloat16_logprobs_are_read_in_float32():
    logprobs = np.log(np.random.default_rng(2).random((B, T))).astype(np.float32)
    mask = mask_from_lengths([16, 9, 1, 0, 4, 12], T)
    np.testing.assert_array_equal(
        low_probability(jnp.asarray(logprobs, jnp.bfloat16), jnp.asarray(mask), quantile=0.2),
        reference_ids(np.asarray(jnp.asarray(logprobs, jnp.bfloat16), np.float32), mask,
                      quantile=0.2))
