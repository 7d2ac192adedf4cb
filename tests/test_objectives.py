"""The policy objectives: the ratio's unit (token, macro, sequence) and form (product,
geometric), decoupled and dual clipping, dynamic sampling, overlong shaping and truncation
masking, the GSPO and DAPO records, and their config errors. Every number is computed here by
hand (numpy) or by the published formula, not by the code under test."""
import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import estimators, experiment, losses
from marl_jax.config_check import validate_config
from marl_jax.macro import termination
from marl_jax.macro.checks import check_mask, check_rank, check_same_shape
from marl_jax.train import optim, phases, ppo as ppo_lib, ppo_core as core, ppo_types

from train_util import ppo_setup, tiny_config, trained_tiny_pipeline

# Two responses of three macros each: row 0 has 5 tokens, row 1 has 4 and one pad.
MASK = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
SEGMENTS = np.array([[0, 0, 1, 2, 2], [0, 1, 1, 2, 0]])
LOGP = np.array([[-1.0, -0.5, -2.0, -0.3, -1.2], [-0.8, -1.5, -0.2, -0.9, 0.0]])
DELTA = np.array([[0.1, 0.15, -0.3, 0.02, -0.05], [0.25, -0.1, 0.05, -0.4, 0.0]])
OLD = LOGP - DELTA
# Each macro's advantage on its tokens (as macro GAE gives them).
ADV = np.array([[0.5, 0.5, -1.0, 2.0, 2.0], [-0.7, 1.5, 1.5, -0.3, 0.0]])
WEIGHTS = np.array([[1.0, 0.8, 1.2, 0.9, 1.1], [1.3, 0.7, 1.0, 1.0, 0.0]])


def _units(level, segments, mask):
    """(row, [token positions]) of every unit, by hand."""
    out = []
    for b in range(mask.shape[0]):
        valid = [t for t in range(mask.shape[1]) if mask[b, t]]
        if level == "token":
            out += [(b, [t]) for t in valid]
        elif level == "sequence":
            out += [(b, valid)] if valid else []
        else:
            for u in sorted({segments[b, t] for t in valid}):
                out.append((b, [t for t in valid if segments[b, t] == u]))
    return out


def _by_hand(level, form, aggregation, *, low=0.2, high=0.2, dual=None, weights=None,
             logp=LOGP, old=OLD, adv=ADV, mask=MASK, segments=SEGMENTS):
    """The loss and its gradient with respect to logp, derived by hand: each unit's
    l_u = w_u max(-A_u r_u, -A_u clip(r_u)), dl_u/ds_u = -w_u A_u r_u where the unclipped term
    is the active one (else 0), ds_u/dlogp_t = 1 (product) or 1 / n_u (geometric), and the
    aggregation's weight of each unit."""
    units = _units(level, segments, mask)
    rows = sorted({b for b, _ in units})
    per_row = {b: sum(1 for r, _ in units if r == b) for b in rows}
    loss, grad = 0.0, np.zeros(logp.shape)
    for b, tokens in units:
        d = np.array([logp[b, t] - old[b, t] for t in tokens])
        s = d.sum() if form == "product" else d.mean()
        r = np.exp(s)
        a = np.mean([adv[b, t] for t in tokens])
        w = 1.0 if weights is None else np.mean([weights[b, t] for t in tokens])
        unclipped, clipped = -a * r, -a * np.clip(r, 1 - low, 1 + high)
        term, slope = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
        if dual is not None and a < 0 and -a * dual < term:
            term, slope = -a * dual, 0.0
        if aggregation == "token_mean":
            k = 1.0 / len(units)
        elif aggregation == "sequence_mean":
            k = 1.0 / (len(rows) * per_row[b])
        else:
            k = 1.0 / (len(rows) * mask.shape[1])
        loss += k * w * term
        for t in tokens:
            grad[b, t] += k * w * slope * (1.0 if form == "product" else 1.0 / len(tokens))
    return loss, grad


def _loss_and_grad(**kw):
    def fn(lp):
        return losses.ppo_policy_loss(lp, jnp.asarray(OLD, jnp.float32),
                                      jnp.asarray(ADV, jnp.float32), jnp.asarray(MASK), **kw)
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(jnp.asarray(LOGP, jnp.float32))
    return float(loss), np.asarray(grad), metrics


@pytest.mark.parametrize("aggregation", losses.POLICY_AGGREGATIONS)
@pytest.mark.parametrize("level, form", [("token", "product"), ("macro", "product"),
                                         ("macro", "geometric"), ("sequence", "product"),
                                         ("sequence", "geometric")])
