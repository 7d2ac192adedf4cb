"""APPS repair: the policy writes a program, the APPS jail runs it on the problem's unit tests,
and the failing tests come back as the next observation, for up to `max_attempts` attempts.

The program of an action is its first markdown code fence (else the whole text), run as the APPS
reward runs it (`marl_jax.eval.apps.evaluate_solution`, each program in its own sandbox, one
process per test case). The observation after an attempt that is not perfect reports how many
tests passed and, for the first `feedback_cases` failing ones, the input, the expected output
and what the program gave (its output, or "runtime error", "timeout", ...), each cut to
`max_feedback_chars`; a program that does not compile is told so. The turn's reward is the gain
in pass rate over the previous attempt (the first attempt's over 0), so an episode's rewards sum
to its last attempt's pass rate. The episode ends at a perfect program or after `max_attempts`.
A batch's rows run in parallel sandboxes (`max_workers`; None: one per CPU, as many as the
host's memory holds at the per-program limit, `marl_jax.eval.sandbox.parallel_sandboxes`).

Task rows are the APPS task's prompt records: {"prompt": str, "input_output": dict or JSON}.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Optional

from marl_jax.data.real_tasks import extract_code
from marl_jax.envs.base import Environment
from marl_jax.envs.registry import register_environment
from marl_jax.eval import apps
from marl_jax.eval.sandbox import SANDBOXES, SandboxLimits, parallel_sandboxes

_FAILURES = {"runtime_error": "runtime error", "timeout": "timeout",
             "output_limit": "output over the limit", "not_run": "not run"}


@dataclasses.dataclass(frozen=True)
class RepairState:
    input_output: object
    tests: apps.AppsTests
    pass_rate: float = 0.0
    attempts: int = 0


@register_environment("apps_repair")
class AppsRepairEnvironment(Environment):
    """Repair episodes of APPS problems (see the module)."""

    observation_role = "user"

    def __init__(self, max_attempts: int = 4, timeout_s: float = 4.0,
                 sandbox: str = "bubblewrap", limits: Optional[SandboxLimits] = None,
                 allow_unfiltered_jail: bool = False, feedback_cases: int = 2,
                 max_feedback_chars: int = 300, max_workers: Optional[int] = None):
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts!r} must be an int >= 1")
        if sandbox not in SANDBOXES:
            raise ValueError(f"sandbox={sandbox!r} must be one of {SANDBOXES}")
        if not isinstance(feedback_cases, int) or feedback_cases < 1:
            raise ValueError(f"feedback_cases={feedback_cases!r} must be an int >= 1")
        if not isinstance(max_feedback_chars, int) or max_feedback_chars < 1:
            raise ValueError(f"max_feedback_chars={max_feedback_chars!r} must be an int >= 1")
        self.max_attempts = max_attempts
        self.timeout_s = float(timeout_s)
        self.row_workers = parallel_sandboxes(
            max_workers, dataclasses.replace(limits or SandboxLimits(), timeout_s=self.timeout_s))
        self.run_options = dict(limits=limits, sandbox=sandbox,
                                allow_unfiltered_jail=allow_unfiltered_jail)
        self.feedback_cases = feedback_cases
        self.max_feedback_chars = max_feedback_chars

    def reset_row(self, row, rng):
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("an apps_repair row needs 'prompt' (str)")
        tests = apps.parse_input_output(row.get("input_output"))
        if not tests.inputs:
            raise ValueError("the row's input_output holds no test case")
        return RepairState(row["input_output"], tests), [{"role": "user", "content": prompt}]

    def step_row(self, state, action_text, action_tokens):
        evaluation = apps.evaluate_solution(extract_code(action_text), state.input_output,
                                            self.timeout_s, **self.run_options)
        pass_rate = apps.unit_test_reward(evaluation.codes)
        reward = pass_rate - state.pass_rate
        state = dataclasses.replace(state, pass_rate=pass_rate, attempts=state.attempts + 1)
        if pass_rate == 1.0 or state.attempts >= self.max_attempts:
            return state, None, reward, True
        return state, self.feedback(state.tests, evaluation), reward, False

    def feedback(self, tests: apps.AppsTests, evaluation: apps.SolutionEvaluation) -> str:
        """The observation after an attempt: pass count and the first failing tests."""
        total = len(evaluation.codes)
        if any(code == -2 for code in evaluation.codes):
            what = (f"does not compile or defines no function {tests.fn_name}" if tests.fn_name
                    else "does not compile")
            return f"The program {what}; it passed 0 of {total} tests. Fix the program."
        failing = [i for i, passed in enumerate(evaluation.passed) if not passed]
        parts = [f"The program passed {total - len(failing)} of {total} tests. Failing tests:"]
        for i in failing[:self.feedback_cases]:
            status = evaluation.statuses[i]
            got = (self._show(evaluation.outputs[i], tests.fn_name) if status == "ok"
                   else _FAILURES.get(status, status))
            parts += ["input:", self._show(tests.inputs[i], tests.fn_name),
                      "expected:", self._show(tests.outputs[i], tests.fn_name), "got:", got]
        if len(failing) > self.feedback_cases:
            parts.append(f"({len(failing) - self.feedback_cases} more failing tests)")
        parts.append("Fix the program.")
        return "\n".join(parts)

    def _show(self, value, fn_name) -> str:
        """A test's input or output as text (stdin text as is, call arguments and values as
        JSON), cut to max_feedback_chars."""
        if fn_name is None and isinstance(value, str):
            text = value.rstrip("\n")
        else:
            try:
                text = json.dumps(value)
            except (TypeError, ValueError):
                text = repr(value)
        if len(text) > self.max_feedback_chars:
            text = text[:self.max_feedback_chars] + " ..."
        return text
