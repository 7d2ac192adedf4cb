"""What the benchmarks share: the timer (best wall-clock time of a call, after a warm-up call),
the config loader and the command line of the step timings."""
import argparse
import importlib.util
import pathlib
import sys
import time

import jax


def best_time(fn, repeats: int, *, warmup: bool = True) -> float:
    """Seconds of the fastest of `repeats` calls of `fn()`, each waited on with
    `jax.block_until_ready` (a no-op on host values). The warm-up call compiles and is not timed."""
    if warmup:
        jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best


def load_config(path):
    """`get_config()` of the config file at `path` (configs import one another as
    `configs.<name>`, so the repository root goes on the path)."""
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def step_timing_args(argv, *, prog: str, doc: str, config: str, batch: int, repeats: int):
    """`--config` (a file under configs/, default `config`), `--batch` and `--repeats` of a
    step-timing benchmark."""
    root = pathlib.Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--config", default=str(root / "configs" / config))
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser.parse_args(argv)