def test_each_ratio_level_loss_and_gradient_by_hand(level, form, aggregation):
    loss, grad, _ = _loss_and_grad(aggregation=aggregation, ratio_level=level, ratio_form=form,
                                   segment_ids=jnp.asarray(SEGMENTS))
    want_loss, want_grad = _by_hand(level, form, aggregation)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    # The hand batch has clipped and unclipped units at every macro level: a gradient that is 0
    # on some macro and not on another.
    if level == "macro":
        assert (np.abs(want_grad) > 0).any() and (want_grad[MASK != 0] == 0).any()


def test_macro_ratio_with_weights_asymmetric_and_dual_clip_by_hand():
    for form in losses.RATIO_FORMS:
        loss, grad, metrics = _loss_and_grad(
            ratio_level="macro", ratio_form=form, segment_ids=jnp.asarray(SEGMENTS),
            is_weights=jnp.asarray(WEIGHTS, jnp.float32), cliprange_low=0.1,
            cliprange_high=0.3, dual_clip=1.05)
        want_loss, want_grad = _by_hand("macro", form, "token_mean", low=0.1, high=0.3,
                                        dual=1.05, weights=WEIGHTS)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    # Macro 0 of row 1 (one token, s = 0.25, A = -0.7): -A r = 0.90 > 1.05 x 0.7 = 0.735, so
    # the dual bound is the active term, on one of the six macros; macro 1 of row 0 (s = -0.3,
    # A = -1) is clipped at 0.8 < 1.05 and macro 2 of row 1 (A = -0.3) at 0.24 < 0.315.
    _, _, metrics = _loss_and_grad(ratio_level="macro", segment_ids=jnp.asarray(SEGMENTS),
                                   dual_clip=1.05)
    np.testing.assert_allclose(float(metrics["dual_clipfrac"]), 1 / 6)


def _ppo_policy_loss_before(logprobs, old_logprobs, advantages, mask, *, cliprange=0.2,
                            aggregation="token_mean", is_weights=None):
    """`losses.ppo_policy_loss` as it was before the ratio's unit became a choice, verbatim."""
    check_rank(logprobs, 2, "logprobs")
    check_same_shape(logprobs, "logprobs", old_logprobs=old_logprobs, advantages=advantages,
                     mask=mask)
    check_mask(mask, "mask", left_aligned=False)
    valid = jnp.asarray(mask) != 0
    log_ratio = jnp.where(valid, jnp.asarray(logprobs, jnp.float32) - old_logprobs, 0)
    ratio = jnp.exp(log_ratio)
    advantages = jnp.where(valid, jnp.asarray(advantages, jnp.float32), 0)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1 - cliprange, 1 + cliprange)
    per_token = jnp.maximum(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * jax.lax.stop_gradient(jnp.asarray(is_weights, jnp.float32))
    loss = losses.aggregate_tokens(per_token, valid, aggregation)
    ratio_mean = losses.masked_mean(ratio, valid)
    metrics = {
        "clipfrac": losses.masked_mean((clipped > unclipped).astype(jnp.float32), valid),
        "approxkl": 0.5 * losses.masked_mean(log_ratio * log_ratio, valid),
        "policy_kl": losses.masked_mean(-log_ratio, valid),
        "ratio_mean": ratio_mean,
        "ratio_var": losses.masked_mean(jnp.square(ratio - ratio_mean), valid),
    }
    return loss, metrics


def _random_batch(seed, batch=6, width=9):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, width + 1, size=batch)
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    logp = rng.normal(-1.0, 0.5, (batch, width)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (batch, width))).astype(np.float32)
    adv = rng.normal(0, 1, (batch, width)).astype(np.float32)
    weights = rng.uniform(0.5, 1.5, (batch, width)).astype(np.float32)
    return jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask), \
        jnp.asarray(weights)


@pytest.mark.parametrize("aggregation", losses.POLICY_AGGREGATIONS)
def test_token_level_is_the_loss_before_bit_for_bit(aggregation):
    logp, old, adv, mask, weights = _random_batch(0)
    for w in (None, weights):
        def value_and_grad(fn):
            return jax.jit(jax.value_and_grad(lambda lp: fn(lp, old, adv, mask, cliprange=0.15,
                                                            aggregation=aggregation,
                                                            is_weights=w), has_aux=True))(logp)
        (new, new_m), new_g = value_and_grad(losses.ppo_policy_loss)
        (ref, ref_m), ref_g = value_and_grad(_ppo_policy_loss_before)
        assert np.asarray(new).tobytes() == np.asarray(ref).tobytes()
        assert np.asarray(new_g).tobytes() == np.asarray(ref_g).tobytes()
        for key, value in ref_m.items():
            assert np.asarray(new_m[key]).tobytes() == np.asarray(value).tobytes(), key


