"""APPS program synthesis: sandboxed execution of generated programs, unit-test reward, pass@k.

Evaluation follows the APPS reference evaluator (hendrycks/apps `eval/testing_util.py`):

- standard-input problems (no `fn_name`): the program reads `inputs[i]` on stdin; its stdout is
  compared with `outputs[i]` by the reference's cascade (`stdout_matches`): stripped text,
  whitespace-insensitive lines, numbers per line within `np.allclose` tolerance, then (mode
  "apps" only) lines compared as sets of tokens, also rounded to 3 decimals.
- call-based problems (`fn_name`): `Solution().fn_name(*inputs[i])` when the program defines
  `class Solution` (LeetCode style), otherwise the module-level function; the returned value
  passes when it equals `outputs[i]` or `outputs[i][0]` (APPS wraps most outputs in a list);
  tuples compare as lists at every depth; JSON string keys of dict inputs/outputs are turned
  back into ints as the reference does.
- the reference's import prelude (itertools, collections, math, typing.List, numpy as np, heapq,
  ...) is available to every program.

Differences from the reference, all deliberate: every test case runs in its own sandboxed
process (see `marl_jax.eval.sandbox`: by default a bubblewrap jail that sees none of the host's
files, under seccomp) instead of inside the evaluator with an alarm signal;
stdin programs run as `__main__` (the reference wraps them in a function, so an
`if __name__ == "__main__":` guard silently never ran); a returned value is compared outside the
program as plain data, so an object whose `__eq__` always returns True does not pass; a compile
error yields one -2 per test case rather than a single [-2].

Results: `run_solution` returns one bool per test case, True only for a pass. The richer
`evaluate_solution` also gives the reference's codes per case: True (pass), False (wrong answer),
-1 (runtime error, timeout or output limit), -2 (compile error).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
from typing import Any, Optional, Sequence, Union

import numpy as np

from marl_jax.eval.sandbox import SandboxLimits, encode_value, parallel_sandboxes, run_program

COMPARE_MODES = ("apps", "strict")


@dataclasses.dataclass(frozen=True)
class AppsTests:
    """Test cases of one APPS problem. Stdin problems: `inputs`/`outputs` are strings;
    call-based problems: `inputs[i]` is a list of arguments and `outputs[i]` the expected value."""

    inputs: tuple
    outputs: tuple
    fn_name: Optional[str]


@dataclasses.dataclass(frozen=True)
class SolutionEvaluation:
    """Per test case: `passed` (bool), `codes` (True / False / -1 / -2 as in the APPS
    evaluator) and sandbox `statuses`; `isolation` is the sandbox's self-report (its
    `sandbox` names the jail that ran the program); `outputs`: what each case printed (stdin
    programs) or returned (call-based), None where it did not run to the end."""

    passed: tuple
    codes: tuple
    statuses: tuple
    isolation: dict
    outputs: tuple = ()


def parse_input_output(input_output: Union[str, dict]) -> AppsTests:
    """Validate an APPS `input_output` field (a dict or its JSON string)."""
    if isinstance(input_output, (str, bytes)):
        try:
            input_output = json.loads(input_output)
        except ValueError as error:
            raise ValueError(f"input_output is not valid JSON: {error}") from None
    if not isinstance(input_output, dict):
        raise ValueError(f"input_output must be a dict or a JSON object string, got "
                         f"{type(input_output).__name__}")
    for key in ("inputs", "outputs"):
        if not isinstance(input_output.get(key), list):
            raise ValueError(f"input_output['{key}'] must be a list")
    inputs, outputs = input_output["inputs"], input_output["outputs"]
    if len(inputs) != len(outputs):
        raise ValueError(f"input_output has {len(inputs)} inputs but {len(outputs)} outputs")
    fn_name = input_output.get("fn_name")
    if fn_name is None:
        return AppsTests(tuple(_as_text(x, "inputs", i) for i, x in enumerate(inputs)),
                         tuple(_as_text(x, "outputs", i) for i, x in enumerate(outputs)), None)
    if not isinstance(fn_name, str) or not fn_name.isidentifier():
        raise ValueError(f"input_output['fn_name'] must be a Python identifier, got {fn_name!r}")
    for i, args in enumerate(inputs):
        if not isinstance(args, list):
            raise ValueError(f"input_output['inputs'][{i}] must be a list of arguments for "
                             f"fn_name {fn_name!r}, got {type(args).__name__}")
    return AppsTests(tuple(_int_keyed_arguments(a) for a in inputs),
                     tuple(_int_keyed_output(o) for o in outputs), fn_name)


def _as_text(value, field: str, index: int) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise ValueError(f"input_output['{field}'][{index}] must be a string (or a list of "
                         f"strings) for a stdin problem, got {type(value).__name__}")
    return value


def _int_keys(mapping: dict) -> dict:
    return {int(k): v for k, v in mapping.items()}


def _int_keyed_arguments(args: list) -> list:
    """JSON forces string keys; the reference turns a leading dict argument back into int
    keys (and keeps only that argument)."""
    if args and isinstance(args[0], dict):
        try:
            return [_int_keys(args[0])]
        except (ValueError, TypeError):
            return args
    return args


def _int_keyed_output(output):
    try:
        if isinstance(output, dict):
            return [_int_keys(output)]
        if isinstance(output, list) and output and isinstance(output[0], dict):
            return [_int_keys(output[0])]
    except (ValueError, TypeError):
        pass
    return output


def stdout_matches(stdout: str, expected: str, *, compare: str = "apps") -> bool:
    """Whether a stdin program's output passes, by the APPS evaluator's comparison cascade.

    compare="apps": the reference cascade: (1) stripped text equal, or equal after stripping
    every line; (2) output lines equal to the expected lines (stripped, blank ones dropped),
    also after dropping the output's blank lines; (3) one number per line, all close
    (`np.allclose`); (4) each line as a set of tokens, the lines as a set (ignores order and
    repeats), (5) the same with numbers rounded to 3 decimals. Steps 4-5 accept some wrong
    outputs (reordered lines); they are kept so pass rates match published APPS numbers.
    compare="strict": steps 1-3 plus token-wise comparison with numeric tolerance, in order.
    """
    if compare not in COMPARE_MODES:
        raise ValueError(f"compare must be one of {COMPARE_MODES}, got {compare!r}")
    lines = stdout.splitlines()
    target = expected.strip()
    if "\n".join(lines).strip() == target or "\n".join(s.strip() for s in lines).strip() == target:
        return True
    expected_lines = [x.strip() for x in expected.split("\n") if x]
    nonblank = [line for line in lines if line]
    if lines == expected_lines or nonblank == expected_lines:
        return True
    if _all_close_lines(nonblank, expected_lines):
        return True
    if compare == "strict":
        return _tokens_match(lines, expected_lines)
    output_sets = {frozenset(line.split()) for line in nonblank if line.split()}
    expected_sets = {frozenset(line.split()) for line in expected_lines}
    if output_sets == expected_sets:
        return True
    try:
        return _rounded(output_sets) == _rounded(expected_sets)
    except (ValueError, OverflowError):
        return False


def _rounded(token_sets: set) -> set:
    return {frozenset(round(float(t), 3) for t in s) for s in token_sets}


def _all_close_lines(output_lines: list, expected_lines: list) -> bool:
    try:
        got = [float(x) for x in output_lines]
        want = [float(x) for x in expected_lines]
    except (ValueError, OverflowError):
        return False
    return len(got) == len(want) and bool(np.allclose(got, want))


def _tokens_match(output_lines: list, expected_lines: list) -> bool:
    got = [line.split() for line in output_lines if line.split()]
    want = [line.split() for line in expected_lines if line.split()]
    if [len(x) for x in got] != [len(x) for x in want]:
        return False
    for a, b in zip(itertools.chain.from_iterable(got), itertools.chain.from_iterable(want)):
        if a == b:
            continue
        try:
            if not np.isclose(float(a), float(b)):
                return False
        except (ValueError, OverflowError):
            return False
    return True


def call_output_matches(result: Any, expected: Any) -> bool:
    """Whether a call-based program's returned value (plain data, tuples already lists) passes:
    equal to `expected`, or to `expected[0]` when the expected value is a non-empty list."""
    try:
        if result == expected:
            return True
        return isinstance(expected, list) and bool(expected) and result == expected[0]
    except Exception:  # comparing exotic values (e.g. deeply nested) must not fail the caller
        return False


def _limits(timeout_s: float, limits: Optional[SandboxLimits]) -> SandboxLimits:
    if limits is None:
        return SandboxLimits(timeout_s=timeout_s)
    return dataclasses.replace(limits, timeout_s=timeout_s)


def evaluate_solution(code: str, input_output: Union[str, dict], timeout_s: float = 4.0, *,
                      limits: Optional[SandboxLimits] = None, compare: str = "apps",
                      stop_at_first_failure: bool = False,
                      sandbox: str = "bubblewrap",
                      allow_unfiltered_jail: bool = False) -> SolutionEvaluation:
    """Run `code` on every test case of one APPS problem in the sandbox (one process per case).

    Args:
      code: the generated program.
      input_output: the problem's `input_output` (dict or JSON string).
      timeout_s: wall-clock budget per test case (the APPS evaluator uses 4 s).
      limits: other sandbox limits (memory, processes, output cap, ...); its timeout is
        replaced by `timeout_s`.
      compare: "apps" (reference comparison) or "strict" (see `stdout_matches`).
      stop_at_first_failure: skip the remaining cases after the first failure (enough for
        pass@k); skipped cases count as failed with code -1.
      sandbox: "bubblewrap" (default) or "namespaces" (weaker: host files stay readable). A jail
        that cannot be built complete raises `SandboxError`; nothing runs.
      allow_unfiltered_jail: the namespaces jail may run without its seccomp filter where
        libseccomp / pyseccomp is missing (otherwise it refuses).
    """
    if compare not in COMPARE_MODES:
        raise ValueError(f"compare must be one of {COMPARE_MODES}, got {compare!r}")
    tests = parse_input_output(input_output)
    limits = _limits(timeout_s, limits)
    # Expected outputs may be long; the output cap must never be what fails a correct program.
    if tests.outputs:
        if tests.fn_name is None:
            longest = max(len(o.encode("utf-8", "surrogatepass")) for o in tests.outputs)
        else:
            longest = max(len(encode_value(o)) for o in tests.outputs)
        if limits.max_output_bytes < 2 * longest + 1024:
            limits = dataclasses.replace(limits, max_output_bytes=2 * longest + 1024)

    def passes(index: int, case_run) -> bool:
        if case_run.status != "ok":
            return False
        if tests.fn_name is None:
            return stdout_matches(case_run.output, tests.outputs[index], compare=compare)
        return call_output_matches(case_run.output, tests.outputs[index])

    def should_continue(index: int, case_run) -> bool:
        return not stop_at_first_failure or passes(index, case_run)

    run = run_program(code, tests.inputs, fn_name=tests.fn_name, limits=limits,
                      should_continue=should_continue, sandbox=sandbox,
                      allow_unfiltered_jail=allow_unfiltered_jail)
    codes = []
    for index, case_run in enumerate(run.cases):
        if case_run.status == "compile_error":
            codes.append(-2)
        elif case_run.status == "ok":
            codes.append(passes(index, case_run))
        else:
            codes.append(-1)
    return SolutionEvaluation(passed=tuple(c is True for c in codes), codes=tuple(codes),
                              statuses=tuple(c.status for c in run.cases),
                              isolation=run.isolation,
                              outputs=tuple(c.output for c in run.cases))


def run_solution(code: str, input_output: Union[str, dict], timeout_s: float = 4.0,
                 **kwargs) -> list:
    """One bool per test case of `input_output`: True only when the case passes; a wrong
    answer, runtime error, timeout, output over the cap or compile error are all False.
    `timeout_s` is the budget of each test case. Keyword arguments as `evaluate_solution`."""
    return list(evaluate_solution(code, input_output, timeout_s, **kwargs).passed)


def run_solutions(codes: Sequence[str], input_outputs, timeout_s: float = 4.0,
                  max_workers: Optional[int] = None, **kwargs) -> list:
    """`run_solution` for many programs in parallel (a thread pool, one sandbox per program).

    `input_outputs`: one per code, or a single dict / JSON string shared by all of them.
    `max_workers`: sandboxes at once (None or 0: one per CPU, as many as the host's memory
    holds); ValueError when that many programs at their memory limit exceed the host's memory
    (`sandbox.parallel_sandboxes`). Returns a list (per code) of lists of bools, in the order
    of `codes`.
    """
    codes = list(codes)
    if isinstance(input_outputs, (str, bytes, dict)):
        input_outputs = [input_outputs] * len(codes)
    input_outputs = list(input_outputs)
    if len(input_outputs) != len(codes):
        raise ValueError(f"input_outputs has {len(input_outputs)} entries for {len(codes)} codes")
    max_workers = parallel_sandboxes(max_workers, _limits(timeout_s, kwargs.get("limits")))
    if not codes:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max_workers) as pool:
        futures = [pool.submit(run_solution, code, io, timeout_s, **kwargs)
                   for code, io in zip(codes, input_outputs)]
        return [future.result() for future in futures]


def _is_pass(result) -> bool:
    return isinstance(result, (bool, np.bool_)) and bool(result)


def _is_compile_error(result) -> bool:
    return not isinstance(result, (bool, np.bool_)) and result == -2


def unit_test_reward(results: Sequence) -> float:
    """RL reward of one program: the fraction of its test cases that pass; 0 for a compile
    error (any -2 code) or when there are no results. Accepts `run_solution` bools or the
    APPS codes of `evaluate_solution`."""
    results = list(results)
    if not results or any(_is_compile_error(r) for r in results):
        return 0.0
    return sum(_is_pass(r) for r in results) / len(results)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k),
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i) (no huge binomials)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"need n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def apps_pass_at_k(results_per_problem: Sequence[Sequence[Sequence]], k: int) -> float:
    """Mean pass@k over problems. `results_per_problem[p][s]` are the per-test results of
    sample s of problem p (bools or APPS codes); a sample is correct when it has at least one
    test and passes all of them. Every problem needs at least k samples."""
    results_per_problem = list(results_per_problem)
    if not results_per_problem:
        raise ValueError("results_per_problem is empty")
    estimates = []
    for p, samples in enumerate(results_per_problem):
        samples = list(samples)
        if len(samples) < k:
            raise ValueError(f"results_per_problem[{p}] has {len(samples)} samples, fewer than "
                             f"k={k}")
        correct = sum(bool(s) and all(_is_pass(r) for r in s) for s in map(list, samples))
        estimates.append(pass_at_k(len(samples), correct, k))
    return float(np.mean(estimates))
