"""Multi-turn environments: the protocol (`base`), the registry, token-in-token-out turns
through a chat template (`chat_turns`), the rollout's host callback (`turn_callback`),
conversations as trajectories (`transcripts`), the multi-turn tasks of the pipeline (`tasks`),
and one module per environment, each registered under its name:

- `calculator`: arithmetic word problems with a calculator tool (synthetic, exact gold);
- `apps_repair`: APPS programs repaired from the failing tests' feedback (the APPS jail);
- `reasoning_gym`: reasoning-gym's problems, answered once or again after the checker's verdict;
- `game`: any single-player game of GEM or TextArena through the library's own API (`games`,
  one adapter per library: `gem_env`, `textarena_env`).
"""
from marl_jax.envs import apps_repair, calculator, games  # noqa: F401  (they register)
from marl_jax.envs import reasoning_gym  # noqa: F401  (registers; imports the library lazily)
from marl_jax.envs import tasks  # noqa: F401  (registers the multi-turn tasks)
from marl_jax.envs.base import Environment, StepResult, flag_counts
from marl_jax.envs.registry import environment, environment_names, register_environment
from marl_jax.envs.turn_callback import TurnStep, turn_callback

__all__ = ["Environment", "StepResult", "TurnStep", "environment", "environment_names",
           "flag_counts", "register_environment", "turn_callback"]
