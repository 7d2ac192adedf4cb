"""Multi-turn trajectories through the PPO step: the forward passes read the observation
spans, nothing else does.

A trajectory is the sampled responses of the tiny pipeline with observation spans (tokens the
policy did not choose) inserted between their action tokens, each span ending a turn. The
score phase must give observation tokens no logprob target, no KL, no value and no reward; the
advantages at the action tokens must be those of the same action tokens with the spans taken
out (for the critic and for the critic-free estimators); the update must not read anything at an
observation token; and a one-turn trajectory must be today's step to the bit.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax import losses
from marl_jax.config_check import validate_config
from marl_jax.rollout import turns
from marl_jax.train import ppo as ppo_lib, ppo_core as core, phases

from train_util import ppo_setup, tiny_config, trained_tiny_pipeline

SPANS = 2  # observation spans per row: three turns


@pytest.fixture(scope="module")
def tiny_pipe(tmp_path_factory):
    yield from trained_tiny_pipeline(tmp_path_factory.mktemp("trajectories"))


def _setup(tiny_pipe, **fields):
    pipe = tiny_pipe[0]
    cfg, static, mods, state, frozen = ppo_setup(tiny_pipe, **fields)
    hparams = ppo_lib.hparams_from_config(cfg.ppo)
    ids = pipe.task.rl["ids"][:static.prompts_per_step]
    mask = pipe.task.rl["mask"][:static.prompts_per_step]
    sampled, _ = jax.jit(functools.partial(core.rollout_phase, static, mods))(
        state, frozen, ids, mask)
    return static, mods, state, frozen, hparams, sampled


def _with_spans(exp, vocab_size, seed=0):
    """The responses of `exp` with `SPANS` observation spans of 1-4 random tokens inserted at
    random cuts between their action tokens: (ids, context mask, action mask, turn ids, where
    each action token went `[B, R]`), every array `[B, R + 4 * SPANS]`."""
    rng = np.random.default_rng(seed)
    ids, mask = np.asarray(exp.response_ids), np.asarray(exp.response_mask)
    rows, width = ids.shape
    wide = width + 4 * SPANS
    out = {k: np.zeros((rows, wide), np.int32) for k in ("ids", "context", "actions", "turns")}
    where = np.zeros((rows, width), np.int64)
    for b in range(rows):
        length = int(mask[b].sum())
        cuts = sorted(rng.choice(np.arange(1, length), SPANS, replace=False)) if length > SPANS else []
        t = turn = 0
        for i in range(length):
            if turn < len(cuts) and i == cuts[turn]:
                span = int(rng.integers(1, 5))
                out["ids"][b, t:t + span] = rng.integers(0, vocab_size, span)
                out["context"][b, t:t + span] = 1
                out["turns"][b, t:t + span] = turn
                t, turn = t + span, turn + 1
            out["ids"][b, t], out["context"][b, t], out["actions"][b, t] = ids[b, i], 1, 1
            out["turns"][b, t] = turn
            where[b, i] = t
            t += 1
        out["turns"][b, t:] = turn
    return (*(jnp.asarray(out[k]) for k in ("ids", "context", "actions", "turns")), where)


def _gather(x, where):
    """`x [B, R']` at each action token's place `where [B, R]`."""
    return np.take_along_axis(np.asarray(x), where, axis=1)


def _score(static, mods, state, frozen, exp, **trajectory):
    fn = jax.jit(lambda *a, **k: phases.score.score(static, mods, *a, **k))
    return fn(state, frozen, exp.prompt_ids, exp.prompt_mask,
              trajectory.pop("response_ids", exp.response_ids),
              trajectory.pop("response_mask", exp.response_mask), **trajectory)


def _advantages_and_update(static, mods, state, frozen, hparams, exp, roll_metrics):
    roll_metrics = _with_budget(roll_metrics)
    adv, adv_metrics = jax.jit(functools.partial(core.advantages_phase, static, mods))(
        state, frozen, hparams, exp)
    new, metrics = jax.jit(functools.partial(core.update_from_advantages, static, mods))(
        state, exp, adv, roll_metrics, adv_metrics, frozen)
    return adv, new, metrics


