"""Benchmarks: `python experiments/bench.py {macro,sampler,group,step,device,memory,scoring,trunk,
mismatch,rollout,ppo} [flags]`.

Each benchmark lives in `experiments/bench_<name>.py` (`group`: `bench_groups.py`) with a
`main(argv)` function and prints the numbers it measures side by side in one run (ratios, not
absolute times, are what matter on a noisy machine).
"""
import importlib
import pathlib
import sys

BENCHMARKS = ("macro", "sampler", "group", "step", "device", "memory", "scoring", "trunk",
              "mismatch", "rollout", "ppo")
# Modes whose module name differs from the mode.
MODULES = {"group": "groups"}


def main(argv):
    if len(argv) < 2 or argv[1] not in BENCHMARKS:
        raise SystemExit(f"usage: python experiments/bench.py {{{','.join(BENCHMARKS)}}} [flags]")
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent.parent))
    from marl_jax import xla_flags

    added = xla_flags.apply()
    if added:
        print(f"XLA flags set for this GPU: {' '.join(added)} (a flag named in XLA_FLAGS wins)")
    name = MODULES.get(argv[1], argv[1])
    if name == "ppo" and "--async" in argv[2:]:
        name = "async"  # the synchronous loop beside asynchronous PPO (bench_async.py)
    importlib.import_module(f"bench_{name}").main(argv[2:])


if __name__ == "__main__":
    main(sys.argv)
