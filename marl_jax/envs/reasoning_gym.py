"""reasoning-gym's problems as verifiable-reward tasks: the adapter to the library's own API.

reasoning-gym (`pip install -e ".[envs]"`) generates problems procedurally,
`reasoning_gym.create_dataset(name, size=, seed=, **options)[i]` -> an entry {"question",
"answer", "metadata"}, and each dataset checks an answer with its own `score_answer(answer,
entry)` -> a score in [0, 1] (1 for a right answer; some datasets give partial credit). This
module builds the library's datasets, states the answer format in the prompt, reads the answer
out of a response (`extract_answer`, the one extraction function) and scores it with the
dataset's checker (`Problems.score`): no reward model, the checker is the gold.

A task row is `{"seed", "size", "index"}`: entry `index` of the dataset the library generates
with that seed and size (reasoning-gym draws entry i of a dataset of seed s from
`Random(s + i)`, and some datasets also draw from the seed and size at creation). The library
regenerates the entry from the row whenever an episode starts, so a row replays its problem
exactly, on any process. `problem_rows` draws a task's parts (SFT demonstrations, PPO problems,
held-out problems) from seeds `PART_SEED_STRIDE` apart, so that no two parts share a random
generator, and leaves out of the held-out part every question that a training part also holds.

`ReasoningGymEnvironment` (registered as `reasoning_gym`) plays the problems: the first prompt
is the question and the answer format as a user message; each action is an attempt, scored by
the checker. With `max_attempts` = 1 an episode is one answer and its reward the checker's score
(reinforcement learning with verifiable rewards on single responses); with more, a wrong answer
gets the checker's verdict as the next observation ("answer, read the verdict, try again") and
the episode ends at a right answer or after `max_attempts`. Each attempt earns what it raises
the best score so far, so an episode's return is its best score. An attempt with no answer the
format allows scores 0 without calling the checker, and is counted (`episode_metrics`:
`reward/unparsed_frac`).

The checkers that parse an answer as a sympy expression (`MATH_VERIFY_DATASETS`, see there) get
an answer written in LaTeX through math-verify's LaTeX parser first, into the expression syntax
they read.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.util
import re
import threading
from typing import Optional

import numpy as np

from marl_jax.envs.base import Environment
from marl_jax.envs.registry import register_environment

LIBRARY = "reasoning-gym"
INSTALL = 'pip install -e ".[envs]"'
# How the prompt asks for the final answer, after the question; `extract_answer` reads it back.
# "tags" is reasoning-gym's own convention (its system prompts and `utils.extract_answer`).
ANSWER_FORMATS = {
    "tags": "Give the final answer between <answer> and </answer>.",
    "boxed": "Give the final answer in \\boxed{}.",
}
# The datasets whose `score_answer` parses the answer with `sympy.parse_expr` and compares
# expressions (reasoning-gym 0.1.x: algebra/simple_integration.py,
# algebra/intermediate_integration.py, algebra/polynomial_multiplication.py): an answer in LaTeX
# (`\frac{x^{2}}{2}`) fails there unless math-verify turns it into sympy's syntax first. Every
# other checker compares numbers or strings as the dataset's questions ask for them (puzzle24
# and countdown parse expressions too, but check which numbers they use, which a simplifying
# parser would change).
MATH_VERIFY_DATASETS = ("simple_integration", "intermediate_integration",
                        "polynomial_multiplication")
# Entry i of a dataset of seed s is drawn from Random(s + i): parts whose seeds are this far
# apart share no generator while each holds fewer problems.
PART_SEED_STRIDE = 1 << 20
# Held-out candidates drawn per held-out problem before the dataset counts as too small to
# give enough problems that no training part holds.
HELD_OUT_DRAWS = 20
_LATEX = re.compile(r"\\|\^\{|_\{")


def library():
    """The `reasoning_gym` module; ValueError naming the extra to install when it is absent."""
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ValueError(f"the {LIBRARY} library is not installed: {INSTALL}")
    return importlib.import_module("reasoning_gym")


def dataset_names() -> tuple:
    """The names of the datasets reasoning-gym registers, sorted (imports the library)."""
    return tuple(sorted(library().factory.DATASETS))


def dataset_problem(name) -> Optional[str]:
    """Why `name` is not a reasoning-gym dataset (one line, with the closest names), or None."""
    names = dataset_names()
    if isinstance(name, str) and name in names:
        return None
    close = difflib.get_close_matches(str(name), names, n=4, cutoff=0.5)
    hint = f"closest: {', '.join(close)}" if close else f"e.g. {', '.join(names[:4])}"
    return f"not a {LIBRARY} dataset ({len(names)} registered; {hint})"


def options_problem(name: str, options: dict) -> Optional[str]:
    """Why `options` are not options of reasoning-gym's dataset `name` (a name its config
    dataclass lacks, or `seed` / `size`, which the task sets per part), or None. Values are
    checked by the library when the task creates the dataset."""
    config_class = library().factory.DATASETS[name][1]
    fields = {f.name for f in dataclasses.fields(config_class)} - {"seed", "size"}
    unknown = sorted(set(options) - fields)
    if not unknown:
        return None
    close = difflib.get_close_matches(unknown[0], sorted(fields), n=3, cutoff=0.5)
    return (f"{name} has no option {unknown[0]!r}" + (f" (closest: {', '.join(close)})" if close
                                                      else "")
            + f"; its options: {', '.join(sorted(fields))} (seed and size are the task's)")


def extract_answer(text: str, answer_format: str) -> Optional[str]:
    """The final answer of a response in `answer_format` (`ANSWER_FORMATS`), stripped: the last
    `<answer>...</answer>` span (reasoning-gym's own `utils.extract_answer`) or the last
    `\\boxed{...}` (braces balanced); None when the response has none."""
    if answer_format == "tags":
        return library().utils.extract_answer(text, tag_name="answer", strip=True)
    if answer_format != "boxed":
        raise ValueError(f"answer_format={answer_format!r}: must be one of {tuple(ANSWER_FORMATS)}")
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for at in range(begin, len(text)):
        if text[at] == "{":
            depth += 1
        elif text[at] == "}":
            if depth == 0:
                return text[begin:at].strip()
            depth -= 1
    return None


def latex_to_expression(answer: str) -> str:
    """`answer` in sympy's expression syntax when it is LaTeX that math-verify parses into one
    expression (`\\frac{x^{3}}{3} + C` -> `c + x**3/3`), else `answer` unchanged."""
    if not _LATEX.search(answer):
        return answer
    import math_verify

    # The timeout is a SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    parsed = math_verify.parse(f"${answer}$",
                               extraction_config=[math_verify.LatexExtractionConfig()],
                               parsing_timeout=timeout)
    expressions = [p for p in parsed if not isinstance(p, str)]
    return str(expressions[0]) if expressions else answer


class Problems:
    """The problems of one reasoning-gym dataset with `options` (the dataset's config fields):
    entries of task rows `{"seed", "size", "index"}` and their scores."""

    def __init__(self, dataset: str, options: Optional[dict] = None,
                 answer_format: str = "tags"):
        problem = dataset_problem(dataset)
        if problem is not None:
            raise ValueError(f"dataset={dataset!r}: {problem}")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format={answer_format!r}: must be one of "
                             f"{tuple(ANSWER_FORMATS)}")
        self.name, self.options = dataset, dict(options or {})
        self.answer_format = answer_format
        self.instruction = ANSWER_FORMATS[answer_format]
        self._datasets = functools.lru_cache(maxsize=8)(self._create)
        self._lock = threading.Lock()

    def _create(self, seed: int, size: int):
        try:
            return library().create_dataset(self.name, seed=seed, size=size, **self.options)
        except (TypeError, ValueError, AssertionError) as error:
            raise ValueError(f"{LIBRARY} cannot create {self.name!r} with options "
                             f"{self.options}: {error}") from None

    def dataset(self, seed: int, size: int):
        """The library's dataset object of `seed` and `size` (kept: some create slowly)."""
        with self._lock:
            return self._datasets(int(seed), int(size))

    def entry(self, row: dict) -> dict:
        """The library's entry of task row `{"seed", "size", "index"}`."""
        seed, size, index = (row.get(k) for k in ("seed", "size", "index"))
        if not all(isinstance(v, (int, np.integer)) for v in (seed, size, index)) \
                or not 0 <= index < size:
            raise ValueError(f"a {self.name} row needs int 'seed', 'size' and 'index' in "
                             f"[0, size), got {row!r}")
        dataset = self.dataset(seed, size)
        try:
            return dataset[int(index)]
        except Exception as error:  # the library's generator, on options it did not validate
            raise ValueError(f"{LIBRARY} cannot generate {self.name!r} problems with options "
                             f"{self.options}: {type(error).__name__}: {error}") from None

    def prompt(self, entry: dict) -> str:
        """The first user message: the question and the answer format."""
        return f"{entry['question'].rstrip()}\n\n{self.instruction}"

    def demonstration(self, entry: dict) -> str:
        """The reference answer in the answer format (an SFT target); ValueError for a dataset
        whose entries carry none (`reference_problem`)."""
        if entry.get("answer") is None:
            raise ValueError(no_reference(self.name))
        if self.answer_format == "tags":
            return f"<answer>{entry['answer']}</answer>"
        return f"\\boxed{{{entry['answer']}}}"

    def answer(self, text: str) -> Optional[str]:
        """The answer the checker reads from a response, None when there is none
        (`extract_answer`, and math-verify's LaTeX parsing for `MATH_VERIFY_DATASETS`)."""
        answer = extract_answer(text, self.answer_format)
        if answer is not None and self.name in MATH_VERIFY_DATASETS:
            answer = latex_to_expression(answer)
        return answer

    def score(self, row: dict, text: str) -> tuple[float, bool]:
        """(the dataset's `score_answer` of the response's answer, whether it had one): 0.0 and
        False where the response has no answer in the format."""
        entry = self.entry(row)
        answer = self.answer(text)
        if answer is None:
            return 0.0, False
        dataset = self.dataset(row["seed"], row["size"])
        return float(dataset.score_answer(answer, entry)), True


def no_reference(name: str) -> str:
    return (f"{name}'s problems carry no reference answer (its checker scores any valid "
            "solution), so it has no demonstrations to fine-tune on: use --config.sft.steps=0")


def reference_problem(name: str, options: Optional[dict] = None) -> Optional[str]:
    """Why the dataset `name` with `options` gives no SFT demonstrations, or None: its first
    entry has no reference answer (puzzles with many solutions, e.g. graph_color, rush_hour)."""
    entry = Problems(name, options).entry(dict(seed=0, size=1, index=0))
    return no_reference(name) if entry.get("answer") is None else None


def part_seed(data_seed: int, part: int) -> int:
    """The dataset seed of part `part` (0: SFT, 1: PPO, 2: held-out) of a task (see the
    module)."""
    return int(data_seed) + int(part) * PART_SEED_STRIDE


def problem_rows(problems: Problems, data_seed: int, sizes: dict) -> dict:
    """{"sft", "rl", "eval"} lists of task rows, `sizes[part]` each, the parts drawn from
    `part_seed(data_seed, 0 | 1 | 2)`. The held-out rows are the first entries of their
    dataset whose question neither training part holds; ValueError when the first
    `HELD_OUT_DRAWS` x as many entries do not give enough (the options allow too few distinct
    problems)."""
    rows, seen = {}, set()
    for part, name in enumerate(("sft", "rl")):
        n = int(sizes[name])
        rows[name] = [dict(seed=part_seed(data_seed, part), size=max(n, 1), index=i)
                      for i in range(n)]
        seen.update(problems.entry(r)["question"] for r in rows[name])
    n = int(sizes["eval"])
    if n >= PART_SEED_STRIDE or max(len(rows["sft"]), len(rows["rl"])) >= PART_SEED_STRIDE:
        raise ValueError(f"a part holds at most {PART_SEED_STRIDE - 1} problems")
    draws = max(HELD_OUT_DRAWS * n, 1)
    seed = part_seed(data_seed, 2)
    dataset = problems.dataset(seed, draws)
    held_out, questions = [], set(seen)
    for i in range(draws):
        if len(held_out) == n:
            break
        question = dataset[i]["question"]
        if question not in questions:
            questions.add(question)
            held_out.append(dict(seed=seed, size=draws, index=i))
    if len(held_out) < n:
        raise ValueError(f"{problems.name} with options {problems.options} gave {len(held_out)} "
                         f"held-out problems that no training problem repeats in {draws} draws; "
                         f"{n} are needed: widen the options or ask for fewer")
    rows["eval"] = held_out
    return rows


@dataclasses.dataclass(frozen=True)
class AttemptState:
    """An episode: its task row, the attempts made, the best score so far and the attempts with
    no answer in the format."""

    row: dict
    attempts: int = 0
    best: float = 0.0
    unparsed: int = 0


@register_environment("reasoning_gym")
class ReasoningGymEnvironment(Environment):
    """Episodes of reasoning-gym problems (see the module): `dataset` and `options` name the
    library's dataset, `answer_format` the format the prompt asks for, `max_attempts` the
    answers an episode allows."""

    observation_role = "user"

    def __init__(self, dataset: str, options: Optional[dict] = None, max_attempts: int = 1,
                 answer_format: str = "tags"):
        if not isinstance(max_attempts, int) or max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts!r} must be an int >= 1")
        self.problems = Problems(dataset, options, answer_format)
        self.max_attempts = max_attempts

    def reset_row(self, row, rng):
        entry = self.problems.entry(row)
        return AttemptState(dict(row)), [{"role": "user",
                                         "content": self.problems.prompt(entry)}]

    def step_row(self, state, action_text, action_tokens):
        score, parsed = self.problems.score(state.row, action_text)
        reward = max(0.0, score - state.best)
        state = dataclasses.replace(state, attempts=state.attempts + 1,
                                    best=max(state.best, score),
                                    unparsed=state.unparsed + (not parsed))
        if score >= 1.0 or state.attempts >= self.max_attempts:
            return state, None, reward, True
        return state, self.verdict(score, parsed), reward, False

    def verdict(self, score: float, parsed: bool) -> str:
        """The observation after an attempt that was not right."""
        if not parsed:
            return f"No final answer found. {self.problems.instruction} Try again."
        return (f"The checker scored that answer {score:.2f} out of 1: not right. "
                f"Try again. {self.problems.instruction}")

    def episode_metrics(self, states) -> dict:
        """`reward/unparsed_frac`: the share of the attempts of `states` with no answer in the
        format (0 when none was made)."""
        attempts = sum(s.attempts for s in states)
        return {"reward/unparsed_frac": sum(s.unparsed for s in states) / max(attempts, 1)}