@pytest.mark.parametrize("aggregation", losses.POLICY_AGGREGATIONS)
def test_macro_level_with_one_token_macros_equals_token_level(aggregation):
    logp, old, adv, mask, weights = _random_batch(1)
    one_token = termination.fixed_ngram(mask, 1)
    for form in losses.RATIO_FORMS:
        def value_and_grad(**kw):
            return jax.value_and_grad(lambda lp: losses.ppo_policy_loss(
                lp, old, adv, mask, aggregation=aggregation, is_weights=weights,
                cliprange_low=0.1, cliprange_high=0.25, dual_clip=2.0, **kw)[0])(logp)
        token, token_g = value_and_grad()
        macro, macro_g = value_and_grad(ratio_level="macro", ratio_form=form,
                                        segment_ids=one_token)
        assert float(macro) == float(token)
        np.testing.assert_array_equal(np.asarray(macro_g), np.asarray(token_g))


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean"])
def test_sequence_geometric_is_gspo(aggregation):
    """GSPO (Zheng et al., 2025, eq. 5-7): s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|),
    J = 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i), and its gradient
    1/G sum_i [unclipped] s_i A_i (1 / |y_i|) sum_t grad log pi(y_i,t)."""
    logp, old, _, mask, _ = _random_batch(2)
    mask = mask.at[:, 0].set(1)  # every response has a token
    seq_adv = np.random.default_rng(3).normal(0, 1, mask.shape[0])
    adv = jnp.asarray(seq_adv[:, None] * np.asarray(mask), jnp.float32)
    eps_l, eps_h = 0.05, 0.08
    (loss, _), grad = jax.value_and_grad(lambda lp: losses.ppo_policy_loss(
        lp, old, adv, mask, aggregation=aggregation, ratio_level="sequence",
        ratio_form="geometric", cliprange_low=eps_l, cliprange_high=eps_h), has_aux=True)(logp)
    m = np.asarray(mask, np.float64)
    lengths = m.sum(axis=1)
    s = np.exp(((np.asarray(logp, np.float64) - np.asarray(old)) * m).sum(axis=1) / lengths)
    objective = np.minimum(s * seq_adv, np.clip(s, 1 - eps_l, 1 + eps_h) * seq_adv)
    np.testing.assert_allclose(float(loss), -objective.mean(), rtol=1e-5)
    unclipped = s * seq_adv <= np.clip(s, 1 - eps_l, 1 + eps_h) * seq_adv
    want = -(unclipped * s * seq_adv / lengths)[:, None] * m / len(s)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-4, atol=1e-7)
    assert unclipped.any() and not unclipped.all()


def test_asymmetric_and_dual_clipping_on_hand_cases():
    # Token ratios r and advantages A; c_low 0.2, c_high 0.28 (DAPO), dual clip c = 3.
    r = np.array([[1.25, 0.75, 5.0, 2.0, 5.0, 1.1]])
    a = np.array([[1.0, -1.0, -1.0, -2.0, 1.0, -1.0]])
    mask = jnp.ones(r.shape, jnp.int32)
    logp = jnp.asarray(np.log(r), jnp.float32)

    def loss_of(**kw):
        return jax.value_and_grad(lambda lp: losses.ppo_policy_loss(
            lp, jnp.zeros_like(lp), jnp.asarray(a, jnp.float32), mask,
            aggregation="token_sum", **kw), has_aux=True)(logp)
    # token_sum over a row of 6 tokens: the loss is the terms' sum / 6.
    # Symmetric 0.2: 1.25 is clipped at 1.2 for A > 0; 0.75 at 0.8 for A < 0.
    (sym, _), _ = loss_of(cliprange=0.2)
    np.testing.assert_allclose(float(sym) * 6, -1.2 + 0.8 + 5.0 + 4.0 - 1.2 + 1.1, rtol=1e-5)
    # Clip-higher 0.28: 1.25 is inside [0.8, 1.28], its gradient -A r = -1.25 flows; 5.0 with
    # A > 0 is clipped at 1.28.
    (high, metrics), grad = loss_of(cliprange_low=0.2, cliprange_high=0.28)
    np.testing.assert_allclose(float(high) * 6, -1.25 + 0.8 + 5.0 + 4.0 - 1.28 + 1.1, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad) * 6, [[-1.25, 0, 5.0, 4.0, 0, 1.1]], rtol=1e-5)
    np.testing.assert_allclose(float(metrics["clipfrac_high"]), 1 / 6)  # r = 5, A > 0
    np.testing.assert_allclose(float(metrics["clipfrac_low"]), 1 / 6)  # r = 0.75, A < 0
    # Dual clip 3: A = -1, r = 5 is bounded by 3 |A| = 3 (no gradient); A = -2, r = 2 has
    # 4 < 6 and keeps its term; positive advantages are not touched.
    (dual, metrics), grad = loss_of(cliprange_low=0.2, cliprange_high=0.28, dual_clip=3.0)
    np.testing.assert_allclose(float(dual) * 6, -1.25 + 0.8 + 3.0 + 4.0 - 1.28 + 1.1, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad) * 6, [[-1.25, 0, 0, 4.0, 0, 1.1]], rtol=1e-5)
    np.testing.assert_allclose(float(metrics["dual_clipfrac"]), 1 / 6)


