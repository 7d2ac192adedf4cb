"""The environments by name: each environment module registers its class here, and
`marl_jax.envs` imports them all, so `environment(name, **kwargs)` builds any of them.
"""
from __future__ import annotations

from typing import Callable

_FACTORIES: dict[str, Callable] = {}


def register_environment(*names: str):
    """Decorator: registers the class (or factory) of the environments called `names`."""
    def register(factory):
        for name in names:
            if name in _FACTORIES:
                raise ValueError(f"environment {name!r} is registered twice")
            _FACTORIES[name] = factory
        return factory
    return register


def environment_names() -> tuple:
    """The registered names, sorted."""
    return tuple(sorted(_FACTORIES))


def environment(name: str, **kwargs):
    """A new environment `name` built with `kwargs`; ValueError listing the known names
    otherwise."""
    if name not in _FACTORIES:
        raise ValueError(f"unknown environment {name!r}: must be one of {environment_names()}")
    return _FACTORIES[name](**kwargs)
