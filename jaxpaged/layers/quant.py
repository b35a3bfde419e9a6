"""Matmul weights kept quantized in device memory, and the dots that read them.

Two forms (both pytrees, so they sit in the parameter tree beside plain arrays, go through `jit`, `lax.scan` and
nnx like them, and count their true bytes where the KV pool is sized):

- `QuantizedWeight`: integer or fp8 codes with a float32 scale, and an offset for affine formats, per group of
  rows: w[k, n] = code[k, n] * scale[k // g, n] + offset[k // g, n], g = K / G. Per-channel int8 and fp8 (G = 1),
  GGUF's 32-row blocks and AWQ/GPTQ's groups are all this; a GPTQ act-order weight (`desc_act`) has its rows
  stored sorted by group, with `perm` (the rows' places in the weight) gathering the input's features to match.
  4-bit codes are two to a byte, rows 2i and 2i + 1 in the low and high nibble. `quantized_dense` dequantizes
  inside the jitted dot: where G = 1 the scale multiplies the dot's output instead (one multiply per output, not
  per weight); XLA on GPUs fuses the convert into the GEMM's operand read.
- `Int8Panels` (CPUs with oneDNN's int8 brgemm, AVX512-VNNI / AMX; only with $JAXPAGED_CPU_INT8_GEMM=1):
  per-channel int8 weights reordered once into oneDNN's layout; each call quantizes its input rows to int8 (one
  symmetric scale per row) and runs an integer GEMM. Faster than the bf16 GEMM per call, but the per-row input
  scale cost SmolLM2 its accuracy (docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_onednn


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedWeight:
    """A [..., K, N] matmul weight as codes and per-group scales (see the module docstring); leading axes (stacked
    layers) index every field alike."""

    codes: Array  # [..., K, N] int8 or float8_e4m3fn; bits 4: [..., K / 2, N] uint8, two codes a byte
    scale: Float[Array, "... G N"]  # float32, or float16 (GGUF's block scales)
    offset: Float[Array, "... G N"] | None = None  # as scale, added after it; None: zero
    bits: int = field(default=8, metadata={"static": True})
    perm: Int[Array, "... K"] | None = None  # stored row k is the weight's row perm[k]; None: in order

    @property
    def shape(self) -> tuple[int, ...]:
        """The dequantized weight's shape."""
        *lead, k, n = self.codes.shape
        return (*lead, k * 2 if self.bits == 4 else k, n)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int8Panels:
    """A [K, N] weight as per-channel int8 codes in oneDNN's packed layout (`cpu_onednn.pack_s8`) and their
    float32 scales [N]: w[k, n] = code[k, n] * scale[n]."""

    packed: Int[Array, "bytes"]
    scale: Float[Array, "N"]
    k: int = field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, int]:
        return (self.k, self.scale.shape[-1])


def int8_panels(codes, scale) -> Int8Panels | None:
    """Per-channel int8 codes [K, N] (numpy) and their scales [N] as `Int8Panels`, or None where oneDNN's int8
    GEMM is unavailable."""
    if not cpu_onednn.available():
        return None
    packed = cpu_onednn.pack_s8(codes)
    if packed is None:
        return None
    return Int8Panels(jnp.asarray(packed), jnp.asarray(scale, jnp.float32), codes.shape[0])


def is_quantized(w) -> bool:
    return isinstance(w, (QuantizedWeight, Int8Panels))


def codes_of(w: QuantizedWeight, dtype) -> Array:
    """The codes as `dtype` values, [..., K, N] (4-bit ones unpacked)."""
    c = w.codes
    if w.bits == 4:
        lo, hi = c & 15, c >> 4
        c = jnp.stack([lo, hi], axis=-2).reshape(*c.shape[:-2], c.shape[-2] * 2, c.shape[-1])
    return c.astype(dtype)


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> Array:
    """The [..., K, N] weight in `dtype`, computed in float32 and rounded once."""
    stored = stored_rows(w, dtype)
    if w.perm is None:
        return stored
    return jnp.take_along_axis(stored, jnp.argsort(w.perm, axis=-1)[..., None], axis=-2)


def stored_rows(w: QuantizedWeight, dtype=jnp.float32) -> Array:
    """The [..., K, N] weight's rows in their stored order (`perm`'s), in `dtype`."""
    c = codes_of(w, jnp.float32)
    *lead, k, n = c.shape
    groups = w.scale.shape[-2]
    c = c.reshape(*lead, groups, k // groups, n) * w.scale[..., None, :].astype(jnp.float32)
    if w.offset is not None:
        c = c + w.offset[..., None, :].astype(jnp.float32)
    return c.reshape(*lead, k, n).astype(dtype)


def quantized_dense(x: Float[Array, "T K"], w: QuantizedWeight, out_dtype=None) -> Float[Array, "T N"]:
    """x @ w in out_dtype (None: x's), accumulated in float32."""
    out_dtype = out_dtype or x.dtype
    if w.perm is not None:  # (x's features in the stored rows' order)
        x = jnp.take(x, w.perm, axis=-1)
    def dot(a, b):
        return jax.lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    if w.scale.shape[-2] == 1:  # per channel: scale (and offset) applied to the outputs
        y = dot(x, codes_of(w, x.dtype)) * w.scale[0].astype(jnp.float32)
        if w.offset is not None:
            y = y + jnp.sum(x.astype(jnp.float32), axis=-1, keepdims=True) * w.offset[0].astype(jnp.float32)
        return y.astype(out_dtype)
    return dot(x, stored_rows(w, x.dtype)).astype(out_dtype)


def quantize_rows(x: Float[Array, "T K"]) -> tuple[Int[Array, "T K"], Float[Array, "T 1"]]:
    """Each row of x as int8 codes with one symmetric float32 scale (its largest magnitude / 127)."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(xf / scale), -127, 127).astype(jnp.int8), scale


def panel_dense(x: Float[Array, "T K"], w: Int8Panels, rows: Int[Array, ""] | None = None) -> Float[Array, "T N"]:
    """x @ w through oneDNN's integer GEMM, x quantized per row; rows: as `layers.dense.dense`'s."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_rows(x.reshape(-1, k))
    y = cpu_onednn.onednn_dense_s8(xq, w.packed, w.scale.shape[-1], rows).astype(jnp.float32)
    return (y * xs * w.scale).reshape(*lead, -1).astype(x.dtype)


def embedding_rows(table, ids: Int[Array, "T"], dtype) -> Float[Array, "T E"]:
    """Token embeddings: rows of a plain [V, E] table, or columns of a quantized table kept as the LM head's
    [E, V] weight (so a tied model holds one copy)."""
    if not isinstance(table, QuantizedWeight):
        return table[ids]
    taken = QuantizedWeight(jnp.take(table.codes, ids, axis=-1), jnp.take(table.scale, ids, axis=-1),
                            None if table.offset is None else jnp.take(table.offset, ids, axis=-1), table.bits,
                            table.perm)
    return dequantize(taken, dtype).T
