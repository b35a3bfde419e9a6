"""Building blocks of Llama-family models as pure functions of arrays."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.cpu_dense import packed_dense
from pallas_kernels.cpu_rope import rope_angles_cpu


def rms_norm(x: Float[Array, "T E"], weight: Float[Array, "E"], eps: float) -> Float[Array, "T E"]:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def dense(x: Float[Array, "T K"], w: Float[Array, "K N"] | Float[Array, "P K panel"],
          rows: Int[Array, ""] | None = None) -> Float[Array, "T N"]:
    """x @ w in x's dtype. A 3-D w is packed for the CPU dense call (`pallas_kernels.cpu_dense`), which with
    `rows` multiplies only x's first rows (the step's tokens before its padding) and zeros the rest. Narrower
    weights than activations (bf16 weights, float32 activations: the CPU form) take x rounded to w's dtype into
    a dot with float32 output, the form XLA:CPU runs on the CPU's bf16 dot instructions (twice float32's rate;
    a bf16-output dot takes a slow path)."""
    if w.ndim == 3:
        return packed_dense(x, w, rows).astype(x.dtype)
    if x.dtype == w.dtype:
        return x @ w
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def gated_mlp(x: Float[Array, "T E"], w_gate_up: Float[Array, "E 2F"], w_down: Float[Array, "F E"], *,
              shards: int = 1, rows: Int[Array, ""] | None = None) -> Float[Array, "T E"]:
    """SiLU-gated MLP: down(silu(gate(x)) * up(x)), gate and up as one matmul. Its columns come in `shards`
    groups (tensor parallelism: one per device), each [gate part | up part]; one group is [gate | up].
    rows: as `dense`'s."""
    t = x.shape[0]
    gate, up = jnp.split(dense(x, w_gate_up, rows).reshape(t, shards, -1), 2, axis=-1)  # [T, shards, F / shards]
    return dense((jax.nn.silu(gate) * up).reshape(t, -1), w_down, rows)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> np.ndarray:
    """Inverse rotary frequencies [head_dim // 2], with the rope types transformers writes."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq.astype(np.float32)
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)")


def rope_angles(positions: Int[Array, "T"], inv_freq: Float[Array, "D/2"], *, cpu_kernel: bool = False
                ) -> tuple[Float[Array, "T D/2"], Float[Array, "T D/2"]]:
    """cos and sin of each token's rotary angles, once per step for every layer's rotations. cpu_kernel: from the
    C++ call (`pallas_kernels.cpu_rope`), so XLA:CPU does not take cos/sin again inside each rotation."""
    if cpu_kernel:
        return rope_angles_cpu(positions, inv_freq)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return jnp.cos(freqs), jnp.sin(freqs)


def apply_rope(
    x: Float[Array, "T N D"], angles: tuple[Float[Array, "T D/2"], Float[Array, "T D/2"]]
) -> Float[Array, "T N D"]:
    """Rotate-half RoPE (the HF Llama convention) by `rope_angles`' cos and sin, computed in float32."""
    cos, sin = angles[0][:, None, :], angles[1][:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