def _with_budget(metrics):
    """The score phase's metrics with the rollout budget `ppo_core.score_phase` adds."""
    return dict(metrics, **{f"budget/{k}_tokens": jnp.float32(0) for k in ("generated",
                                                                             "prefill")})


def _leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in zip(la, lb))


def test_one_turn_is_todays_step_to_the_bit(tiny_pipe):
    """A one-turn trajectory (the action mask is the response mask, every turn id 0, no turn
    reward) scores, segments (fixed 3-grams within the one turn), estimates and updates exactly
    as the single response does."""
    static, mods, state, frozen, hparams, sampled = _setup(tiny_pipe, ngram=3, num_minibatches=2)
    one, one_m = _score(static, mods, state, frozen, sampled)
    turned, turned_m = _score(static, mods, state, frozen, sampled,
                              action_mask=sampled.response_mask,
                              turn_ids=jnp.zeros_like(sampled.response_mask),
                              turn_rewards=jnp.zeros(sampled.response_mask.shape, jnp.float32))
    assert turned_m.pop("objective/turn_rewards") == 0
    plain = dict(action_mask=None, turn_ids=None, turn_rewards=None)
    assert _leaves_equal(one.replace(**plain), turned.replace(**plain)) and _leaves_equal(
        one_m, turned_m)
    results = [_advantages_and_update(static, mods, state, frozen, hparams, e, one_m)
               for e in (one, turned)]
    assert _leaves_equal(results[0], results[1])


