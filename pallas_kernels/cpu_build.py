"""Build (once, cached) and load the CPU kernels in `pallas_kernels/cpu/`, XLA FFI custom calls written in C++.

pip installs no compiled code: the first process that asks for a CPU kernel compiles it with the system C++
compiler (`$CXX`, else `c++`/`g++`/`clang++`) against jaxlib's FFI headers, for this machine's CPU
(`-march=native`), into a cache directory (`$JAXPAGED_CACHE_DIR`, else `$XDG_CACHE_HOME/jaxpaged` or
`~/.cache/jaxpaged`), named by a hash of the source, the flags, the compiler and the CPU, and written under a
temporary name then renamed, so processes sharing the cache never load a half-written library. Without a
compiler (or if the build fails) `load` returns None and the caller falls back to plain XLA; the reason is
logged once. `JAXPAGED_CPU_KERNELS=0` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-w")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its flags (so a shared cache serves mixed machines)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def cache_dir() -> Path:
    if os.environ.get("JAXPAGED_CACHE_DIR"):
        return Path(os.environ["JAXPAGED_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxpaged"


def _build(name: str, compiler: str, extra: tuple[str, ...] = ()) -> Path:
    """extra: more compiler arguments (a library's include folder and the library to link), in the key too."""
    source = SOURCE_DIR / f"{name}.cc"
    include = jax.ffi.include_dir()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    headers = [h.read_text() for h in sorted(SOURCE_DIR.glob("*.h"))]  # (shared code the sources include)
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(FLAGS + extra), version, cpu_identity(),
                                    include, jax.__version__]).encode()).hexdigest()[:16]
    target = cache_dir() / "cpu_kernels" / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        logger.info("compiling the CPU kernel %s (once per machine; cached in %s)", name, target.parent)
        result = subprocess.run([compiler, *FLAGS, f"-I{include}", str(source), *extra, "-o", tmp],
                                capture_output=True, text=True)
        if result.returncode != 0:
            errors = [ln for ln in result.stderr.splitlines() if "error" in ln] or result.stderr.splitlines()[-5:]
            raise RuntimeError(f"{compiler} failed: " + "\n".join(errors[:10]))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load(name: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled library for `pallas_kernels/cpu/{name}.cc` (extra: as `_build`'s), or None (logged) where it
    cannot be built."""
    if os.environ.get("JAXPAGED_CPU_KERNELS", "1") == "0":
        logger.info("CPU kernels off (JAXPAGED_CPU_KERNELS=0): %s runs as plain XLA", name)
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C++ compiler found (set CXX or install g++): the CPU kernel %s falls back to plain "
                       "XLA, which is slower", name)
        return None
    try:
        return ctypes.CDLL(str(_build(name, compiler, extra)))
    except Exception as e:  # noqa: BLE001 - any build or load failure means: use the XLA path
        logger.warning("could not build the CPU kernel %s (%s): falling back to plain XLA", name, e)
        return None


def register(name: str, symbol: str, target: str) -> bool:
    """Build/load `cpu/{name}.cc` and register its FFI handler `symbol` with XLA as the CPU custom-call `target`;
    False (logged by `load`) where it cannot be built. Callers cache the answer (`functools.cache`)."""
    lib = load(name)
    if lib is None:
        return False
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True
