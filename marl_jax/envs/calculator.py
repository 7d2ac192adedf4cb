"""Calculator: arithmetic word problems solved with a calculator tool, a synthetic multi-turn
task with a known gold answer (the offline test bed of multi-turn RLHF).

A problem is generated from a seed: a short story with three small integers whose answer takes
two operations, e.g.

    tom has 12 apples and buys 3 boxes of 4 apples . how many apples does tom have now ?

Each of the policy's actions is one of

    calc ( <expression> )   the tool: the observation is the expression's exact value ("24",
                            "- 3"), "error: too large" beyond +-max_value, or "error: bad
                            expression" outside the grammar of `marl_jax.envs.arithmetic`
    answer: <integer>       ends the episode: reward 1 for the gold answer, else 0

and anything else gets the observation "error: bad action". Tool calls and errors earn 0, so an
episode's return is exactly whether its answer is right (the gold, with no shaping that a policy
could collect without solving the problem). An episode without an answer ends after
`max_turns` actions with return 0. Observations are `tool` messages.

Numbers are written as words (a negative one as "-" and its magnitude) so that the task's own
word-level tokenizer (`build_tokenizer`: the numbers 0..max_value, the story and action words)
expresses every problem, action and observation. `demonstrations` are transcripts of good tool
use for SFT: one calc call per operation, then the answer.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from marl_jax.envs import arithmetic
from marl_jax.envs.base import Environment
from marl_jax.envs.registry import register_environment
from marl_jax.envs.word_tokenizer import build_word_chat_tokenizer

ACTION_WORDS = ("calc", "(", ")", "+", "-", "*", "answer:")
ERROR_WORDS = ("error:", "bad", "action", "expression", "too", "large")
NAMES = ("tom", "ann", "sam", "mia", "leo", "zoe")
ITEMS = ("apples", "pens", "cards", "stamps", "shells", "coins")
# (kind, story) with three numbers a, b, c; `_steps` gives each kind's two operations.
STORIES = (
    ("add_mul", ("{name} has {a} {item} and buys {b} boxes of {c} {item} . how many {item} does "
                 "{name} have now ?")),
    ("sum_mul", ("{name} has {a} {item} and gets {b} more . each one is worth {c} points . how "
                 "many points are they worth ?")),
    ("mul_sub", ("{name} fills {a} boxes with {b} {item} each and gives away {c} {item} . how "
                 "many {item} are left ?")),
    ("diff_mul", ("{name} has {a} {item} and loses {b} . each one left weighs {c} grams . how "
                  "many grams do they weigh ?")),
)
_CALL = re.compile(r"\s*calc\s*\((.*)\)\s*", re.DOTALL)
_ANSWER = re.compile(r"\s*answer:\s*(-?)\s*([0-9]+)\s*")


@dataclasses.dataclass(frozen=True)
class CalculatorTask:
    """The problems' sizes: `a` in [min_a, max_a], `b` and `c` in [2, max_bc]; numbers are words
    up to `max_value`. `demo_shortcut`: the share of SFT demonstrations that stop early, answering
    the first tool call's value instead of making the second call (a wrong answer: the policy
    decides when to stop, and the demonstrations sometimes stop too soon)."""

    min_a: int = 10
    max_a: int = 20
    max_bc: int = 9
    max_value: int = 999
    demo_shortcut: float = 0.0

    def __post_init__(self):
        if not 2 < self.max_bc < self.min_a <= self.max_a:
            raise ValueError(f"need 2 < max_bc < min_a <= max_a, got max_bc={self.max_bc}, "
                             f"min_a={self.min_a}, max_a={self.max_a}")
        largest = (self.max_a + self.max_bc) * self.max_bc
        if self.max_value < largest:
            raise ValueError(f"max_value={self.max_value} must hold the largest intermediate "
                             f"value {largest}")
        if not 0.0 <= self.demo_shortcut <= 1.0:
            raise ValueError(f"demo_shortcut={self.demo_shortcut} must be in [0, 1]")


def number_text(value: int) -> str:
    """An integer as the task writes it: "24", "- 3"."""
    return f"- {-value}" if value < 0 else str(value)


def _steps(kind: str, a: int, b: int, c: int) -> list:
    """[(expression, value)] of the two operations, in the order a solver does them."""
    if kind == "add_mul":
        return [(f"{b} * {c}", b * c), (f"{a} + {b * c}", a + b * c)]
    if kind == "sum_mul":
        return [(f"{a} + {b}", a + b), (f"{a + b} * {c}", (a + b) * c)]
    if kind == "mul_sub":
        return [(f"{a} * {b}", a * b), (f"{a * b} - {c}", a * b - c)]
    return [(f"{a} - {b}", a - b), (f"{a - b} * {c}", (a - b) * c)]


def problems(task: CalculatorTask, seed: int, n: int) -> list:
    """[{"problem", "answer", "steps"}] task rows: the story, the gold answer, and the two
    operations as [(expression text, value)]."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        kind, story = STORIES[rng.integers(len(STORIES))]
        a = int(rng.integers(task.min_a, task.max_a + 1))
        b, c = (int(x) for x in rng.integers(2, task.max_bc + 1, size=2))
        text = story.format(name=NAMES[rng.integers(len(NAMES))],
                            item=ITEMS[rng.integers(len(ITEMS))], a=a, b=b, c=c)
        steps = _steps(kind, a, b, c)
        rows.append(dict(problem=text, answer=steps[-1][1], steps=steps))
    return rows


