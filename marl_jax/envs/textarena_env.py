"""TextArena's single-player games (the `textarena` package) behind the environment protocol.

`TextArenaEnvironment(env_id)` plays the game TextArena registers as `env_id` (e.g.
"GuessTheNumber-v0", "TowerOfHanoi-v0"), with the observation and action wrappers the id comes
with. The episode of a task row {"seed": int} is a fresh `textarena.make(env_id)` reset with
`reset(num_players=1, seed=row["seed"])`; `get_observation()` gives the first prompt (a user
message); each action is the decoded assistant turn, passed to TextArena's `step` as it is (the
game's prompt states its format, e.g. `[5]`); `step(action) -> (done, info)` ends the episode
where TextArena says it is done, and the turn's reward is 0 before then and, on the last turn,
the player's reward that `close()` returns. TextArena's object holds the game's state; nothing
of a game's rules is written here. A game whose reset with one player fails or whose state is
not TextArena's `SinglePlayerState` (a multi-player game) is refused.

Observations. TextArena's observation wrappers write the whole history each time (the prompt,
the player's actions, the game's messages), where a conversation holds the earlier turns
already: a turn's observation is the text that follows the previous observation's, and the whole
text where it does not extend it (a wrapper that shows the current board alone).

The state is the episode (`TextArenaEpisode`): TextArena's live object, which `step_row`
advances in place and returns (see `marl_jax.envs.base`), the text observed so far and the
episode's own global random state (`marl_jax.envs.library_episodes`: TextArena seeds Python's
`random` from the reset's seed), so that a replay from the row reproduces the episode.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from marl_jax.envs.base import Environment
from marl_jax.envs.library_episodes import INSTALL, EpisodeRandom, one_line, row_seed, unknown_id


@functools.lru_cache(maxsize=None)
def library():
    """The `textarena` package; ValueError naming the extra that installs it where it is
    missing."""
    try:
        import textarena
    except ImportError as error:
        raise ValueError(f"TextArena (the textarena package) is not installed ({error}): "
                         f"{INSTALL}") from None
    return textarena


def registered_ids() -> tuple:
    """Every id TextArena registers, sorted."""
    library()
    from textarena.envs.registration import ENV_REGISTRY

    return tuple(sorted(ENV_REGISTRY))


@dataclasses.dataclass
class TextArenaEpisode:
    """A running episode: TextArena's environment object (the game's state), the text observed
    so far and the episode's global random state."""

    env: Any
    observed: str
    random: EpisodeRandom


class TextArenaEnvironment(Environment):
    """The episodes of TextArena's single-player game `env_id` (see the module); an id TextArena
    does not register is one ValueError naming the closest ones."""

    observation_role = "user"

    def __init__(self, env_id: str):
        ids = registered_ids()
        if env_id not in ids:
            raise ValueError(unknown_id("TextArena", env_id, ids))
        self.env_id = env_id

    def reset_row(self, row, rng):
        """The game of `row["seed"]`; `rng` is not read (`library_episodes`)."""
        seed = row_seed(row)
        episode_random = EpisodeRandom(seed)
        ta = library()
        try:
            with episode_random.active():
                env = ta.make(self.env_id)
                env.reset(num_players=1, seed=seed)
                _, observation = env.get_observation()
        except Exception as error:  # the library's own: more players, a missing corpus or key
            raise ValueError(f"TextArena game {self.env_id!r} does not start as a single-player "
                             f"game: reset(num_players=1) raises {one_line(error)}") from None
        if not isinstance(env.state, ta.SinglePlayerState):
            raise ValueError(f"TextArena game {self.env_id!r} is a multi-player game (its state "
                             f"is a {type(env.state).__name__}); only single-player games play "
                             "here")
        if not isinstance(observation, str):
            raise ValueError(f"TextArena game {self.env_id!r} observes a "
                             f"{type(observation).__name__}, not text (an id without an "
                             "observation wrapper, such as a -raw one)")
        episode = TextArenaEpisode(env, observation, episode_random)
        return episode, [{"role": "user", "content": observation.strip()}]

    def step_row(self, state, action_text, action_tokens):
        with state.random.active():
            done, _ = state.env.step(action_text)
            if done:
                rewards, _ = state.env.close()
                return state, None, rewards[0], done
            _, observation = state.env.get_observation()
        new = observation[len(state.observed):] if observation.startswith(state.observed) \
            else observation
        state.observed = observation
        return state, new.strip(), 0.0, done
