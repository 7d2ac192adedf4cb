"""GEM's environments (axon-rl/gem, the `gem-llm` package) behind the environment protocol.

`GemEnvironment(env_id)` plays the environment GEM registers as `env_id` (e.g.
"game:GuessTheNumber-v0-easy", "game:Sudoku-v0-easy"). The episode of a task row {"seed": int}
is a fresh `gem.make(env_id)` reset with `reset(seed=row["seed"])`: its first observation is the
first prompt (a user message); each action is the decoded assistant turn, passed to GEM's `step`
as it is (the game's instructions state its format, e.g. `\\boxed{...}`); `step(action) ->
(observation, reward, terminated, truncated, info)` gives the turn's observation and reward, and
the episode ends where GEM terminates or truncates it. GEM's object holds the game's state;
nothing of a game's rules is written here.

An observation's text is GEM's own observation formatting of one turn (its
`ObservationWrapper`): `info["prefix"] + observation` (ending in a newline) `+ info["suffix"]`.
GEM's games put the current board in the suffix ("Current board: ... Enter your move.") and
their observation proper is the instructions or the last move's feedback alone, so without it a
policy would play blind. The conversation keeps every earlier turn, where GEM's wrapper would
concatenate them into one text.

The state is the episode (`GemEpisode`): GEM's live object, which `step_row` advances in place
and returns (see `marl_jax.envs.base`), and the episode's own global random state
(`marl_jax.envs.library_episodes`), so that a replay from the row reproduces the episode.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from marl_jax.envs.base import Environment
from marl_jax.envs.library_episodes import INSTALL, EpisodeRandom, one_line, row_seed, unknown_id


@functools.lru_cache(maxsize=None)
def library():
    """The `gem` package; ValueError naming the extra that installs it where it is missing."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        import gem
    except ImportError as error:
        raise ValueError(f"GEM (the gem-llm package) is not installed ({error}): {INSTALL}") \
            from None
    finally:
        # Importing gem configures the root logger (logging.basicConfig at INFO): the process's
        # logging stays as it was.
        root.handlers[:] = handlers
        root.setLevel(level)
    return gem


def registered_ids() -> tuple:
    """Every id GEM registers, sorted."""
    library()
    from gem.envs.registration import ENV_REGISTRY

    return tuple(sorted(ENV_REGISTRY))


@dataclasses.dataclass
class GemEpisode:
    """A running episode: GEM's environment object (the game's state) and the episode's global
    random state."""

    env: Any
    random: EpisodeRandom


class GemEnvironment(Environment):
    """The episodes of GEM's environment `env_id` (see the module); an id GEM does not register
    is one ValueError naming the closest ones."""

    observation_role = "user"

    def __init__(self, env_id: str):
        ids = registered_ids()
        if env_id not in ids:
            raise ValueError(unknown_id("GEM", env_id, ids))
        self.env_id = env_id

    def reset_row(self, row, rng):
        """The game of `row["seed"]`; `rng` is not read (`library_episodes`)."""
        seed = row_seed(row)
        episode_random = EpisodeRandom(seed)
        try:
            with episode_random.active():
                env = library().make(self.env_id)
                observation, info = env.reset(seed=seed)
        except Exception as error:  # the library's own: a missing corpus, dataset or key
            raise ValueError(f"GEM environment {self.env_id!r} does not start: "
                             f"{one_line(error)}") from None
        if not isinstance(observation, str):
            raise ValueError(f"GEM environment {self.env_id!r} observes a "
                             f"{type(observation).__name__}, not text")
        return GemEpisode(env, episode_random), [{"role": "user",
                                                  "content": turn_text(observation, info)}]

    def step_row(self, state, action_text, action_tokens):
        with state.random.active():
            observation, reward, terminated, truncated, info = state.env.step(action_text)
        done = terminated or truncated
        if done or not isinstance(observation, str):
            return state, None if done else observation, reward, done
        return state, turn_text(observation, info), reward, done


def turn_text(observation: str, info) -> str:
    """One turn's observation as GEM's `ObservationWrapper` writes it: the info's prefix, the
    observation ending in a newline, the info's suffix (the game's current board)."""
    from gem.wrappers.observation_wrapper import maybe_add_new_line

    info = info if isinstance(info, dict) else {}
    return (str(info.get("prefix", "")) + maybe_add_new_line(observation)
            + str(info.get("suffix", "")))
