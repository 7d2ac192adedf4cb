"""What the adapters of the environment libraries (`gem_env`, `textarena_env`) share: the game a
task row names, each episode's own global random state, and one-line messages of a library's
errors and of an id it does not register.

A library game's task row is {"seed": int}: the game is a function of that seed alone (every
episode of a row is the same game, whose first prompt the task's prompt arrays hold, as a
calculator row is one problem).

Random state. GEM's and TextArena's games draw from Python's `random` module and numpy's global
generator (GEM's `reset(seed)` seeds both, TextArena's state seeds `random`; 2048 places its new
tiles, Minesweeper its mines and the instructions their example action from them). Episodes
stepped in turn would share one stream, and an episode would depend on the other rows the
rollout stepped before it. So each episode keeps its own copy of both states:
`EpisodeRandom(seed).active()` swaps the copy in around a call into the library and the caller's
states back after it. An episode is then a function of its row's seed and its actions alone (a
replay from the row reproduces it), and the process's global random state is as it was.
"""
from __future__ import annotations

import contextlib
import difflib
import random
import re
import threading

import numpy as np

INSTALL = 'pip install -e ".[envs]"'
# The swap reads and writes process-wide state: one episode's call at a time.
_LOCK = threading.Lock()
_TERMINAL_COLOURS = re.compile(r"\x1b\[[0-9;]*m")


def row_seed(row: dict) -> int:
    """The game's seed of a task row: `row["seed"]`, an int in [0, 2**32) (what numpy's global
    generator takes)."""
    seed = row.get("seed")
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) \
            or not 0 <= seed < 2 ** 32:
        raise ValueError(f"a game row needs 'seed', an int in [0, 2**32), got {seed!r}")
    return int(seed)


class EpisodeRandom:
    """Python's and numpy's global random states of one episode, both seeded with `seed`."""

    def __init__(self, seed: int):
        self._python = random.Random(seed).getstate()
        self._numpy = np.random.RandomState(seed).get_state()

    @contextlib.contextmanager
    def active(self):
        """The episode's states are the global ones inside the block, and kept after it."""
        with _LOCK:
            saved = random.getstate(), np.random.get_state()
            random.setstate(self._python)
            np.random.set_state(self._numpy)
            try:
                yield
            finally:
                self._python, self._numpy = random.getstate(), np.random.get_state()
                random.setstate(saved[0])
                np.random.set_state(saved[1])


def unknown_id(library: str, env_id: str, ids) -> str:
    """One line naming an id the library does not register and the closest ones it does."""
    close = difflib.get_close_matches(env_id, ids, n=4, cutoff=0.5)
    hint = (f"close names: {', '.join(close)}" if close else
            f"none of its {len(ids)} ids is close (e.g. {', '.join(list(ids)[:3])})")
    return f"unknown {library} environment {env_id!r}; {hint}"


def one_line(error: BaseException) -> str:
    """`Type: message` of a library's exception on one line (its lines joined, terminal colour
    codes and rules of asterisks left out, at most 200 characters of message)."""
    lines = [" ".join(_TERMINAL_COLOURS.sub("", line).split()) for line in str(error).splitlines()]
    text = " ".join(line for line in lines if line.strip("*"))
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__
