"""Prints pip constraints that pin each runtime dependency of setup.cfg, and each of its `smoke`
extra, to the lower bound of its range: the oldest versions the ranges allow, which CI's smoke
run installs. Standard library only (it runs before any virtualenv exists)."""
import configparser
import pathlib
import re
import sys

setup_cfg = configparser.ConfigParser()
setup_cfg.read(pathlib.Path(__file__).resolve().parent.parent / "setup.cfg")
lines = (setup_cfg["options"]["install_requires"] + "\n"
         + setup_cfg["options.extras_require"]["smoke"]).splitlines()
for line in lines:
    requirement = line.split("#")[0].strip()
    if not requirement:
        continue
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    lower = re.search(r">=\s*([^,;\s]+)", requirement)
    if lower is None:
        sys.exit(f"setup.cfg: {requirement!r} has no lower bound")
    print(f"{name}=={lower.group(1)}")
