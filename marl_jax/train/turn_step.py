"""A PPO step on multi-turn trajectories: the policy plays a task's environment turn by turn over
one KV cache (`rollout.turns.run_turns`, stepping the episodes through the task's
`TaskData.turn_callback`), then the trajectories go through the score, advantages and update
programs as a single-turn rollout does.

    rollout (host-driven: decode a turn on device, step the environments on the host, prefill
    the observations on top of the cache, decode on) -> score (device: the forward passes read
    the observations, the policy's terms the action tokens) -> advantages -> update

The rollout is host-driven, so the step always runs as its phases (timed with
`config.ppo.phase_timing`, as `train/phased_step.py` does), never as one fused program. The
environment's per-turn rewards land on each turn's last action token; there is no reward model.
Held-out evaluation plays the same environment (`TrajectoryEvaluation`): its gold is the
environment's exact return.
"""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.rollout import turns
from marl_jax.train import programs, sharding
from marl_jax.train.phased_step import PhaseClock
from marl_jax.train.phases import score
from marl_jax.train.ppo_types import PPOStatic, role_model, role_params, step_keys

# The trajectory arrays the score program reads.
TRAJECTORY_KEYS = ("tokens", "kinds", "turn_ids", "logprobs", "entropy", "turn_rewards",
                   "truncated", "failed")


def episode_seeds(seed: int, step: int, rows, *, held_out: bool = False) -> list[int]:
    """The environment's seed of each row's episode: a pure function of the run's seed, the step
    (training) or the held-out evaluation, and the row (a resumed run replays the same
    episodes)."""
    return [int(np.random.SeedSequence([int(seed), int(held_out), int(step), int(r)])
                .generate_state(1)[0]) for r in rows]


class TrajectoryPlayer:
    """Plays a multi-turn task's episodes (`task.turn_callback`) with a policy: `play(params,
    prompt_ids, prompt_mask, task_rows, seeds, key) -> rollout.turns.Trajectory` (numpy
    `[B, T]`), the prompts left-padded `[B, P]` and the environment's rows and seeds one per
    row. `episode_metrics` holds the environment's own counts of the last episodes played
    (`Environment.episode_metrics`)."""

    def __init__(self, config, task, static: PPOStatic, policy):
        if jax.process_count() > 1:
            raise ValueError("multi-turn rollouts step their environments on one host: run "
                             "them with one process")
        t = config.task
        self.turn_callback, self.end_of_turn = task.turn_callback, task.end_of_turn
        self.policy, self.static = policy, static
        self.max_turns, self.max_turn_tokens = int(t.max_turns), int(t.max_turn_tokens)
        self.episode_metrics = {}

    def play(self, params, prompt_ids, prompt_mask, task_rows, seeds, key,
             temperature=None) -> turns.Trajectory:
        s = self.static
        step_turns = self.turn_callback(task_rows, seeds)
        trajectory = turns.run_turns(
            self.policy, params, np.asarray(prompt_ids), np.asarray(prompt_mask),
            step_turns=step_turns, row_keys=jax.random.split(key, len(task_rows)),
            max_turns=self.max_turns, max_total_tokens=s.response_length,
            max_turn_tokens=self.max_turn_tokens, end_of_turn=self.end_of_turn,
            temperature=s.temperature if temperature is None else temperature,
            top_k=s.top_k, top_p=s.top_p, pad_id=s.pad_id, decode_slots=s.decode_slots or None)
        self.episode_metrics = getattr(step_turns, "episode_metrics", dict)()
        return trajectory


def trajectory_arrays(trajectory: turns.Trajectory) -> dict:
    """The arrays of a `Trajectory` the score program reads (`TRAJECTORY_KEYS`)."""
    return {k: np.asarray(getattr(trajectory, k)) for k in TRAJECTORY_KEYS}


class MultiTurnStep:
    """`(state, frozen, hparams, prompts, rows) -> (state, metrics)`: one PPO step on
    trajectories played against the task's environment (`prompts`: the step's prompt arrays
    `ids`, `mask`; `rows`: their indices into the task's RL rows)."""

    def __init__(self, config, task, static: PPOStatic, mods, state_sh, frozen_sh, mesh, *,
                 timed: bool):
        self.fns = {name: program.fn for name, program in programs.phase_programs(
            static, mods, state_sh, frozen_sh, mesh).items() if name in ("advantages",
                                                                        "update")}
        self.fns["score"] = programs.trajectory_score_program(static, mods, state_sh,
                                                              frozen_sh, mesh).fn
        self.player = TrajectoryPlayer(config, task, static, mods.policy)
        self.task_rows = task.info["rl_rows"]
        self.static, self.timed, self.seed, self.mesh = static, timed, int(config.seed), mesh

    def __call__(self, state, frozen, hparams, prompts, rows):
        clock = PhaseClock(self.timed)
        k = self.static.group_size
        rows = np.repeat(np.asarray(rows), k)
        ids = np.repeat(np.asarray(prompts["ids"]), k, axis=0)
        mask = np.repeat(np.asarray(prompts["mask"]), k, axis=0)
        step = int(state.step)
        params = role_params(self.static, "actor", frozen, state.actor_params)
        # Each sample of a prompt is its own episode of the same task row.
        trajectory = self.player.play(params, ids, mask, [self.task_rows[r] for r in rows],
                                      episode_seeds(self.seed, step, range(len(rows))),
                                      step_keys(state)[0])
        clock.done("rollout", None)
        batch = sharding.shard_batch(dict(trajectory_arrays(trajectory), ids=ids, mask=mask),
                                     self.mesh)
        traj = {key: batch[key] for key in TRAJECTORY_KEYS}
        exp, roll_metrics = clock.done("score", self.fns["score"](
            state, frozen, batch["ids"], batch["mask"], traj))
        adv, adv_metrics = clock.done("advantages", self.fns["advantages"](
            state, frozen, hparams, exp, None))
        state, metrics = clock.done("update", self.fns["update"](
            state, exp, adv, roll_metrics, adv_metrics, frozen))
        return state, dict(metrics, **clock.seconds, **self.player.episode_metrics)

    def close(self):
        pass