def demonstrations(task: CalculatorTask, seed: int, n: int) -> list:
    """[{"problem", "answer", "messages", "shortcut"}]: SFT transcripts of tool use. `messages` is
    the whole conversation: the problem (user), then per operation a calc call (assistant) and
    its value (tool), then the answer (assistant); a share `task.demo_shortcut` of them (drawn
    with seed `[seed, 1]`, `shortcut` True) answers the first call's value right after it."""
    rows = []
    stops = np.random.default_rng([seed, 1]).random(n) < task.demo_shortcut
    for row, stop in zip(problems(task, seed, n), stops):
        messages = [{"role": "user", "content": row["problem"]}]
        steps = row["steps"][:1] if stop else row["steps"]
        for expression, value in steps:
            messages.append({"role": "assistant", "content": f"calc ( {expression} )"})
            messages.append({"role": "tool", "content": number_text(value)})
        answer = steps[-1][1] if stop else row["answer"]
        messages.append({"role": "assistant", "content": f"answer: {number_text(answer)}"})
        rows.append(dict(problem=row["problem"], answer=row["answer"], messages=messages,
                         shortcut=bool(stop)))
    return rows


def vocabulary(task: CalculatorTask) -> list:
    """Every word of the task's problems, actions and observations."""
    story_words = [w for _, story in STORIES for w in story.split() if not w.startswith("{")]
    numbers = [str(i) for i in range(task.max_value + 1)]
    return list(dict.fromkeys([*ACTION_WORDS, *ERROR_WORDS, *NAMES, *ITEMS, *story_words,
                               *numbers]))


def build_tokenizer(task: CalculatorTask, directory: str):
    """The task's word-level chat tokenizer (see `marl_jax.envs.word_tokenizer`), written to
    `directory` and loaded by transformers."""
    return build_word_chat_tokenizer(vocabulary(task), directory)


@dataclasses.dataclass(frozen=True)
class CalculatorState:
    answer: int
    turns: int = 0


@register_environment("calculator")
class CalculatorEnvironment(Environment):
    """The calculator episodes of task rows {"problem": str, "answer": int} (see the module).
    `max_value` bounds the values the tool shows: the task's tokenizer writes numbers up to
    `CalculatorTask.max_value`."""

    observation_role = "tool"

    def __init__(self, max_turns: int = 4, max_value: int = 999):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an int >= 1")
        if not isinstance(max_value, int) or max_value < 1:
            raise ValueError(f"max_value={max_value!r} must be an int >= 1")
        self.max_turns = max_turns
        self.max_value = max_value

    def reset_row(self, row, rng):
        problem, answer = row.get("problem"), row.get("answer")
        if not isinstance(problem, str) or not isinstance(answer, (int, np.integer)):
            raise ValueError("a calculator row needs 'problem' (str) and 'answer' (int)")
        return CalculatorState(int(answer)), [{"role": "user", "content": problem}]

    def step_row(self, state, action_text, action_tokens):
        state = dataclasses.replace(state, turns=state.turns + 1)
        last = state.turns >= self.max_turns
        answer = _ANSWER.fullmatch(action_text)
        if answer is not None:
            sign, digits = answer.groups()
            correct = len(digits) <= 18 and int(sign + digits) == state.answer
            return state, None, float(correct), True
        call = _CALL.fullmatch(action_text)
        if call is None:
            return state, "error: bad action", 0.0, last
        try:
            value = arithmetic.evaluate(call.group(1))
        except arithmetic.ExpressionError:
            return state, "error: bad expression", 0.0, last
        if abs(value) > self.max_value:
            return state, "error: too large", 0.0, last
        return state, number_text(value), 0.0, last