@pytest.mark.parametrize("fields", [
    dict(ngram=3),  # macro GAE with the critic, fixed 3-grams within turns
    dict(termination="fixed", ngram=1, estimator="reinforce_pp"),
    dict(estimator="grpo", group_size=2),
    dict(estimator="turn_rloo", group_size=2),
], ids=["macro_gae", "reinforce_pp", "grpo", "turn_rloo"])
def test_observation_spans_take_no_target_kl_reward_or_step(tiny_pipe, fields):
    static, mods, state, frozen, hparams, sampled = _setup(tiny_pipe, **fields)
    ids, context, actions, turns, where = _with_spans(sampled, mods.policy.config.vocab_size)
    rows, width = ids.shape
    rng = np.random.default_rng(1)
    # Every turn's reward on its last action token, as an environment gives it.
    last_of_turn = np.zeros((rows, width), bool)
    for b in range(rows):
        positions = np.flatnonzero(np.asarray(actions[b]))
        for t in np.unique(np.asarray(turns[b])[positions]):
            last_of_turn[b, positions[np.asarray(turns[b])[positions] == t][-1]] = True
    turn_rewards = jnp.asarray(np.where(last_of_turn, rng.normal(size=(rows, width)), 0.0),
                               jnp.float32)
    exp, metrics = _score(static, mods, state, frozen, sampled, response_ids=ids,
                          response_mask=context, action_mask=actions, turn_ids=turns,
                          turn_rewards=turn_rewards)
    obs = np.asarray(context - actions) != 0
    for name in ("old_logprobs", "ref_logprobs", "ref_base_logprobs", "values", "rewards",
                 "entropies"):
        assert np.all(np.asarray(getattr(exp, name))[obs] == 0), name
    # The actor at this step sampled every action token; observations and padding carry no
    # version.
    np.testing.assert_array_equal(np.asarray(exp.versions),
                                  np.where(np.asarray(actions) != 0, int(state.step), -1))
    # The forward passes read the observations: the action tokens' logprobs are those of the
    # whole trajectory scored as one response.
    whole, _ = _score(static, mods, state, frozen, sampled, response_ids=ids,
                      response_mask=context)
    np.testing.assert_allclose(np.asarray(exp.old_logprobs)[~obs],
                               np.asarray(whole.old_logprobs)[~obs], rtol=1e-6, atol=1e-6)
    # Rewards by hand: -beta x k1 on every action token, the turn rewards, and the clipped score
    # on the trajectory's last action token.
    kl = np.asarray(exp.old_logprobs) - np.asarray(exp.ref_logprobs)
    terminal = np.asarray(phases.score.terminal_reward(
        static, exp.scores, exp.ended_with_eos, actions.sum(axis=1)))
    last = np.asarray(actions).shape[1] - 1 - np.argmax(np.asarray(actions)[:, ::-1], axis=1)
    want = (-float(state.kl_coef) * kl + np.asarray(turn_rewards)) * np.asarray(actions)
    want[np.arange(rows), last] += terminal
    np.testing.assert_allclose(np.asarray(exp.rewards), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(metrics["objective/turn_rewards"]),
                               np.asarray(turn_rewards).sum(axis=1).mean(), rtol=1e-6)

    # Advantages: those of the same action tokens with the spans taken out (same values,
    # rewards and turns), 0 on the observations.
    compact = exp.replace(**{
        name: jnp.asarray(_gather(getattr(exp, name), where))
        for name in ("response_ids", "old_logprobs", "ref_logprobs", "ref_base_logprobs",
                     "values", "rewards", "entropies")},
        # Padding continues the row's last turn.
        turn_ids=jnp.asarray(np.maximum.accumulate(_gather(exp.turn_ids, where), axis=1)),
        response_mask=sampled.response_mask, action_mask=sampled.response_mask)
    adv, new, upd = _advantages_and_update(static, mods, state, frozen, hparams, exp, metrics)
    adv_c, _ = jax.jit(functools.partial(core.advantages_phase, static, mods))(
        state, frozen, hparams, compact)
    valid = np.asarray(sampled.response_mask) != 0
    for name in ("advantages", "returns"):
        if getattr(adv, name) is None:
            continue
        got, want = np.asarray(getattr(adv, name)), np.asarray(getattr(adv_c, name))
        assert np.all(got[obs] == 0), name
        np.testing.assert_allclose(_gather(got, where)[valid], want[valid], rtol=1e-6,
                                   atol=1e-6, err_msg=name)
    assert np.any(np.asarray(adv.advantages)[~obs] != 0)
    if fields.get("estimator") == "grpo":
        # GRPO's one score per trajectory is all it earned: the clipped score and its turns'
        # rewards, normalised in its group of 2 by hand.
        total = (terminal + np.asarray(turn_rewards, np.float64).sum(axis=1)).reshape(-1, 2)
        want = (total - total.mean(axis=1, keepdims=True)) / (
            total.std(axis=1, ddof=1, keepdims=True) + 1e-4)
        first = np.argmax(np.asarray(actions), axis=1)
        np.testing.assert_allclose(np.asarray(adv.advantages)[np.arange(rows), first],
                                   want.reshape(-1), rtol=1e-4, atol=1e-5)

    # The update reads nothing at an observation token: garbage there changes no bit.
    noise = lambda x: jnp.where(jnp.asarray(obs), 7.0 + 3 * x, x)  # noqa: E731
    garbled = exp.replace(old_logprobs=noise(exp.old_logprobs), ref_logprobs=noise(
        exp.ref_logprobs), values=noise(exp.values))
    adv_g = adv.replace(advantages=noise(adv.advantages),
                        returns=None if adv.returns is None else noise(adv.returns))
    new_g, upd_g = jax.jit(functools.partial(core.update_from_advantages, static, mods))(
        state, garbled, adv_g, _with_budget(metrics), {}, frozen)
    assert _leaves_equal(new.actor_params, new_g.actor_params)
    assert _leaves_equal(new.critic_params, new_g.critic_params)
    assert np.isfinite(float(upd["loss/policy_avg"]))
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(
        jax.tree.leaves(new.actor_params), jax.tree.leaves(state.actor_params)))
    assert moved > 0


