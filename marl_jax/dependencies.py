"""The installed dependencies against the ranges the project is tested on.

`setup.cfg` gives each runtime dependency the range tested in CI (the lower bound and the newest
release below the upper bound); `requirements/lock.txt` pins the versions the README's numbers
were made with. A user can still force a version outside a range (`pip install --no-deps`, an
image's own packages); `check` then says so in one line per package before anything imports it:
older than the range stops the run (releases before the oldest tested one lack APIs marl_jax
calls), newer continues with a warning (untested, usually compatible). Nothing here imports a
dependency but `packaging`.
"""
from __future__ import annotations

import configparser
import importlib.metadata
import pathlib
import sys
from collections.abc import Callable, Iterable

SETUP_CFG = pathlib.Path(__file__).resolve().parent.parent / "setup.cfg"
INSTALL_HINT = "pip install -e . -c requirements/lock.txt"


def declared_requirements(setup_cfg: pathlib.Path = SETUP_CFG) -> tuple[list[str], str]:
    """(install_requires, python_requires) of this checkout's setup.cfg, else of the installed
    marl_jax package."""
    if setup_cfg.is_file():
        parser = configparser.ConfigParser()
        parser.read(setup_cfg)
        lines = parser["options"]["install_requires"].splitlines()
        requirements = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        return requirements, parser["options"].get("python_requires", "")
    metadata = importlib.metadata.metadata("marl_jax")
    return list(importlib.metadata.requires("marl_jax") or []), metadata.get("Requires-Python", "")


def _installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _older(version: str, specifier) -> bool:
    from packaging.version import Version

    return any(Version(version) < Version(s.version) for s in specifier
               if s.operator in (">=", ">", "==", "~="))


def problems(requirements: Iterable[str], python_requires: str = "", *,
             installed: Callable[[str], str | None] = _installed_version,
             python_version: str | None = None) -> list[str]:
    """One line for each requirement the environment does not meet, starting `error:` where the
    run cannot go on (missing, or older than the range) and `warning:` where it goes on (newer)."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    lines = []
    python_version = python_version or ".".join(map(str, sys.version_info[:3]))
    supported = SpecifierSet(python_requires)
    if not supported.contains(python_version, prereleases=True):
        lines.append(_line(_older(python_version, supported), f"Python {python_version}",
                           f"Python {python_requires}", "make the virtualenv with a Python in it"))
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        wanted = text.split(";")[0].replace(" ", "")  # as setup.cfg writes it
        version = installed(requirement.name)
        if version is None:
            lines.append(f"error: {requirement.name} is not installed; marl_jax needs {wanted} "
                         f"({INSTALL_HINT})")
        elif not requirement.specifier.contains(version, prereleases=True):
            lines.append(_line(_older(version, requirement.specifier),
                               f"{requirement.name} {version}", wanted, INSTALL_HINT))
    return lines


def _line(older: bool, found: str, wanted: str, hint: str) -> str:
    if older:
        return f"error: {found} is older than the supported range {wanted} ({hint})"
    return f"warning: {found} is newer than the supported range {wanted}; untested, continuing"


def check(setup_cfg: pathlib.Path = SETUP_CFG, *, stream=sys.stderr) -> int:
    """Prints `problems` of this environment, one line each; returns 2 if the run must stop,
    else 0."""
    lines = problems(*declared_requirements(setup_cfg))
    for line in lines:
        print(line, file=stream)
    return 2 if any(line.startswith("error:") for line in lines) else 0