def test_dynamic_sampling_keeps_the_informative_groups_in_order():
    # Five groups of two: groups 1 and 3 differ, 0, 2 and 4 are all equal.
    scores = jnp.asarray([1.0, 1.0, 0.0, 2.0, 3.0, 3.0, 1.0, 0.5, 2.0, 2.0])
    rows, trained, informative = estimators.informative_groups(scores, 2, 3)
    # The two informative groups in order, then the first uninformative one, masked.
    assert np.asarray(rows).tolist() == [2, 3, 6, 7, 0, 1]
    assert np.asarray(trained).tolist() == [True, True, True, True, False, False]
    assert int(informative) == 2 and rows.shape == (6,) and trained.shape == (6,)
    # Enough informative groups: the first `keep` of them, none masked.
    scores = jnp.asarray([0.0, 1.0, 3.0, 3.0, 1.0, 0.5, 2.0, 2.5])
    rows, trained, informative = estimators.informative_groups(scores, 2, 2)
    assert np.asarray(rows).tolist() == [0, 1, 4, 5] and bool(np.all(trained))
    assert int(informative) == 3
    with pytest.raises(ValueError, match="keep=5 exceeds the 4 groups"):
        estimators.informative_groups(scores, 2, 5)


def _experience(scores, lengths, width, eos):
    """An Experience of rows with `lengths` tokens (last token `eos` where it is not None)."""
    batch = len(scores)
    mask = (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    ids = np.full((batch, width), 3, np.int32)
    for b, (n, e) in enumerate(zip(lengths, eos)):
        if e is not None and n:
            ids[b, n - 1] = e
    f = jnp.asarray(np.arange(batch * width, dtype=np.float32).reshape(batch, width))
    return ppo_types.Experience(
        jnp.zeros((batch, 2), jnp.int32), jnp.ones((batch, 2), jnp.int32), jnp.asarray(ids),
        jnp.asarray(mask), f, f, f, f, jnp.asarray(scores, jnp.float32), f,
        jnp.asarray([e is not None for e in eos]))


def test_dynamic_sampling_in_the_step_gathers_rows_and_masks_the_shortfall():
    """m = 2: four groups of two sampled, two trained; one informative group (rows 4, 5), so
    the second kept group (rows 0, 1) leaves the loss."""
    static = ppo_types.PPOStatic(batch_size=4, response_length=4, eos_id=1, pad_id=0,
                                 estimator="grpo", group_size=2, dynamic_sampling_oversample=2)
    assert static.prompts_per_step == 4 and static.groups_per_step == 2
    exp = _experience([0.5, 0.5, 2.0, 2.0, 0.1, 0.9, 3.0, 3.0], [2, 3, 4, 1, 2, 2, 3, 3], 4,
                      [1] * 8)
    kept, metrics = phases.rollout.keep_informative_groups(static, exp)
    np.testing.assert_array_equal(np.asarray(kept.scores), np.float32([0.1, 0.9, 0.5, 0.5]))
    np.testing.assert_array_equal(np.asarray(kept.old_logprobs),
                                  np.asarray(exp.old_logprobs)[[4, 5, 0, 1]])
    assert np.asarray(kept.loss_rows).tolist() == [True, True, False, False]
    assert float(metrics["dynamic/informative_share"]) == 0.25
    assert float(metrics["dynamic/groups_trained"]) == 1.0
    # The shortfall's rows leave the loss: the update's loss mask is zero on them.
    adv = phases.advantages.Advantages(jnp.ones((4, 4)), None, None, jnp.zeros((4, 4), jnp.int32),
                                       kept.loss_rows)
    data, _ = phases.update.update_batch(static, None, types.SimpleNamespace(actor_params=None),
                                         kept, adv)
    np.testing.assert_array_equal(np.asarray(data["loss_mask"]),
                                  np.asarray(kept.response_mask) * [[1], [1], [0], [0]])


def test_overlong_penalty_at_the_buffers_edges():
    lengths = jnp.asarray([10, 58, 59, 65, 71, 72])
    got = np.asarray(losses.overlong_penalty(lengths, budget=72, buffer=14, penalty=1.0))
    np.testing.assert_allclose(got, [0.0, 0.0, 1 / 14, 7 / 14, 13 / 14, 1.0], rtol=1e-6)
    got = np.asarray(losses.overlong_penalty(lengths, budget=72, buffer=1, penalty=0.5))
    np.testing.assert_allclose(got, [0.0, 0.0, 0.0, 0.0, 0.0, 0.5])
    # In the step the penalty is subtracted from the clipped score on the last token.
    static = ppo_types.PPOStatic(batch_size=2, response_length=6, eos_id=1, pad_id=0,
                                 reward_clip=2.5, overlong_buffer=3, overlong_penalty=1.0)
    terminal = phases.score.terminal_reward(static, jnp.asarray([3.0, 1.0]),
                                            jnp.asarray([True, False]), jnp.asarray([4, 6]))
    np.testing.assert_allclose(np.asarray(terminal), [2.5 - 1 / 3, 1.0 - 1.0], rtol=1e-6)


def test_truncated_responses_leave_the_loss():
    """Rows that hit the budget (4) without EOS: row 1 (4 tokens, no EOS). Row 0 ends with EOS
    at the budget, row 2 stops early without EOS (an empty row never is truncated)."""
    exp = _experience([0.0] * 3, [4, 4, 2], 4, [1, None, None])
    static = ppo_types.PPOStatic(batch_size=3, response_length=4, eos_id=1, pad_id=0,
                                 mask_truncated=True)
    rows, metrics = phases.advantages.rows_in_loss(static, exp)
    assert np.asarray(rows).tolist() == [True, False, True]
    np.testing.assert_allclose(float(metrics["overlong/truncated_frac"]), 1 / 3)
    rows, metrics = phases.advantages.rows_in_loss(
        static, exp.replace(loss_rows=jnp.asarray([False, True, True])))
    assert np.asarray(rows).tolist() == [False, False, True]
    assert phases.advantages.rows_in_loss(ppo_types.PPOStatic(
        batch_size=3, response_length=4, eos_id=1, pad_id=0), exp) == (None, {})


def _objective(**fields):
    cfg = tiny_config(**{f"ppo.{k}": v for k, v in fields.items()})
    validate_config(cfg)
    return cfg, estimators.objective(cfg.ppo)


def test_gspo_and_dapo_records_resolve_to_their_papers_settings():
    cfg, gspo = _objective(estimator="gspo", group_size=4)
    assert (gspo.ratio_level, gspo.ratio_form) == ("sequence", "geometric")
    assert (gspo.cliprange_low, gspo.cliprange_high) == (3e-4, 4e-4)
    assert gspo.dynamic_sampling_oversample == 1 and not gspo.overlong_shaping
    assert ppo_lib.loss_aggregation(cfg.ppo) == "sequence_mean"
    cfg, dapo = _objective(estimator="dapo", group_size=4, response_length=20)
    assert (dapo.ratio_level, dapo.ratio_form) == ("token", "product")
    assert (dapo.cliprange_low, dapo.cliprange_high) == (0.2, 0.28)
    assert dapo.dynamic_sampling_oversample == 3
    # DAPO's 4096-token buffer of a 20480-token budget, scaled: 1/5 of 20 tokens, penalty 1.
    assert (dapo.overlong_buffer, dapo.overlong_penalty) == (4, 1.0)
    assert ppo_lib.loss_aggregation(cfg.ppo) == "token_mean" and dapo.dual_clip is None
    static = ppo_lib.static_from_config(cfg, type("T", (), dict(eos_token_id=1,
                                                                pad_token_id=0))())
    assert static.prompts_per_step == 6 and static.overlong_buffer == 4
    # No KL term: none in the loss, and the advantages see the score alone (GRPO's).
    for name in ("gspo", "dapo"):
        assert not estimators.ESTIMATORS[name].kl_in_loss
        scores = jnp.asarray([0.3, 0.9, 0.1, 0.5])
        mask = jnp.ones((4, 3), jnp.int32)
        advantages = [estimators.ESTIMATORS[name].advantages(estimators.AdvantageInputs(
            scores=scores, kl=kl * jnp.ones((4, 3)), kl_coef=jnp.float32(0.05),
            rewards=jnp.zeros((4, 3)), response_mask=mask, group_size=4)) for kl in (0.0, 5.0)]
        np.testing.assert_array_equal(np.asarray(advantages[0]), np.asarray(advantages[1]))
        grpo = estimators.group_advantages(scores, 4, method="grpo")
        np.testing.assert_allclose(np.asarray(advantages[0])[:, 0], np.asarray(grpo))
    # A field set in the config wins over the record.
    _, dapo = _objective(estimator="dapo", group_size=4, cliprange_high=0.3,
                         dynamic_sampling_oversample=2, overlong_buffer=2)
    assert (dapo.cliprange_high, dapo.dynamic_sampling_oversample, dapo.overlong_buffer) == (
        0.3, 2, 2)
    # 1 switches DAPO's dynamic sampling off (its own ablation): the step samples the prompts
    # it trains on, no more.
    cfg, dapo = _objective(estimator="dapo", group_size=4, response_length=20,
                           dynamic_sampling_oversample=1)
    static = ppo_lib.static_from_config(cfg, type("T", (), dict(eos_token_id=1,
                                                                pad_token_id=0))())
    assert dapo.dynamic_sampling_oversample == 1 and static.prompts_per_step == 2
    # Without a record's settings every default run is unchanged: token, both ranges = cliprange.
    _, ppo = _objective(cliprange=0.15)
    assert (ppo.ratio_level, ppo.cliprange_low, ppo.cliprange_high, ppo.dual_clip) == (
        "token", 0.15, 0.15, None)
    assert ppo.dynamic_sampling_oversample == 1 and not ppo.overlong_shaping


@pytest.mark.parametrize("fields, message", [
    ({"cliprange_low": 0.3, "cliprange_high": 0.2},
     "config.ppo.cliprange_high=0.2: the upper clip range 0.2 is below the lower one 0.3"),
    ({"estimator": "dapo", "group_size": 2, "cliprange_low": 0.3},
     "config.ppo.cliprange_high=None: the upper clip range 0.28 is below the lower one 0.3"),
    ({"cliprange_low": 0.0}, "config.ppo.cliprange_low=0.0: must be > 0"),
    ({"cliprange_high": -0.1}, "config.ppo.cliprange_high=-0.1: must be > 0"),
    ({"dual_clip": 1.0}, "config.ppo.dual_clip=1.0: must be > 1"),
    ({"ratio_level": "macro", "ngram": 1},
     "config.ppo.ratio_level='macro': macro ratios need macro actions"),
    ({"ratio_level": "chunk"}, "config.ppo.ratio_level='chunk': must be one of"),
    ({"dynamic_sampling_oversample": 0, "estimator": "grpo", "group_size": 2},
     "config.ppo.dynamic_sampling_oversample=0: must be an integer >= 1, got 0"),
    ({"dynamic_sampling_oversample": True, "estimator": "dapo", "group_size": 2},
     "config.ppo.dynamic_sampling_oversample=True: must be an integer (or unset)"),
    # Equal scores in a group still carry signal where the KL is in the reward before the
    # baseline (rloo), under batch whitening (reinforce_pp) or with a critic (gae).
    ({"dynamic_sampling_oversample": 2, "estimator": "rloo", "group_size": 2},
     "config.ppo.dynamic_sampling_oversample=2: dynamic sampling (m=2) drops the groups whose "
     "scores are all equal, which carry no signal only under a group-normalised estimator "
     "(grpo, dr_grpo, gspo, dapo); under ppo.estimator='rloo' they still do"),
    ({"dynamic_sampling_oversample": 2, "estimator": "reinforce_pp", "group_size": 2},
     "config.ppo.dynamic_sampling_oversample=2: dynamic sampling (m=2) drops"),
    ({"dynamic_sampling_oversample": 2},
     "config.ppo.dynamic_sampling_oversample=2: dynamic sampling (m=2) drops"),
    ({"overlong_buffer": 12},
     "config.ppo.overlong_buffer=12: the overlong buffer (12 tokens) must be below the "
     "action budget 12 (ppo.response_length=12"),
])
def test_bad_objective_fields_fail_in_one_line(fields, message):
    cfg = tiny_config(**{f"ppo.{k}": v for k, v in fields.items()})
    with pytest.raises(ValueError) as error:
        validate_config(cfg)
    assert str(error.value).startswith(message), str(error.value)
    assert "\n" not in str(error.value)


def test_experiment_arms_carry_the_objective_and_token_arms_drop_a_macro_ratio():
    cfg = tiny_config(**{"stage": "experiment", "ppo.ratio_level": "macro"})
    cfg.experiment.arms = ("ppo", "ma_ppo_smdp", "ma_ppo_smdp_ctrl", "dapo")
    cfg.ppo.arm_overrides = {"dapo": {"group_size": 2}}
    runs = {r.arm: r for r in experiment.plan_runs(cfg)}
    assert runs["ma_ppo_smdp"].ppo["ratio_level"] == "macro"
    # Token PPO (fixed 1-grams) and the matched control have no macros: their unit is the token.
    assert runs["ppo"].ppo["ratio_level"] == "token"
    assert runs["ma_ppo_smdp_ctrl"].ppo["ratio_level"] == "token"
    assert runs["ppo"].group != runs["ma_ppo_smdp"].group
    cfg.ppo.arm_overrides = {"ppo": {"ratio_level": "macro"}}
    with pytest.raises(ValueError, match="arm 'ppo': ratio_level='macro' needs macro actions"):
        experiment.plan_runs(cfg)
    # An arm's dynamic sampling: an integer >= 1, and above 1 for a group-normalised record.
    for overrides, message in [
            ({"dapo": {"group_size": 2, "dynamic_sampling_oversample": 1.5}},
             "arm 'dapo': must be an integer >= 1, got 1.5"),
            ({"dapo": {"group_size": 2}, "ppo": {"dynamic_sampling_oversample": 2}},
             "arm 'ppo': dynamic sampling (m=2) drops the groups whose scores are all equal")]:
        cfg.ppo.arm_overrides = overrides
        with pytest.raises(ValueError) as error:
            experiment.plan_runs(cfg)
        assert str(error.value).startswith(message), str(error.value)


@pytest.fixture(scope="module")
def tiny_pipe(tmp_path_factory):
    yield from trained_tiny_pipeline(tmp_path_factory.mktemp("objectives"))


def _step(tiny_pipe, **fields):
    pipe = tiny_pipe[0]
    cfg, static, mods, state, frozen = ppo_setup(tiny_pipe, **fields)
    ids = pipe.task.rl["ids"][:static.prompts_per_step]
    mask = pipe.task.rl["mask"][:static.prompts_per_step]
    hparams = ppo_lib.hparams_from_config(cfg.ppo)
    exp, _ = jax.jit(functools.partial(core.rollout_phase, static, mods))(state, frozen, ids, mask)
    new, metrics = jax.jit(functools.partial(core.ppo_step, static, mods))(
        state, frozen, hparams, ids, mask)
    return static, exp, new, state, metrics


def test_a_dapo_step_trains_on_informative_groups_and_logs_them(tiny_pipe):
    static, exp, new, state, metrics = _step(tiny_pipe, estimator="dapo", group_size=4,
                                             batch_size=8, num_minibatches=2)
    assert static.prompts_per_step == 6 and exp.response_mask.shape[0] == 8
    # The kept rows: the informative groups first; each of them has rewards that differ.
    lengths = np.asarray(exp.response_mask).sum(axis=1)
    rewards = np.asarray(phases.score.terminal_reward(static, exp.scores, exp.ended_with_eos,
                                                      lengths)).reshape(2, 4)
    kept = np.asarray(exp.loss_rows).reshape(2, 4)
    assert np.all(kept == kept[:, :1])
    informative = np.ptp(rewards, axis=1) > 0
    assert np.all(informative[kept[:, 0]]) and float(metrics["dynamic/groups_trained"]) == kept[
        :, 0].sum()
    assert 0 <= float(metrics["dynamic/informative_share"]) <= 1
    # The budget counts the 24 sampled responses, more than the 8 trained rows hold.
    assert float(metrics["budget/generated_tokens"]) > lengths.sum()
    for key in ("policy/clipfrac_low_avg", "policy/clipfrac_high_avg", "overlong/penalty_mean"):
        assert key in metrics, key
    assert "loss/kl_avg" not in metrics and "loss/value_avg" not in metrics
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree.leaves(new.actor_params), jax.tree.leaves(state.actor_params)))
    assert moved > 0 or not kept.any()


