"""A run's persistent compilation cache: a program built again loads the first build's
executable; the directory is the process's own and is gone when it exits."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = """
import os, jax, jax.numpy as jnp
from jax import monitoring
events = []
monitoring.register_event_listener(lambda name, **kw: events.append(name))
jax.jit(lambda x: x + 1)(1.0)  # compiled before the cache is turned on
from marl_jax.train import compile_cache
compile_cache.MIN_COMPILE_SECONDS = 0.0
path = compile_cache.use_run_cache()
assert compile_cache.use_run_cache() == path
def build():  # a new jitted function each time, as every arm of an experiment builds its step
    return jax.jit(lambda x: jnp.sin(x) @ jnp.cos(x).T + 3.0)
x = jnp.ones((32, 32))
build()(x)
misses = events.count("/jax/compilation_cache/cache_misses")
build()(x)
print(path, os.path.isdir(path), misses, events.count("/jax/compilation_cache/cache_hits"))
"""


def _run(env):
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


def test_a_program_built_again_loads_the_first_build_and_the_cache_goes_with_the_process():
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    path, existed, misses, hits = _run(env)
    assert existed == "True" and int(misses) >= 1 and int(hits) == 1
    assert not os.path.exists(path)  # removed at exit


def test_a_configured_cache_is_left_alone(tmp_path):
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    path, existed, _, hits = _run(env)
    assert path == str(tmp_path) and existed == "True" and int(hits) == 1
    assert any(tmp_path.iterdir())  # its entries stay
