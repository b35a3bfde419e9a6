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


def rms_norm(x: Float[Array, "T E"], weight: Float[Array, "E"], eps: float, offset: float = 0.0
             ) -> Float[Array, "T E"]:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF's Llama does); with an
    offset, scaled by (offset + weight) in float32 before the cast (Gemma's, whose weights are stored minus 1)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)
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


ACTIVATIONS = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
# transformers' hidden_act names -> ours
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def gated_mlp(x: Float[Array, "T E"], w_gate_up: Float[Array, "E 2F"], w_down: Float[Array, "F E"], *,
              shards: int = 1, rows: Int[Array, ""] | None = None, activation: str = "silu") -> Float[Array, "T E"]:
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up as one matmul, act SiLU or GELU (`ACTIVATIONS`). Its
    columns come in `shards` groups (tensor parallelism: one per device), each [gate part | up part]; one group
    is [gate | up]. rows: as `dense`'s."""
    t = x.shape[0]
    gate, up = jnp.split(dense(x, w_gate_up, rows).reshape(t, shards, -1), 2, axis=-1)  # [T, shards, F / shards]
    return dense((ACTIVATIONS[activation](gate) * up).reshape(t, -1), w_down, rows)


def moe_mlp(x: Float[Array, "T E"], router: Float[Array, "E X"], w_gate_up: Float[Array, "X E 2F"],
            w_down: Float[Array, "X F E"], *, top_k: int, normalize: bool, shards: int = 1,
            rows: Int[Array, ""] | None = None, activation: str = "silu", grouped: bool | None = None,
            round_weights: bool = False) -> Float[Array, "T E"]:
    """Mixture of experts (Mixtral, Qwen-MoE): each token's router probabilities (a float32 softmax over the X
    experts), its top_k experts' gated MLPs weighted by them (renormalized to sum 1 with `normalize`).

    grouped (the default off CPUs): the T * top_k (token, expert) pairs sorted by expert, each expert's run
    multiplied by its weights in one grouped matmul (`lax.ragged_dot`), the results added back to their tokens:
    top_k MLPs a token. Else (CPUs) every expert on every token, batched over experts, weighted by the router's
    (zero for the experts not chosen): XLA:CPU ran the grouped form 2.0-6.5x slower than that
    (`python -m jaxpaged.bench.moe_paths`, 2026-12-05: 8-256 tokens, 8-32 experts, float32; README).
    Each expert's output (in the activations' dtype, as a matmul returns it) is weighted and summed in float32,
    rounded once; round_weights: the router weights rounded to the activations' dtype first (Qwen-MoE's router
    does; Mixtral's keeps float32). w_gate_up's last axis: `shards` groups of [gate part | up part], as
    `gated_mlp`'s.
    """
    t, e = x.shape
    num_experts = router.shape[-1]
    logits = dense(x, router, rows).astype(jnp.float32)  # [T, X]
    weight, expert = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # [T, k]
    if normalize:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    if round_weights:
        weight = weight.astype(x.dtype).astype(jnp.float32)
    act = ACTIVATIONS[activation]
    if grouped is None:
        grouped = jax.default_backend() != "cpu"

    def gated(h):  # [..., 2F] in shard groups -> [..., F]
        gate, up = jnp.split(h.reshape(*h.shape[:-1], shards, -1), 2, axis=-1)
        return (act(gate) * up).reshape(*h.shape[:-1], -1)

    if not grouped:
        def batched(a, w):  # [X, T, K] x [X, K, N] -> [X, T, N], float32 accumulation
            return jax.lax.dot_general(a.astype(w.dtype), w, (((2,), (1,)), ((0,), (0,))),
                                       preferred_element_type=jnp.float32).astype(x.dtype)

        y = batched(gated(batched(jnp.broadcast_to(x, (num_experts, t, e)), w_gate_up)), w_down)  # [X, T, E]
        full = jnp.zeros((t, num_experts), jnp.float32).at[jnp.arange(t)[:, None], expert].set(weight)  # [T, X]
        return jnp.einsum("xte,tx->te", y.astype(jnp.float32), full).astype(x.dtype)
    flat = expert.reshape(-1)  # [T k]
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // top_k
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [X] pairs per expert

    def ragged(a, w):  # a @ w[expert] for each expert's run of rows, float32 accumulation
        return jax.lax.ragged_dot(a.astype(w.dtype), w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)

    y = ragged(gated(ragged(x[token], w_gate_up)), w_down)  # [T k, E]
    y = y.astype(jnp.float32) * weight.reshape(-1)[order][:, None]
    return jnp.zeros((t, e), jnp.float32).at[token].add(y).astype(x.dtype)


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
