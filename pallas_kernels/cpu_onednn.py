"""Dense layers with bfloat16 weights on CPUs through oneDNN's matmul with prepacked weights: the C++ call in
`cpu/onednn_dense.cc` as a JAX function.

XLA:CPU's bf16 dot reads a row-major weight on every call and runs the 8-64 rows of decode steps well below the
CPU's bf16 dot rate; oneDNN (Intel's library: the `onednn-cpu-gomp` wheel and its headers,
`onednn-devel-cpu-gomp`, dependencies on x86-64 Linux) runs weights reordered once into its blocked layout on
AVX512-BF16 / AMX, 1.2-1.6x faster on decode-sized steps (docs/benchmarks/cpu.md). `layout(w)` packs a [K, N]
weight once, at load, into a bf16 [1, K, N] array of opaque contents; `onednn_dense(x, w, rows)` is then x @ w
in float32, multiplying only x's first `rows` rows (as `cpu_dense.packed_dense`). Where the wheels or a compiler
are missing, or `JAXPAGED_ONEDNN=0`, `available()` is False (logged once) and weights keep XLA's dot.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_build

logger = logging.getLogger(__name__)

TARGET = "jaxpaged_onednn_dense"
TARGET_S8 = "jaxpaged_onednn_dense_s8"
ENV = "JAXPAGED_ONEDNN"  # "0": off
LIBRARY, HEADERS = "onednn-cpu-gomp", "onednn-devel-cpu-gomp"


def _installed_file(distribution: str, suffix: str) -> Path | None:
    """A file of an installed distribution whose path ends in `suffix`, or None."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if str(f).endswith(suffix):
            return Path(f.locate()).resolve()
    return None


def build_arguments() -> tuple[str, ...] | None:
    """The include folder and library the call builds against (from the wheels), or None where one is missing.
    The wheels' versions are among them (as a macro), so an upgrade in place rebuilds the call."""
    library = _installed_file(LIBRARY, "libdnnl.so.3")
    header = _installed_file(HEADERS, "oneapi/dnnl/dnnl.hpp")
    if library is None or header is None or not library.exists() or not header.exists():
        return None
    versions = "_".join(importlib.metadata.version(d) for d in (LIBRARY, HEADERS)).replace(".", "_")
    return (f"-I{header.parent.parent.parent}", str(library), f"-Wl,-rpath,{library.parent}",
            f"-DJAXPAGED_ONEDNN_WHEELS={versions}")


@functools.cache
def _library() -> ctypes.CDLL | None:
    if jax.default_backend() != "cpu" or os.environ.get(ENV) == "0":
        return None
    arguments = build_arguments()
    if arguments is None:
        logger.info("oneDNN not installed (pip install %s %s): bf16 weights use XLA's dot, slower at decode",
                    LIBRARY, HEADERS)
        return None
    # oneDNN's OpenMP threads sleep between calls rather than spin: spinning, they take the cores from XLA's own
    # threads running the rest of the step (bench throughput, bf16 SmolLM2: 319 tok/s passive, 306 by default,
    # 184 active). libgomp reads it once, as it loads; set only for that (a value already set is kept), so
    # processes started later (a benchmark's peer) do not inherit it.
    policy = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = policy or "PASSIVE"
    try:
        lib = cpu_build.load("onednn_dense", arguments)
    finally:
        if policy is None:
            del os.environ["OMP_WAIT_POLICY"]
    if lib is None:
        return None
    lib.JaxpagedOneDnnPackedSize.restype = ctypes.c_int64
    lib.JaxpagedOneDnnPackedSize.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.JaxpagedOneDnnPack.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_void_p]
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxpagedOneDnnDense), platform="cpu")
    jax.ffi.register_ffi_target(TARGET_S8, jax.ffi.pycapsule(lib.JaxpagedOneDnnDenseS8), platform="cpu")
    return lib


def available() -> bool:
    """Whether the call is built and registered on a CPU backend (the reason logged once if not)."""
    return _library() is not None


def pack(w: np.ndarray) -> np.ndarray | None:
    """A [K, N] weight reordered into oneDNN's bf16 layout, as a bf16 [1, K, N] numpy array (opaque contents), or
    None where the call is unavailable or the layout needs padding (the weight then keeps XLA's dot)."""
    lib = _library()
    if lib is None or w.ndim != 2:
        return None
    k, n = w.shape
    if lib.JaxpagedOneDnnPackedSize(k, n, 0) != k * n * 2:
        return None
    src = np.ascontiguousarray(np.asarray(w).astype(ml_dtypes.bfloat16))
    out = np.empty((1, k, n), ml_dtypes.bfloat16)
    if not lib.JaxpagedOneDnnPack(k, n, 0, src.ctypes.data, out.ctypes.data):
        return None
    return out


def pack_s8(q: np.ndarray) -> np.ndarray | None:
    """An int8 [K, N] weight reordered into oneDNN's int8 layout with its compensation for signed inputs, as an
    int8 [bytes] numpy array (opaque contents), or None where the call or an int8 brgemm kernel (AVX512-VNNI,
    AMX) is unavailable."""
    lib = _library()
    if lib is None or q.ndim != 2 or q.dtype != np.int8:
        return None
    k, n = q.shape
    size = lib.JaxpagedOneDnnPackedSize(k, n, 1)
    if size < k * n:
        return None
    src = np.ascontiguousarray(q)
    out = np.zeros((size,), np.int8)
    if not lib.JaxpagedOneDnnPack(k, n, 1, src.ctypes.data, out.ctypes.data):
        return None
    return out


def layout(w: np.ndarray) -> jax.Array | None:
    """`pack(w)` on the device, or None (see `pack`)."""
    packed = pack(w)
    return None if packed is None else jnp.asarray(packed)


def onednn_dense(x: Float[Array, "M K"], w: Float[Array, "1 K N"],
                 rows: Int[Array, ""] | int | None = None) -> Float[Array, "M N"]:
    """x @ w for w packed by `pack`, in float32, x rounded to bf16 first (as XLA's bf16 dot with float32 output
    takes it). rows: only x's first `rows` rows (of the flattened leading axes) are multiplied, the others'
    outputs are zeros."""
    _, k, n = w.shape
    if w.shape[0] != 1 or x.shape[-1] != k or w.dtype != jnp.bfloat16:
        raise ValueError(f"onednn_dense: x {x.shape} and weight {w.shape} {w.dtype} do not match")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.bfloat16)
    m = jnp.asarray(x2.shape[0] if rows is None else rows, jnp.int32)
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32)
    y = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x2, w, m)
    return y.reshape(*lead, n)


def onednn_dense_s8(x: Int[Array, "M K"], w: Int[Array, "bytes"], n: int,
                    rows: Int[Array, ""] | int | None = None) -> Int[Array, "M N"]:
    """x @ w in int32 for int8 x and an int8 [K, n] weight packed by `pack_s8` (exact: integer products and
    sums). rows: as `onednn_dense`'s."""
    if x.dtype != jnp.int8 or w.dtype != jnp.int8 or w.ndim != 1:
        raise ValueError(f"onednn_dense_s8: x {x.shape} {x.dtype} and weight {w.shape} {w.dtype} do not match")
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    m = jnp.asarray(x2.shape[0] if rows is None else rows, jnp.int32)
    out = jax.ShapeDtypeStruct((x2.shape[0], n), jnp.int32)
    y = jax.ffi.ffi_call(TARGET_S8, out, vmap_method="sequential")(x2, w, m)
    return y.reshape(*lead, n)
