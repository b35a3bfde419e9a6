"""Quantized weights on the host, between a checkpoint and the device: `HostQuant`, what the loaders return for a
matmul weight kept quantized (a GGUF block type, an fp8 checkpoint's tensor) and what `--quantization int8|fp8`
makes of a float one; and their device forms (`layers/quant.py`).

The methods (`QUANTIZATIONS`):
- "int8": weight-only int8, one symmetric scale per output channel (max |w| / 127), quantized at load.
- "fp8": float8 e4m3 codes, one scale per output channel (max |w| / 448), quantized at load; or an fp8
  checkpoint's own codes and scales (per tensor or per channel), detected from its `quantization_config`.
- "gguf": a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K blocks kept as they are (`models/gguf_blocks.py`; other block
  types requantized to int8 in blocks of 32 rows).
- "awq", "gptq": an AWQ (4-bit) or GPTQ (4- or 8-bit, act order included) checkpoint's packed codes, zero points
  and group scales kept (`models/awq_gptq.py`), detected from its `quantization_config`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxpaged.config.engine_config import QUANTIZATIONS
from jaxpaged.layers.dense import cpu_layout
from jaxpaged.layers.quant import Int8Panels, QuantizedWeight, int8_panels

logger = logging.getLogger(__name__)

# the matmul weights a method quantizes (by our fused names; the embedding table too, as the LM head's [E, V])
QUANTIZED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head", "embed")
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@dataclass
class HostQuant:
    """A [..., K, N] weight as codes and per-group scales on the host: w[k, n] = code[k, n] * scale[k // g, n] +
    offset[k // g, n], g = K / G. Codes: int8 (bits 8, signed), uint8 (bits 4: unsigned, one per byte), or
    float8_e4m3fn."""

    codes: np.ndarray  # [..., K, N]
    scale: np.ndarray  # [..., G, N] float32, or float16 (a GGUF block's own)
    offset: np.ndarray | None = None  # [..., G, N] as scale; None: zero
    bits: int = 8
    perm: np.ndarray | None = None  # [..., K] int32: stored row k is the weight's row perm[k] (GPTQ act order)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    def __getitem__(self, i) -> HostQuant:
        return HostQuant(self.codes[i], self.scale[i], None if self.offset is None else self.offset[i], self.bits,
                         None if self.perm is None else self.perm[i])

    def map_columns(self, fn) -> HostQuant:
        """`fn` applied to every per-column array (codes, scale, offset) along their last axis: the output
        columns sliced, repeated or reordered alike (tensor parallelism's groups, replicated KV heads)."""
        return HostQuant(fn(self.codes), fn(self.scale), None if self.offset is None else fn(self.offset),
                         self.bits, self.perm)

    def dequantize(self) -> np.ndarray:
        """The float32 weight (the reference formula)."""
        *lead, k, n = self.codes.shape
        g = self.scale.shape[-2]
        w = self.codes.astype(np.float32).reshape(*lead, g, k // g, n) * self.scale[..., None, :].astype(np.float32)
        if self.offset is not None:
            w = w + self.offset[..., None, :].astype(np.float32)
        w = w.reshape(*lead, k, n)
        if self.perm is None:
            return w
        return np.take_along_axis(w, np.argsort(self.perm, axis=-1)[..., None], axis=-2)


def stack(parts: list[HostQuant]) -> HostQuant:
    """Per-layer weights stacked on a new leading axis."""
    perms = None
    if any(p.perm is not None for p in parts):
        perms = np.stack([np.arange(p.shape[-2], dtype=np.int32) if p.perm is None else p.perm for p in parts])
    return HostQuant(np.stack([p.codes for p in parts]), np.stack([p.scale for p in parts]),
                     _offsets(parts, np.stack), _bits(parts), perms)


def concat(parts: list[HostQuant]) -> HostQuant:
    """Weights side by side on the output axis (q | k | v), regrouped to the coarsest group size they share; parts
    whose rows are stored in different orders (GPTQ act order, `perm`) all requantized to int8 in order."""
    groups = min(p.scale.shape[-2] for p in parts)
    orders = {None if p.perm is None else p.perm.tobytes() for p in parts}
    if len(orders) > 1:
        logger.info("fused weights with different GPTQ act orders: requantized to int8 in %d groups", groups)
        parts = [_regroup(p, groups) for p in parts]
    parts = [p if p.scale.shape[-2] == groups else _regroup(p, groups) for p in parts]
    if len({(p.bits, p.codes.dtype) for p in parts}) > 1:  # (a part regrouped to int8 beside 4-bit or fp8 ones)
        parts = [p if p.codes.dtype == np.int8 and p.bits == 8 else _regroup(p, groups) for p in parts]
    cat = lambda xs: np.concatenate(xs, axis=-1)  # noqa: E731
    return HostQuant(cat([p.codes for p in parts]), cat([p.scale for p in parts]), _offsets(parts, cat),
                     _bits(parts), parts[0].perm)


def _bits(parts: list[HostQuant]) -> int:
    if len({(p.bits, p.codes.dtype) for p in parts}) != 1:
        raise ValueError("weights fused into one matmul (q/k/v, gate/up) must share a quantization; got "
                         f"{sorted({(p.bits, str(p.codes.dtype)) for p in parts})}")
    return parts[0].bits


def _offsets(parts: list[HostQuant], join) -> np.ndarray | None:
    if all(p.offset is None for p in parts):
        return None
    dtype = np.result_type(*(p.offset for p in parts if p.offset is not None))
    return join([np.zeros(p.scale.shape, dtype) if p.offset is None else p.offset.astype(dtype) for p in parts])


def _regroup(p: HostQuant, groups: int) -> HostQuant:
    """`p` requantized to int8 in `groups` groups (where fused parts' group sizes differ)."""
    return quantize_int8(p.dequantize(), groups)


def quantize_int8(w: np.ndarray, groups: int = 1) -> HostQuant:
    """Symmetric int8 codes, one scale per output channel and group of K / groups rows."""
    w = np.asarray(w, np.float32)
    *lead, k, n = w.shape
    blocks = w.reshape(*lead, groups, k // groups, n)
    scale = np.max(np.abs(blocks), axis=-2) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    codes = np.clip(np.rint(blocks / scale[..., None, :]), -127, 127).astype(np.int8)
    return HostQuant(codes.reshape(*lead, k, n), scale)


def quantize_fp8(w: np.ndarray) -> HostQuant:
    """float8 e4m3 codes, one scale per output channel (max |w| / 448)."""
    w = np.asarray(w, np.float32)
    scale = np.max(np.abs(w), axis=-2, keepdims=True) / FP8_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return HostQuant((w / scale).astype(ml_dtypes.float8_e4m3fn), scale)


def quantize(w: np.ndarray, method: str, groups: int = 1) -> HostQuant:
    """A float [..., K, N] weight quantized at load by `method` ("int8": in `groups` groups of rows; "fp8")."""
    if method == "int8":
        return quantize_int8(w, groups)
    if method == "fp8":
        return quantize_fp8(w)
    raise ValueError(f"quantization {method!r} does not quantize float weights at load (int8 or fp8 do)")


def device_weight(h: HostQuant, to_device=jnp.asarray) -> QuantizedWeight:
    """The device form: 4-bit codes packed two a byte (rows 2i, 2i + 1 in the low, high nibble) where K is even.
    to_device: numpy array -> device array (a mesh's placement; default: the default device)."""
    codes, bits = h.codes, h.bits
    if bits == 4 and codes.shape[-2] % 2:
        bits, codes = 8, codes.astype(np.int8)  # (an odd K: one code a byte)
    elif bits == 4:
        pairs = codes.reshape(*codes.shape[:-2], codes.shape[-2] // 2, 2, codes.shape[-1]).astype(np.uint8)
        codes = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
    def floats(a):  # (float16 kept: GGUF's and AWQ / GPTQ's scales, exact at half the bytes)
        return to_device(np.asarray(a, a.dtype if a.dtype == np.float16 else np.float32))

    offset = None if h.offset is None else floats(h.offset)
    perm = None if h.perm is None else to_device(np.asarray(h.perm, np.int32))
    return QuantizedWeight(to_device(np.asarray(codes)), floats(h.scale), offset, bits, perm)


def vocab_groups(k: int) -> int:
    """Groups of 32 rows for an int8 vocabulary table ([E, V]: the LM head, the embedding): one scale per token
    row is too coarse where a few of its dims are outliers (SmolLM2's: logits off by 10 at one scale a token)."""
    return k // 32 if k % 32 == 0 else 1


def bf16_layout(h: HostQuant) -> jax.Array | None:
    """A quantized [K, N] weight dequantized into oneDNN's bf16 layout for the CPU's packed dense call (the CPU
    default for quantized weights: docs/quantization.md), or None where that call is unavailable."""
    return cpu_layout(h.dequantize(), jnp.bfloat16)


def panels(h: HostQuant | np.ndarray) -> Int8Panels | None:
    """A [K, N] weight (quantized, or float) as per-channel int8 oneDNN panels, or None where oneDNN's int8 call
    is unavailable. Per-channel int8 codes are kept exactly; other forms are dequantized and requantized."""
    if (isinstance(h, HostQuant) and h.codes.dtype == np.int8 and h.scale.shape[-2] == 1 and h.offset is None
            and h.perm is None):
        q = h
    else:
        q = quantize_int8(h.dequantize() if isinstance(h, HostQuant) else h)
    return int8_panels(q.codes, q.scale[0])


def _settings(qc) -> dict:
    if isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)


def checkpoint_quantization(hf_config) -> str | None:
    """The method a checkpoint's `quantization_config` names, as ours ("fp8", "awq", "gptq"), or None;
    ValueError, naming the setting, for one not served."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = _settings(qc)
    method = qc.get("quant_method") or "?"
    method = str(getattr(method, "value", method)).lower()
    if method == "fp8":
        return "fp8"
    if method == "awq":
        bits, version = qc.get("bits", qc.get("w_bit", 4)), str(qc.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm" or qc.get("zero_point", True) is not True:
            raise ValueError(f"quantization_config: AWQ checkpoints with bits 4, version 'gemm' and zero_point are "
                             f"served; this one has bits {bits}, version {version!r}, zero_point "
                             f"{qc.get('zero_point', True)}")
        return "awq"
    if method == "gptq":
        bits, fmt = qc.get("bits", 4), str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
        if bits not in (4, 8) or fmt not in GPTQ_FORMATS:
            raise ValueError(f"quantization_config: GPTQ checkpoints with bits 4 or 8 in checkpoint_format "
                             f"{' or '.join(GPTQ_FORMATS)} are served; this one has bits {bits}, {fmt!r}")
        return "gptq"
    raise ValueError(f"the checkpoint's quantization_config.quant_method {method!r} is not supported (served: fp8, "
                     "AWQ and GPTQ checkpoints, GGUF files with --quantization gguf, and float ones quantized at "
                     "load with --quantization int8 or fp8; docs/quantization.md)")


GPTQ_FORMATS = ("gptq", "gptq_v2")  # the original (zero points stored minus one) and GPTQModel's v2


def gptq_zeros_minus_one(hf_config) -> bool:
    """Whether a GPTQ checkpoint stores its zero points minus one (the original format)."""
    qc = _settings(hf_config.quantization_config)
    return str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower() == "gptq"


def resolve_quantization(requested: str | None, hf_config, gguf_file: bool) -> str | None:
    """The method a model loads with: `requested` (the --quantization flag), else the checkpoint's own; ValueError
    naming the flag where they conflict."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {requested!r}")
    if requested == "gguf" and not gguf_file:
        raise ValueError("quantization='gguf' keeps a GGUF file's blocks; the model is not a .gguf file")
    found = None if gguf_file else checkpoint_quantization(hf_config)
    if found is not None and requested not in (None, found):
        raise ValueError(f"quantization={requested!r}, but the checkpoint is quantized as {found!r}")
    if requested in CHECKPOINT_ONLY and found != requested:
        raise ValueError(f"quantization={requested!r} loads a checkpoint quantized so (its quantization_config); "
                         "this one is not")
    return requested or found


CHECKPOINT_ONLY = ("awq", "gptq")  # methods only a checkpoint's own weights give


def weight_bytes(params) -> int:
    """Bytes of a parameter tree's arrays (quantized forms count their codes and scales)."""
    return sum(x.nbytes for x in jax.tree.leaves(params))
