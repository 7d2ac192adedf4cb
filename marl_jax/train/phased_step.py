"""A PPO step run as its four phases' programs (`programs.phase_programs`), with the host work
some runs need between them, and the seconds of each phase.

    rollout (device) -> [fetch the tokens -> parse on host threads | host rewards] ->
    score (device, overlapped with the parsing) -> advantages (device, with the parsed segment
    ids) -> update (device)

Timed (`config.ppo.phase_timing`), each phase is waited on (`jax.block_until_ready`) before the
next is dispatched, and the step's metrics carry `timing/<phase>_s` for the phases rollout,
score, advantages and update (`marl_jax.train.phases`); host work counts in the phase that
waits for it: the host rewards in score, what remains of the parsing in advantages. Untimed,
the phases are dispatched back to back, as the host work allows. The phases compose to
`ppo_core.ppo_step`: the same metrics as the fused step to float32 rounding (a test holds it).
"""
from __future__ import annotations

import time

import jax
import numpy as np

from marl_jax import distributed
from marl_jax.train import programs, sharding


class PhasedStep:
    """`(state, frozen, hparams, prompts, rows) -> (state, metrics)`: one PPO step through the
    phase programs (`prompts`: the step's global prompt arrays `ids`, `mask` and, for the
    synthetic task, `documents`; `rows`: this process's rows of the task's prompts, for host
    rewards)."""

    def __init__(self, config, task, static, mods, state_sh, frozen_sh, mesh, *, timed: bool):
        p = config.ppo
        self.fns = {name: program.fn for name, program in programs.phase_programs(
            static, mods, state_sh, frozen_sh, mesh).items()}
        self.task, self.static, self.timed = task, static, timed
        self.host_rewards = p.reward_source == "host"
        self.parser = None
        if p.termination == "parsing":
            from marl_jax.macro.parsing import ParsingTermination
            self.parser = ParsingTermination(
                task.tokenizer, model=p.parsing_model, cutoff=p.parsing_cutoff,
                fallback_n=p.ngram, isolate_last=p.isolate_last)

    def __call__(self, state, frozen, hparams, prompts, rows):
        clock = PhaseClock(self.timed)
        mesh = prompts["ids"].sharding.mesh
        sample = clock.done("rollout", self.fns["rollout"](state, frozen, prompts["ids"],
                                                           prompts["mask"]))
        parsed = host_scores = None
        if self.parser is not None or self.host_rewards:
            # This process's rows of the responses, in the order of `rows`.
            host_ids, host_mask = distributed.global_to_host_local(
                (sample.tokens, sample.mask.astype(np.int32)))
            if self.parser is not None:
                parsed = self.parser.submit(host_ids, host_mask)
            if self.host_rewards:
                rows = np.repeat(rows, self.static.group_size)
                host_scores = sharding.shard_batch(np.asarray(
                    self.task.host_reward(rows, host_ids, host_mask), np.float32), mesh)
        exp, roll_metrics = clock.done("score", self.fns["score"](
            state, frozen, prompts["ids"], prompts["mask"], sample, prompts.get("documents"),
            host_scores))
        segments, parse_stats = parsed.result() if parsed else (None, {})
        if segments is not None:
            segments = sharding.shard_batch(np.asarray(segments, np.int32), mesh)
        adv, adv_metrics = clock.done("advantages", self.fns["advantages"](
            state, frozen, hparams, exp, segments))
        state, metrics = clock.done("update", self.fns["update"](
            state, exp, adv, roll_metrics, adv_metrics, frozen))
        return state, dict(metrics, **clock.seconds,
                           **{k: v for k, v in parse_stats.items() if k.startswith("macro/")})

    def close(self):
        if self.parser is not None:
            self.parser.close()


class PhaseClock:
    """Seconds of each phase from the end of the one before, waiting on its outputs; a no-op
    (no waiting, no fields) when not `timed`."""

    def __init__(self, timed: bool):
        self.timed, self.seconds, self.last = timed, {}, time.perf_counter()

    def done(self, phase: str, outputs):
        if self.timed:
            jax.block_until_ready(outputs)
            now = time.perf_counter()
            self.seconds[f"timing/{phase}_s"], self.last = now - self.last, now
        return outputs