def _trajectory_kl(static: PPOStatic, mods, actor_params, frozen, prompt_ids, prompt_mask,
                   tokens, kinds):
    """`[B]` the summed k1 KL to the reference over each trajectory's action tokens, the
    observations read as context."""
    context = (kinds != turns.PAD).astype(jnp.int32)
    actions = (kinds == turns.ACTION).astype(jnp.int32)
    args = (prompt_ids, prompt_mask, tokens, context)
    logp, _ = score.token_logprobs(mods.policy, role_params(static, "actor", frozen,
                                                            actor_params), *args,
                                   static.temperature)
    ref, _ = score.token_logprobs(role_model(static, mods, "reference"),
                                  role_params(static, "reference", frozen), *args,
                                  static.temperature)
    return ((logp - ref) * actions).sum(axis=1)


class TrajectoryEvaluation:
    """Held-out evaluation by playing the environment: `(actor params, frozen) -> row` with
    `gold` (the mean return: the environment's rewards summed over a trajectory, exact; on an
    environment's task it is also the reward the run optimises, its `rm_score`), `solved` (the
    share of trajectories whose last turn's reward is positive), `kl` (summed over action
    tokens), `length` (action tokens) and `turns`. The same episodes at every evaluation; the
    key is the run's (`ppo.eval_key`)."""

    def __init__(self, config, task, static: PPOStatic, mods):
        self.player = TrajectoryPlayer(config, task, static, mods.policy)
        self.static, self.mods = static, mods
        self.rows = task.info["eval_rows"]
        self.ids, self.mask = np.asarray(task.eval["ids"]), np.asarray(task.eval["mask"])
        self.seeds = episode_seeds(int(config.seed), 0, range(len(self.rows)), held_out=True)
        self.key = jax.random.fold_in(jax.random.key(int(config.seed)), 7)
        self.kl = jax.jit(functools.partial(_trajectory_kl, static, mods))

    def results(self, actor_params, frozen, key=None) -> dict:
        """Per held-out prompt `[E]`: gold (= rm_score), solved, kl, length, turns, failed."""
        params = role_params(self.static, "actor", frozen, actor_params)
        trajectory = self.player.play(params, self.ids, self.mask, self.rows, self.seeds,
                                      self.key if key is None else key)
        kl = np.asarray(self.kl(actor_params, frozen, self.ids, self.mask,
                                trajectory.tokens, trajectory.kinds))
        return trajectory_results(trajectory, kl)

    def __call__(self, actor_params, frozen) -> dict:
        return {k: float(np.mean(v)) for k, v in self.results(actor_params, frozen).items()}


def play_runs(player: TrajectoryPlayer, static: PPOStatic, state, frozen, ids, mask,
              task_rows, run_seeds, step: int) -> dict:
    """Every run's trajectories of a vmapped group's step: run r's actor (`state.actor_params`
    with a leading run axis) plays prompts `ids, mask [runs, B, P]` (groups repeated) on its
    task rows `task_rows[r]` (B each), with its own step key and episode seeds (as
    `MultiTurnStep` would for that run alone). `TRAJECTORY_KEYS` arrays `[runs, B, T]`; the
    player's `episode_metrics` become `[runs]` arrays."""
    out, counts = [], []
    for r, seed in enumerate(run_seeds):
        run = jax.tree.map(lambda x: x[r], state.actor_params)
        key = step_keys(types.SimpleNamespace(key=state.key[r], step=state.step[r]))[0]
        trajectory = player.play(role_params(static, "actor", frozen, run), ids[r], mask[r],
                                 task_rows[r], episode_seeds(seed, step, range(len(ids[r]))),
                                 key)
        out.append(trajectory_arrays(trajectory))
        counts.append(player.episode_metrics)
    player.episode_metrics = {k: np.asarray([c[k] for c in counts]) for k in counts[0]}
    return {k: np.stack([o[k] for o in out]) for k in TRAJECTORY_KEYS}


def trajectory_results(trajectory: turns.Trajectory, kl) -> dict:
    """Per trajectory `[B]`: the return (`gold`, also `rm_score`), `solved`, `kl`, `length`
    (action tokens), `turns` and `failed` (see `TrajectoryEvaluation`)."""
    rewards = np.asarray(trajectory.turn_rewards, np.float64)
    actions = np.asarray(trajectory.kinds) == turns.ACTION
    positions = np.arange(actions.shape[1])
    last = np.where(actions, positions, -1).max(axis=1)
    final = np.where(last >= 0, rewards[np.arange(len(last)), np.maximum(last, 0)], 0.0)
    returns = rewards.sum(axis=1)
    return {"gold": returns, "rm_score": returns, "solved": (final > 0).astype(np.float64),
            "kl": np.asarray(kl, np.float64), "length": actions.sum(axis=1).astype(np.float64),
            "turns": np.asarray(trajectory.num_turns, np.float64),
            "failed": np.asarray(trajectory.failed, np.float64)}
