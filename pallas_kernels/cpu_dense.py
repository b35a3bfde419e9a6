"""Dense layers on CPUs with weights packed once at load: the C++ call in `cpu/packed_dense.cc` as JAX functions.

XLA:CPU's dot repacks its weight operand on every call and runs the few-row products of decode and short-prompt
steps well below its large-matrix rate. `pack` lays a [K, N] float32 weight out as column panels [N / panel, K,
panel] (panel: two vector registers of this CPU, 32 floats with AVX-512, else 16) once, when the model loads;
`packed_dense(x, wp)` is then x @ w read panel by panel. Same values as `x @ w` up to float32 summation order
(tested against it). `rows` (a traced count) multiplies only x's first rows and zeros the rest: a step padded to
its token bucket then pays for its tokens, as if run at its exact size, with no compile per size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_build

TARGET = "jaxpaged_packed_dense"


@functools.cache
def panel() -> int:
    """Columns per packed panel on this machine, or 0 where the call cannot be built (see the log)."""
    if not cpu_build.register("packed_dense", "JaxpagedPackedDense", TARGET):
        return 0
    return int(cpu_build.load("packed_dense").JaxpagedPackedDensePanel())


def can_pack(w: np.ndarray) -> bool:
    """Whether `pack` takes this weight: float32 [K, N] with N a multiple of the panel width, on a CPU backend."""
    return (jax.default_backend() == "cpu" and w.ndim == 2 and np.dtype(w.dtype) == np.float32
            and panel() > 0 and w.shape[1] % panel() == 0)


def pack(w: np.ndarray, width: int | None = None) -> np.ndarray:
    """[K, N] -> [N / panel, K, panel]: panel p holds columns p * panel ... (p + 1) * panel - 1, row by row
    (width: another build's panel instead of this machine's)."""
    k, n = w.shape
    p = width or panel()
    return np.ascontiguousarray(np.asarray(w).reshape(k, n // p, p).transpose(1, 0, 2))


def unpack(wp: np.ndarray) -> np.ndarray:
    """`pack`'s inverse: [N / panel, K, panel] -> [K, N]."""
    n_panels, k, p = wp.shape
    return np.ascontiguousarray(np.asarray(wp).transpose(1, 0, 2).reshape(k, n_panels * p))


def packed_dense(x: Float[Array, "M K"], wp: Float[Array, "P K panel"],
                 rows: Int[Array, ""] | int | None = None) -> Float[Array, "M N"]:
    """x @ w for w packed by `pack` (N = P * panel), in float32. rows: only x's first `rows` rows (of the
    flattened leading axes) are multiplied, the others' outputs are zeros (None: all of them)."""
    n_panels, k, p = wp.shape
    if p != panel() or x.shape[-1] != k:
        raise ValueError(f"packed_dense: x {x.shape} and packed weight {wp.shape} (panel {panel()}) do not match")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    m = jnp.asarray(x2.shape[0] if rows is None else rows, jnp.int32)
    out = jax.ShapeDtypeStruct((x2.shape[0], n_panels * p), jnp.float32)
    y = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(x2, wp, m)
    return y.reshape(*lead, n_panels * p)