def test_a_macro_ratio_step_logs_its_units(tiny_pipe):
    static, exp, _, _, metrics = _step(tiny_pipe, ratio_level="macro", ngram=3, num_minibatches=2)
    assert static.ratio_level == "macro" and static.ratio_form == "product"
    lengths = np.asarray(exp.response_mask).sum(axis=1)
    # Fixed 3-grams with the last token its own macro: ceil((L - 1) / 3) + 1 macros.
    want = np.mean((-(-(lengths - 1) // 3) + 1)[lengths > 0])
    np.testing.assert_allclose(float(metrics["policy/ratio_units_avg"]), want, rtol=1e-6)
    assert "policy/clipfrac_high_avg" in metrics and np.isfinite(float(metrics["loss/policy_avg"]))


@pytest.mark.parametrize("form", ["product", "geometric"])
def test_a_sequence_ratio_of_96_nats_gives_a_finite_loss_and_gradient(form):
    """A response of 12 tokens whose new logprobs are 8 nats above the old ones: the product
    ratio's log is 96 (exp overflows float32 past 88.7). The unit's log-ratio is clamped to
    +-20 before exp: the loss is the clamped ratio's, every gradient finite (zero where the
    clamp or the clip holds the ratio)."""
    logp = jnp.full((2, 12), -1.0)
    old = logp - 8.0
    mask = jnp.ones((2, 12), jnp.int32)
    adv = jnp.asarray([[1.0] * 12, [-1.0] * 12])

    def loss(logp):
        return losses.ppo_policy_loss(logp, old, adv, mask, ratio_level="sequence",
                                      ratio_form=form, aggregation="sequence_mean")[0]

    value, grad = jax.value_and_grad(loss)(logp)
    s = {"product": 96.0, "geometric": 8.0}[form]
    # Row 0 (A = 1): the clipped term -1.2 is active; row 1 (A = -1): the ratio itself.
    want = (-1.2 + np.exp(min(s, losses.LOG_RATIO_BOUND))) / 2
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    np.testing.assert_allclose(float(value), want, rtol=1e-6)
    if form == "product":
        np.testing.assert_array_equal(np.asarray(grad), 0.0)


@pytest.mark.parametrize("ratio_level", ["macro", "sequence"])
def test_grpo_kl_term_under_accumulation_equals_the_full_batch(tiny_pipe, ratio_level):
    """GRPO's KL is a token mean inside a loss averaged over macros or responses
    (`token_mean`): with two micro-batches of very different token counts (rows of 10 and of
    2 tokens), each term accumulates with its own weights, so the accumulated loss and
    gradient are the whole minibatch's."""
    fields = dict(estimator="grpo", group_size=2, ratio_level=ratio_level, ngram=3,
                  loss_aggregation="token_mean")
    static, exp, _, state, _ = _step(tiny_pipe, **fields)
    pipe, _, rm, stats = tiny_pipe
    cfg = tiny_config(**{f"ppo.{k}": v for k, v in fields.items()})
    mods = ppo_lib.make_models(cfg, pipe.policy, pipe.critic, pipe.reward_model,
                               pipe.task.gold_fn)
    frozen = ppo_types.Frozen(state.actor_params, rm, jnp.float32(stats["mean"]),
                              jnp.float32(stats["std"]))
    # Micro-batch j holds rows j, j + 2, ...: even rows train 10 tokens, odd rows 2.
    rows, width = exp.response_mask.shape
    lengths = np.where(np.arange(rows) % 2 == 0, min(10, width), 2)
    loss_mask = jnp.asarray(np.arange(width)[None] < lengths[:, None], jnp.int32)
    rng = np.random.default_rng(0)
    segments = termination.fixed_ngram(loss_mask, 3)
    adv = phases.advantages.Advantages(jnp.asarray(rng.normal(size=(rows, width)), jnp.float32),
                                       None, None, segments)
    data, trunk = phases.update.update_batch(static, mods, state, exp.replace(
        response_mask=loss_mask,
        # The policy moved from its old logprobs and from the reference: a live KL gradient.
        old_logprobs=exp.old_logprobs + jnp.asarray(rng.normal(0, 0.1, (rows, width))),
        ref_logprobs=exp.ref_logprobs + jnp.asarray(rng.normal(0, 0.3, (rows, width)))), adv)

    def gradients(k):
        s = dataclasses.replace(static, grad_accum_steps=k)
        return jax.jit(lambda p, b: phases.update.actor_gradients(
            s, mods, frozen, jnp.float32(0.1), trunk, p, b))(state.actor_params, data)

    (full, full_m), full_g = gradients(1)
    (acc, acc_m), acc_g = gradients(2)
    assert float(full_m["kl_loss"]) > 1e-3
    np.testing.assert_allclose(float(acc), float(full), atol=1e-6)
    np.testing.assert_allclose(float(acc_m["kl_loss"]), float(full_m["kl_loss"]), atol=1e-6)
    for a, b in zip(jax.tree.leaves(acc_g), jax.tree.leaves(full_g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    # Weighing the KL term by the policy loss's units instead would not be exact here.
    no_terms = dataclasses.replace(static, grad_accum_steps=2)
    (wrong, _), _ = jax.jit(lambda p, b: optim.accumulate_gradients(
        functools.partial(phases.update.actor_loss, no_terms, mods, frozen, jnp.float32(0.1),
                          trunk), p, b, 2, phases.update.actor_weight(no_terms)))(
        state.actor_params, data)
    assert abs(float(wrong) - float(full)) > 1e-4
