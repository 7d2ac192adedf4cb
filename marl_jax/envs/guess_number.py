"""Guess the number: a text game with feedback every turn.

The environment holds a secret integer in [low, high] (the task row's `secret`, or drawn
uniformly from the row's seed). Each action is `guess <integer>`; the observation says where the
secret lies: "higher" (the secret is higher than the guess), "lower", and the episode ends at the
right guess. Anything else gets "error: bad action" and counts as a wrong guess.

Rewards, exact: -1 / max_turns for each wrong (or malformed) guess, +1 for the right one. So an
episode solved at guess k returns 1 - (k - 1) / max_turns (fewer guesses, more reward), and one
that runs out of its `max_turns` guesses returns -1. Observations are `user` messages.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np

from marl_jax.envs.base import Environment
from marl_jax.envs.registry import register_environment

_GUESS = re.compile(r"\s*guess\s*(-?)\s*([0-9]{1,18})\s*")


@dataclasses.dataclass(frozen=True)
class GuessState:
    secret: int
    turns: int = 0


@register_environment("guess_number")
class GuessNumberEnvironment(Environment):
    """Guess-the-number episodes of task rows {"low"?, "high"?, "secret"?} (see the module);
    a row without bounds uses the environment's."""

    observation_role = "user"

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 7):
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an int >= 1")
        _check_bounds(low, high)
        self.low, self.high, self.max_turns = low, high, max_turns

    def reset_row(self, row, rng):
        low, high = row.get("low", self.low), row.get("high", self.high)
        _check_bounds(low, high)
        secret = row.get("secret")
        if secret is None:
            secret = int(rng.integers(low, high + 1))
        elif not isinstance(secret, (int, np.integer)) or not low <= secret <= high:
            raise ValueError(f"secret={secret!r} must be an int in [{low}, {high}]")
        prompt = f"guess the number from {low} to {high} . say guess and a number ."
        return GuessState(int(secret)), [{"role": "user", "content": prompt}]

    def step_row(self, state, action_text, action_tokens):
        state = dataclasses.replace(state, turns=state.turns + 1)
        wrong = -1.0 / self.max_turns
        last = state.turns >= self.max_turns
        match = _GUESS.fullmatch(action_text)
        if match is None:
            return state, "error: bad action", wrong, last
        guess = int(match.group(1) + match.group(2))
        if guess == state.secret:
            return state, None, 1.0, True
        return state, "higher" if state.secret > guess else "lower", wrong, last


def _check_bounds(low, high):
    if not (isinstance(low, (int, np.integer)) and isinstance(high, (int, np.integer))
            and low <= high):
        raise ValueError(f"need int bounds low <= high, got low={low!r}, high={high!r}")
