"""The APPS reward of `config.ppo.reward_source="host"`: the fraction of a problem's unit tests
that the generated program passes, each program in its own sandbox (`marl_jax.eval.apps`).

The task carries the tests (`TaskData.rl_unit_tests`); the pipeline hands the task its reward
(`attach_unit_test_reward`), so the data modules know no evaluator.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from marl_jax.data.real_tasks import decode_responses, extract_code
from marl_jax.eval import apps, sandbox


def check_unit_test_config(config) -> None:
    """The APPS sandbox settings: a known jail (the namespaces jail with its seccomp filter,
    unless `config.eval.allow_unfiltered_jail`), and as many parallel sandboxes as the host's
    memory holds at the per-program memory limit."""
    t = config.task
    if t.sandbox not in sandbox.SANDBOXES:
        raise ValueError(f"config.task.sandbox={t.sandbox!r}: must be one of {sandbox.SANDBOXES} "
                         "(namespaces is weaker: host files stay readable)")
    if t.sandbox == "namespaces":
        try:
            sandbox.namespaces_seccomp_program(unit_test_options(config)["allow_unfiltered_jail"])
        except sandbox.SandboxError as error:
            raise ValueError(f"config.task.sandbox='namespaces': {error}") from None
    if not isinstance(t.unit_test_memory_mb, int) or t.unit_test_memory_mb < 64:
        raise ValueError(f"config.task.unit_test_memory_mb={t.unit_test_memory_mb!r}: must be an "
                         "int >= 64 (MiB of address space per process of a program)")
    options = unit_test_options(config)
    sandbox.parallel_sandboxes(options["max_workers"], options["limits"],
                               setting="config.task.unit_test_workers")


def unit_test_options(config) -> dict:
    """Keyword arguments of `apps.run_solutions` from `config.task`: the per-test timeout, the
    parallel sandboxes, the jail and its limits (RL reward and eval run programs alike)."""
    t = config.task
    timeout_s = float(t.unit_test_timeout_s)
    return dict(timeout_s=timeout_s, max_workers=int(t.unit_test_workers) or None,
                sandbox=t.sandbox,
                allow_unfiltered_jail=bool(config.eval.get("allow_unfiltered_jail", False)),
                limits=sandbox.SandboxLimits(timeout_s=timeout_s,
                                             memory_mb=int(t.unit_test_memory_mb)))


def attach_unit_test_reward(config, task) -> None:
    """Gives `task` (a `TaskData` with `rl_unit_tests`) its unit-test reward, after checking the
    sandbox settings of `config.task`."""
    check_unit_test_config(config)
    task.host_reward = UnitTestReward(task.tokenizer, task.rl_unit_tests,
                                      **unit_test_options(config))


class UnitTestReward:
    """`reward(rows [B], response_ids [B, R], response_mask [B, R]) -> float32 [B]`: the fraction
    of its problem's unit tests each decoded program passes (0 for a program that does not
    compile), where `rows` index the RL problems (`TaskData.rl`). Programs run in parallel, each
    in its own sandbox with `timeout_s` per test case; `run_options` (max_workers, sandbox,
    limits) go to `apps.run_solutions`.
    """

    def __init__(self, tokenizer, problems: Sequence[dict], *, timeout_s: float = 4.0,
                 **run_options):
        self.tokenizer = tokenizer
        self.problems = list(problems)
        self.timeout_s = timeout_s
        self.run_options = run_options

    def __call__(self, rows, response_ids, response_mask) -> np.ndarray:
        rows = np.asarray(rows)
        if rows.ndim != 1 or len(rows) != np.shape(response_ids)[0]:
            raise ValueError(f"rows has shape {rows.shape}; expected one index per response "
                             f"({np.shape(response_ids)[0]})")
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self.problems)):
            raise ValueError(f"rows must index the {len(self.problems)} RL problems, got "
                             f"{rows.min()}..{rows.max()}")
        codes = [extract_code(t) for t in decode_responses(self.tokenizer, response_ids,
                                                          response_mask)]
        results = apps.run_solutions(codes, [self.problems[i] for i in rows], self.timeout_s,
                                     **self.run_options)
        return np.asarray([apps.unit_test_reward(r) for r in results], np.float32)
