"""The tasks by name: each task module registers its builder here, `marl_jax.data.tasks` imports
them all and builds the one a config names.

A builder is `build(config, workdir) -> TaskData`.
"""
from __future__ import annotations

from typing import Callable

_BUILDERS: dict[str, Callable] = {}


def register_task(*names: str):
    """Decorator: registers the builder of the tasks called `names`."""
    def register(build):
        for name in names:
            if name in _BUILDERS:
                raise ValueError(f"task {name!r} is registered twice")
            _BUILDERS[name] = build
        return build
    return register


def task_builder(name: str) -> Callable:
    """The builder registered for `name`; ValueError listing the known tasks otherwise."""
    if name not in _BUILDERS:
        raise ValueError(f"config.task.name={name!r}: must be one of {tuple(sorted(_BUILDERS))}")
    return _BUILDERS[name]