def _played(tiny_pipe, failed_rows=(), reward_of_failed=0.0):
    """The tiny pipeline's sampled responses as trajectories the environment played
    (`rollout.turns` arrays, `SPANS` observation spans per row, every turn's reward on its
    last action token, the environment failing on `failed_rows`, which then hold
    `reward_of_failed` on their last action token), scored by the multi-turn score phase:
    (static, mods, state, frozen, hparams, trajectory arrays, experience, metrics)."""
    static, mods, state, frozen, hparams, sampled = _setup(tiny_pipe)
    # An environment's rewards are the turns': no sequence score on top.
    static = dataclasses.replace(static, reward_source="env")
    ids, context, actions, turns_, _ = _with_spans(sampled, mods.policy.config.vocab_size)
    kinds = np.where(np.asarray(actions) != 0, turns.ACTION,
                     np.where(np.asarray(context) != 0, turns.OBSERVATION, turns.PAD))
    rows, width = ids.shape
    rewards = np.zeros((rows, width), np.float32)
    for b in range(rows):
        positions = np.flatnonzero(kinds[b] == turns.ACTION)
        for t in np.unique(np.asarray(turns_[b])[positions]):
            rewards[b, positions[np.asarray(turns_[b])[positions] == t][-1]] = 0.5 + 0.25 * t
        if b in failed_rows:
            rewards[b] = 0.0
            rewards[b, positions[-1]] = reward_of_failed
    failed = np.isin(np.arange(rows), failed_rows)
    trajectory = dict(tokens=ids, kinds=jnp.asarray(kinds, jnp.int8), turn_ids=turns_,
                      logprobs=jnp.zeros((rows, width)), entropy=jnp.zeros((rows, width)),
                      turn_rewards=jnp.asarray(rewards), truncated=jnp.zeros(rows, bool),
                      failed=jnp.asarray(failed))
    exp, metrics = jax.jit(functools.partial(core.score_trajectory_phase, static, mods))(
        state, frozen, sampled.prompt_ids, sampled.prompt_mask, trajectory)
    return static, mods, state, frozen, hparams, trajectory, exp, metrics


FAILED_ROWS = (1, 4)  # one in each group of 4 rows


@pytest.fixture(scope="module")
def failed_runs(tiny_pipe):
    """`_played` twice, the environment failing on `FAILED_ROWS`, which hold reward 0, then 5."""
    return [_played(tiny_pipe, failed_rows=FAILED_ROWS, reward_of_failed=r) for r in (0.0, 5.0)]


def test_a_row_whose_environment_failed_leaves_the_loss(failed_runs):
    """A failure of the environment (it raised or returned something malformed) is no evidence
    about the policy: the row trains nothing, whatever reward it holds, and is counted."""
    runs = failed_runs
    new = []
    for static, mods, state, frozen, hparams, trajectory, exp, metrics in runs:
        np.testing.assert_allclose(float(metrics["multiturn/failed_frac"]), 2 / static.batch_size)
        adv, state, _ = _advantages_and_update(static, mods, state, frozen, hparams, exp,
                                               metrics)
        assert np.asarray(adv.loss_rows).tolist() == [b not in FAILED_ROWS for b in range(
            static.batch_size)]
        new.append(state)
    assert _leaves_equal(new[0].actor_params, new[1].actor_params)
    assert _leaves_equal(new[0].critic_params, new[1].critic_params)
    assert not _leaves_equal(new[0].actor_params, runs[0][2].actor_params)


def test_a_row_whose_environment_failed_enters_no_baseline(failed_runs):
    """Nor does it move the other rows' advantages: the group estimators' statistics (a
    group's mean, standard deviation and leave-one-out count), REINFORCE++'s batch
    normalisation and whitened GAE's leave it out, so the other rows' advantages are the same
    bits whatever reward it holds (the estimators' values: tests/test_estimator_rows.py)."""
    static, mods = failed_runs[0][:2]
    valid = ~np.isin(np.arange(static.batch_size), FAILED_ROWS)
    estimators = [dict(estimator=name, group_size=4)
                  for name in ("grpo", "dr_grpo", "rloo", "turn_rloo", "turn_grpo")]
    for fields in estimators + [dict(estimator="reinforce_pp"), dict(whiten_advantages=True)]:
        advantages = jax.jit(functools.partial(core.advantages_phase,
                                               dataclasses.replace(static, **fields), mods))
        got = [np.asarray(advantages(state, frozen, hparams, exp)[0].advantages)[valid]
               for _, _, state, frozen, hparams, _, exp, _ in failed_runs]
        assert np.any(got[0] != 0), fields
        assert np.array_equal(got[0], got[1]), fields


def test_a_trajectorys_score_is_what_its_environment_paid(tiny_pipe):
    """`objective/scores` (the progress line's number) is a trajectory's return, its turns'
    rewards summed, and `objective/rlhf_reward` that return less beta x its summed KL."""
    static, _, state, _, _, trajectory, exp, metrics = _played(tiny_pipe)
    actions = np.asarray(trajectory["kinds"]) == turns.ACTION
    returns = np.asarray(trajectory["turn_rewards"], np.float64).sum(axis=1)
    kl = ((np.asarray(exp.old_logprobs, np.float64) - np.asarray(exp.ref_logprobs)) * actions
          ).sum(axis=1)
    assert returns.min() > 0
    np.testing.assert_allclose(float(metrics["objective/scores"]), returns.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["objective/rlhf_reward"]),
                               (returns - float(state.kl_coef) * kl).mean(), rtol=1e-5)


