"""Rotary position embeddings: each rope type's frequencies (default, linear, llama3, yarn, longrope), the
per-step cos/sin tables and the rotation, as pure functions of arrays."""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels.cpu_rope import rope_angles_cpu

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _scaling_factor(scaling: dict[str, Any], max_position_embeddings: int) -> float:
    """yarn's / longrope's context factor: the config's, else max_position_embeddings / the original length."""
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    return float(scaling.get("factor") or max_position_embeddings / original)


def rope_attention_factor(scaling: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """What cos and sin are multiplied by (transformers' `attention_scaling`): 1 but for yarn and longrope."""
    rope_type = rope_type_of(scaling)
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _scaling_factor(scaling, max_position_embeddings)
    if rope_type == "yarn":
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        return yarn_mscale(factor)
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any], max_position_embeddings: int) -> np.ndarray:
    """YaRN: interpolated (divided by factor) below the low-frequency bound, extrapolated (as is) above the
    high one, a linear ramp between (transformers' `_compute_yarn_parameters`)."""
    original = scaling["original_max_position_embeddings"]
    factor = _scaling_factor(scaling, max_position_embeddings)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (np.arange(0, dim, 2).astype(np.float32) / dim)
    extrapolate = 1 - ramp
    return ((1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate).astype(np.float32)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, *,
                  max_position_embeddings: int = 2048, long: bool = False) -> np.ndarray:
    """Inverse rotary frequencies [head_dim // 2] (head_dim: the rotated dims), with the rope types transformers
    writes (`ROPE_TYPES`). longrope has two sets: its short factors', or with `long` its long factors'
    (positions from original_max_position_embeddings on: `rope_angles`)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq.astype(np.float32)
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling, max_position_embeddings)
    if rope_type == "longrope":
        factors = np.asarray(scaling["long_factor" if long else "short_factor"], np.float64)
        if factors.shape != (head_dim // 2,):
            raise ValueError(f"longrope factors have {factors.size} entries, expected {head_dim // 2}")
        pos_freqs = theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
        return (1.0 / (factors.astype(np.float32) * pos_freqs)).astype(np.float32)
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
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")


def rope_angles(positions: Int[Array, "T"], inv_freq: Float[Array, "D/2"], *, cpu_kernel: bool = False
                ) -> tuple[Float[Array, "T D/2"], Float[Array, "T D/2"]]:
    """cos and sin of each token's rotary angles, once per step for every layer's rotations. cpu_kernel: from the
    C++ call (`pallas_kernels.cpu_rope`), so XLA:CPU does not take cos/sin again inside each rotation."""
    if cpu_kernel:
        return rope_angles_cpu(positions, inv_freq)
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    return jnp.cos(freqs), jnp.sin(freqs)


def model_rope_angles(positions: Int[Array, "T"], rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                      max_position_embeddings: int, *, cpu_kernel: bool = False
                      ) -> tuple[Float[Array, "T R/2"], Float[Array, "T R/2"]]:
    """A model's cos and sin tables for `apply_rope`: `rope_angles` of its rope type's frequencies, times the
    type's attention factor (yarn, longrope); longrope's long factors from original_max_position_embeddings on
    (vLLM's choice per position; transformers switches a whole sequence once it is longer)."""
    inv = jnp.asarray(rope_inv_freq(rotary_dim, theta, scaling, max_position_embeddings=max_position_embeddings))
    cos, sin = rope_angles(positions, inv, cpu_kernel=cpu_kernel)
    if rope_type_of(scaling) == "longrope":
        long_inv = rope_inv_freq(rotary_dim, theta, scaling, max_position_embeddings=max_position_embeddings,
                                 long=True)
        long_cos, long_sin = rope_angles(positions, jnp.asarray(long_inv), cpu_kernel=cpu_kernel)
        far = (positions >= scaling["original_max_position_embeddings"])[:, None]
        cos, sin = jnp.where(far, long_cos, cos), jnp.where(far, long_sin, sin)
    factor = rope_attention_factor(scaling, max_position_embeddings)
    return (cos, sin) if factor == 1.0 else (cos * factor, sin * factor)


def apply_rope(
    x: Float[Array, "T N D"], angles: tuple[Float[Array, "T R/2"], Float[Array, "T R/2"]]
) -> Float[Array, "T N D"]:
    """Rotate-half RoPE (the HF Llama convention) by `rope_angles`' cos and sin, computed in float32, on the
    first R of the D dims (partial rotary: the rest pass through)."""
    cos, sin = angles[0][:, None, :], angles[1][:, None, :]
    r = 2 * cos.shape[-1]
    xf = x[..., :r].astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return out if r == x.shape[-1] else jnp.concatenate([out, x[..., r:]], axis=-1)
