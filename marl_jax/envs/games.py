"""The single-player games of the environment libraries under one environment name, `game`:
`environment("game", environment="gem:<GEM id>")` or `"textarena:<TextArena id>"` builds the
library's adapter (`gem_env.GemEnvironment`, `textarena_env.TextArenaEnvironment`) of any game the
library registers. `game_problem(spec)` is the config check's: one line naming what keeps a spec
from playing (the syntax, the library not installed, an id it does not register with the closest
ones it does, a multi-player game, a game that does not start here), found by building the
environment and starting one episode, before anything compiles.
"""
from __future__ import annotations

from marl_jax.envs.gem_env import GemEnvironment
from marl_jax.envs.registry import register_environment
from marl_jax.envs.textarena_env import TextArenaEnvironment

LIBRARIES = {"gem": GemEnvironment, "textarena": TextArenaEnvironment}


def parse(spec) -> tuple[str, str]:
    """(library, id) of `<library>:<id>` (the id may hold colons: GEM's "game:Sudoku-v0-easy")."""
    library, _, env_id = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if library not in LIBRARIES or not env_id:
        raise ValueError(f"must be {' or '.join(f'{name}:<id>' for name in LIBRARIES)} (the id "
                         "of a game the library registers, e.g. gem:game:Sudoku-v0-easy, "
                         "textarena:TowerOfHanoi-v0)")
    return library, env_id


@register_environment("game")
def game(environment: str):
    """The environment of the game `environment` (`<library>:<id>`, see the module)."""
    library, env_id = parse(environment)
    return LIBRARIES[library](env_id)


def game_problem(spec) -> str | None:
    """Why the game `spec` cannot be played, or None (see the module); plays no action."""
    try:
        game(spec).reset_row({"seed": 0}, None)
    except ValueError as error:
        return str(error)
    return None