def test_the_overlong_penalty_counts_action_tokens_against_the_action_budget(tiny_pipe):
    """DAPO's soft overlong punishment on trajectories counts a trajectory's action tokens
    against the most it can hold: on the calculator 4 turns of 10 (its budget of 72 tokens
    also holds the observations, and 40 action tokens never reach a buffer at 72); on
    hand-made trajectories of the tiny pipeline's responses (12 action tokens at most, between
    observation spans), by hand."""
    from test_multiturn_task import tiny_calculator_config

    calculator = tiny_calculator_config()
    calculator.ppo.update(dict(overlong_buffer=8, overlong_penalty=1.0))
    validate_config(calculator)
    tokens = type("T", (), dict(eos_token_id=1, pad_token_id=0))
    static = ppo_lib.static_from_config(calculator, tokens)
    assert (static.action_budget, static.response_length, static.overlong_buffer) == (40, 72, 8)
    calculator.ppo.overlong_buffer = 40
    with pytest.raises(ValueError, match=r"must be below the action budget 40 \("):
        validate_config(calculator)

    static, mods, state, frozen, _, sampled = _setup(tiny_pipe)
    ids, context, actions, turns_, _ = _with_spans(sampled, mods.policy.config.vocab_size)
    budget = static.response_length
    static = dataclasses.replace(static, response_length=ids.shape[1], action_budget=budget,
                                 overlong_buffer=4, overlong_penalty=1.0)
    exp, metrics = _score(static, mods, state, frozen, sampled, response_ids=ids,
                          response_mask=context, action_mask=actions, turn_ids=turns_,
                          turn_rewards=jnp.zeros(ids.shape, jnp.float32))
    lengths = np.asarray(actions).sum(axis=1)
    want = np.clip((lengths - (budget - 4)) / 4, 0.0, 1.0)
    assert 0 < want.max() and want.min() < 1
    np.testing.assert_allclose(float(metrics["overlong/penalty_mean"]), want.mean(), rtol=1e-6)
    # The penalty is taken from the score on each trajectory's last action token.
    kl = np.asarray(exp.old_logprobs) - np.asarray(exp.ref_logprobs)
    last = ids.shape[1] - 1 - np.argmax(np.asarray(actions)[:, ::-1], axis=1)
    score = np.clip(np.asarray(exp.scores), -static.reward_clip, static.reward_clip) - want \
        - np.where(np.asarray(exp.ended_with_eos), 0.0, static.missing_eos_penalty)
    rows = np.arange(len(last))
    np.testing.assert_allclose(np.asarray(exp.rewards)[rows, last],
                               score - float(state.kl_coef) * kl[rows, last], rtol=1e-5,
                               atol=1e-6)


def test_a_turn_termination_is_refused_on_a_single_turn_task():
    cfg = tiny_config(**{"ppo.termination": "turn"})
    with pytest.raises(ValueError) as error:
        validate_config(cfg)
    message = str(error.value)
    assert "ppo.termination" in message and "single responses" in message
    assert "\n" not in message


def test_assemble_rewards_puts_the_score_on_the_last_action_token():
    """By hand: a trajectory of two turns (actions at 0-1 and 4-5, an observation at 2-3)."""
    mask = jnp.asarray([[1, 1, 0, 0, 1, 1, 0]])
    logp = jnp.asarray([[-1.0, -2.0, 5.0, 5.0, -1.0, -1.5, 0.0]])
    ref = jnp.asarray([[-1.5, -2.0, 9.0, 9.0, -0.5, -1.0, 0.0]])
    rewards, m = losses.assemble_rewards(logp, ref, jnp.asarray([1.0]), mask, kl_coef=0.1)
    want = [[-0.05, 0.0, 0.0, 0.0, 0.05, 0.05 + 1.0, 0.0]]
    np.testing.assert_allclose(np.asarray(rewards), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(float(m["kl"]), 0.5 - 0.5 - 0.5, atol=1e-6)
