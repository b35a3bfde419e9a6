"""Rotary angles' cos and sin on CPUs: the C++ call in `cpu/rope_angles.cc` as a JAX function.

XLA:CPU fuses `jnp.cos`/`jnp.sin` of the angles into each rotation that reads them and evaluates them per
element, head and layer through scalar libm calls (~3% of a SmolLM2 serving step); behind this opaque call the
[T, D/2] tables are computed once per step and the rotations read them. Same values as the plain-JAX
`cos(positions * inv_freq)` up to float32 rounding (tested).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_build

TARGET = "jaxpaged_rope_angles"


@functools.cache
def available() -> bool:
    """True once the call is built and registered with XLA for the CPU platform."""
    return cpu_build.register("rope_angles", "JaxpagedRopeAngles", TARGET)


def rope_angles_cpu(positions: Int[Array, "T"], inv_freq: Float[Array, "H"]
                    ) -> tuple[Float[Array, "T H"], Float[Array, "T H"]]:
    """cos and sin of float32(positions[t]) * inv_freq[i], each [T, H] float32."""
    if not available():
        raise RuntimeError("the CPU rope kernel could not be built on this machine (see the log)")
    t, h = positions.shape[0], inv_freq.shape[0]
    out = jax.ShapeDtypeStruct((t, h), jnp.float32)
    return tuple(jax.ffi.ffi_call(TARGET, (out, out))(positions.astype(jnp.int32), inv_freq.astype(jnp.float32)))
