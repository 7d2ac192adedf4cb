"""The advantage-quality probe (`credit.probe`) on a multi-turn task: the policy plays the
environment, every estimator's advantages are computed on the trajectories as the run computes
them, and they are scored against ground truth from continuations that play the environment on
(`credit.turn_truth`).

`TurnCreditProbe` samples `group_size` trajectories of each of the first `credit.prompts`
held-out episodes (`turn_step.TrajectoryPlayer`, the held-out task rows, episode seeds of the
probe's seed and step: `probe.probe_seed`, which the run's seed enters) and scores them as the
run does (`ppo_core.score_trajectory_phase`: the critic's values and the per-token rewards, KL
terms and the environment's turn rewards, on the action tokens). On that batch, over the
action tokens (observation spans are holes):

- `token_gae`: GAE with one action token per step (across observations);
- per rule of `credit.rules` (on-device rules within turns, and `turn`: one macro per turn) and
  value weighting: `macro_gae/<rule>/<weighting>`, and `control/<rule>` (token GAE with
  lam^(1/L), L the rule's mean macro length in action tokens);
- `grpo`, `rloo` (a trajectory's score: its turn rewards) and `turn_rloo`, `turn_grpo` (per-turn
  credit over the groups).

The Monte Carlo macro-value estimator (`macro_mc`) continues single responses only and is not
scored here. The truth values every state of every trajectory (`credit.turn_truth`), with the
run's own per-token rewards of the continued trajectories. The probe's npz holds the action
tokens left-aligned (`turn_truth.compress`: responses, rewards, values, advantages and segment
ids at action columns, states at action ranks), which `probe_scores.score_probe` reads as it
reads single responses, and the trajectories themselves (`trajectory/<array>`, and
`action_columns`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax import estimators
from marl_jax.credit import probe as credit
from marl_jax.credit import turn_truth as truth_turns
from marl_jax.macro import termination
from marl_jax.macro.advantage import action_ranks
from marl_jax.train import ppo_core
from marl_jax.train.phases import advantages as adv_phase
from marl_jax.train.ppo_types import Experience, PPOState, PPOStatic, role_params
from marl_jax.train.turn_step import TrajectoryPlayer, episode_seeds, trajectory_arrays

TURN_ESTIMATORS = ("turn_rloo", "turn_grpo")


def turn_estimator_advantages(static: PPOStatic, exp: Experience, segments: dict, kl_coef, *,
                              gamma: float, lam: float, weightings, aggregation: str,
                              group_size: int) -> dict:
    """name -> advantages `[B, T]` (numpy, 0 off the action tokens) of every estimator the probe
    scores on trajectories (see the module)."""
    mask = exp.actions
    tokens = action_ranks(mask)
    gae = functools.partial(credit.gae_advantages, exp, gamma=gamma)
    out = {"token_gae": gae(tokens, lam=lam)}
    for rule, seg in segments.items():
        for weighting in weightings:
            out[f"macro_gae/{rule}/{weighting}"] = gae(seg, lam=lam, weighting=weighting,
                                                       aggregation=aggregation)
        length = float(termination.mean_macro_length(seg, mask))
        out[f"control/{rule}"] = gae(tokens, lam=lam ** (1.0 / length))
    inputs = adv_phase.advantage_inputs(static, exp, kl_coef, group_size)
    for name in credit.GROUP_ESTIMATORS + TURN_ESTIMATORS:
        out[name] = estimators.ESTIMATORS[name].advantages(inputs)
    return {name: np.asarray(a, np.float64) * np.asarray(mask) for name, a in out.items()}


class TurnCreditProbe(credit.CreditProbe):
    """`credit.CreditProbe` on a multi-turn task (see the module)."""

    def __init__(self, config, task, static: PPOStatic, models, workdir: str):
        super().__init__(config, task, static, models, workdir)
        n = int(self.c.prompts)
        self.player = TrajectoryPlayer(config, task, static, models.policy)
        self.task_rows = list(task.info["eval_rows"][:n])
        self.turn_callback = task.turn_callback
        self.play_settings = {
            "max_turns": int(config.task.max_turns), "max_turn_tokens": int(config.task.max_turn_tokens),
            "end_of_turn": task.end_of_turn, "temperature": static.temperature, "top_k": static.top_k,
            "top_p": static.top_p, "pad_id": static.pad_id}
        self._score = jax.jit(functools.partial(ppo_core.score_trajectory_phase, static, models))

    def _rewards(self, state: PPOState, frozen, prompt_ids, prompt_mask, trajectory: dict):
        """The run's per-token rewards `[N, T]` of trajectories (the truth's `reward_fn`)."""
        return self._score(state, frozen, prompt_ids, prompt_mask, trajectory)[0].rewards

    def probe_inputs(self, state: PPOState, frozen, hparams, step: int) -> dict:
        """The arrays one probe scores (numpy), action tokens left-aligned (see the module)."""
        c, static = self.c, self.static
        k = int(c.group_size)
        keys = credit.probe_keys(self.seed, step)
        ids = jnp.repeat(self.prompt_ids, k, axis=0)
        mask = jnp.repeat(self.prompt_mask, k, axis=0)
        rows = [r for r in self.task_rows for _ in range(k)]
        seeds = episode_seeds(self.seed, step, range(len(rows)), held_out=True)
        actor = role_params(static, "actor", frozen, state.actor_params)
        played = trajectory_arrays(self.player.play(actor, ids, mask, rows, seeds,
                                                    keys.responses))
        exp, _ = self._score(state, frozen, ids, mask, played)
        segments = credit.rule_segments(static, exp, tuple(c.rules), keys.segments, self.ngram,
                                        turn_ids=exp.turn_ids)
        gamma, lam = float(hparams.gamma), float(hparams.lam)
        advantages = turn_estimator_advantages(
            static, exp, segments, state.kl_coef, gamma=gamma, lam=lam,
            weightings=tuple(c.weightings), aggregation=self.aggregation, group_size=k)
        columns, lengths = truth_turns.action_columns(played["kinds"])
        state_rows = np.repeat(np.arange(lengths.size), lengths + 1)
        state_positions = np.concatenate([np.arange(n + 1) for n in lengths])
        values = truth_turns.state_values(
            self.models.policy, actor, ids, mask, played, state_rows, state_positions,
            reward_fn=functools.partial(self._rewards, state, frozen), key=keys.truth,
            num_continuations=int(c.continuations), gamma=gamma,
            chunk_states=int(c.chunk_states), make_step_turns=self.turn_callback,
            task_rows=rows, seeds=seeds, progress=credit.truth_progress(step, int(c.continuations)),
            **self.play_settings)
        squeeze = functools.partial(truth_turns.compress, columns=columns, lengths=lengths)
        actions = (np.arange(columns.shape[1])[None, :] < lengths[:, None]).astype(np.int32)
        return {
            "step": np.int64(step), "probe_seed": np.int64(self.seed),
            "truth": np.str_("reward"), "group_size": np.int64(k),
            "gamma": np.float64(gamma),
            "prompt_ids": np.asarray(ids), "prompt_mask": np.asarray(mask),
            "response_ids": squeeze(played["tokens"]), "response_mask": actions,
            "rewards": squeeze(np.asarray(exp.rewards, np.float64)),
            "values": squeeze(np.asarray(exp.values, np.float64)), "lam": np.float64(lam),
            "state_rows": values.rows, "state_positions": values.positions,
            "state_mean": values.mean, "state_se": values.se, "state_halves": values.halves,
            "state_returns": values.returns,
            **{f"segments/{rule}": squeeze(np.asarray(seg)) for rule, seg in segments.items()},
            **{f"advantages/{name}": squeeze(a) for name, a in advantages.items()},
            "action_columns": columns,
            **{f"trajectory/{name}": np.asarray(a) for name, a in played.items()},
        }

