"""A GGUF tensor's quantized blocks as codes and per-block scales (`HostQuant`), without dequantizing them.

ggml stores a matrix as rows of its first dimension (ne0: the input features), each row a run of blocks; a block
holds 32 (or 256) consecutive input features of one output. The layouts (llama.cpp's ggml-common.h):
- Q8_0: f16 d, then 32 int8 codes; w = d * q.
- Q4_0: f16 d, then 16 bytes: byte j's low nibble is code j, its high nibble code j + 16; w = d * (q - 8).
- Q4_1: f16 d, f16 m, then Q4_0's 16 bytes; w = d * q + m.
- Q4_K: 256 features in 8 sub-blocks of 32: f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and mins, then
  128 bytes; byte 32c + j holds code j of sub-block 2c (low nibble) and of sub-block 2c + 1 (high nibble);
  w = d * scale_s * q - dmin * min_s.
Each becomes codes [out, in] with a scale (and an offset) per output and block of 32 inputs: Q4_0's `- 8` and
Q4_1's / Q4_K's mins are the offset. Other types are dequantized by gguf and requantized to int8 in blocks of 32.
"""

from __future__ import annotations

import logging

import numpy as np

from jaxpaged.models.quantize import HostQuant, quantize_int8

logger = logging.getLogger(__name__)

BLOCK = 32


def _f16(raw: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block, [..., 1] (kept float16: the scales travel at the file's size)."""
    return raw[..., start:start + 2].copy().view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 codes: low nibbles first, then high nibbles (Q4_0 / Q4_1 order)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q8_0(raw):
    d = _f16(raw, 0)
    return raw[..., 2:].copy().view(np.int8), d, None


def _q4_0(raw):
    d = _f16(raw, 0)
    return _nibbles(raw[..., 2:]), d, d * np.float16(-8)  # (exact in float16)


def _q4_1(raw):
    d, m = _f16(raw, 0), _f16(raw, 2)
    return _nibbles(raw[..., 4:]), d, m


def _q4_k(raw):
    """[..., 144] super-blocks -> codes [..., 8, 32] and scales, offsets [..., 8, 1]."""
    d, dmin = _f16(raw, 0).astype(np.float32), _f16(raw, 2).astype(np.float32)
    s = raw[..., 4:16].astype(np.uint8)
    low, high = s[..., 0:4], s[..., 4:8]
    tail = s[..., 8:12]
    # sub-blocks 0-3: 6 bits of bytes 0-3 (scale) and 4-7 (min); 4-7: tail nibbles, topped by bytes' 2 high bits
    scales = np.concatenate([low & 63, (tail & 15) | ((low >> 6) << 4)], axis=-1).astype(np.float32)
    mins = np.concatenate([high & 63, (tail >> 4) | ((high >> 6) << 4)], axis=-1).astype(np.float32)
    qs = raw[..., 16:].reshape(*raw.shape[:-1], 4, 32)
    codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*raw.shape[:-1], 8, 32)
    return codes, (d * scales)[..., None], (-dmin * mins)[..., None]


# ggml type name -> (bytes per block, features per block, decoder, bits)
_KEPT = {"Q8_0": (34, 32, _q8_0, 8), "Q4_0": (18, 32, _q4_0, 4), "Q4_1": (20, 32, _q4_1, 4),
         "Q4_K": (144, 256, _q4_k, 4)}


def kept_types() -> tuple[str, ...]:
    return tuple(_KEPT)


def gguf_host_quant(tensor, rows_fix=None) -> HostQuant | None:
    """A 2-D quantized GGUF tensor as `HostQuant` [in, out] (its blocks' codes and scales as they are, or, for a
    type not in `_KEPT`, its values requantized to int8 in blocks of 32); None for float tensors.
    rows_fix: applied to every [out, ...] array before the transpose (llama.cpp's q/k row permutation undone)."""
    import gguf

    kind = tensor.tensor_type.name
    if kind in ("F32", "F16", "BF16", "F64") or len(tensor.shape) != 2:
        return None
    n_in, n_out = (int(x) for x in tensor.shape)
    fix = rows_fix or (lambda a: a)
    if kind not in _KEPT or n_in % BLOCK:
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(n_out, n_in)
        if n_in % BLOCK:
            return quantize_int8(fix(w).T)
        logger.info("GGUF %s: %s blocks requantized to int8 in blocks of %d", tensor.name, kind, BLOCK)
        return quantize_int8(fix(w).T, n_in // BLOCK)
    size, per, decode, bits = _KEPT[kind]
    raw = np.asarray(tensor.data).view(np.uint8).reshape(n_out, n_in // per, size)
    codes, scale, offset = decode(raw)  # codes [out, blocks(, 8), 32]; scale, offset [out, blocks(, 8), 1]
    codes = codes.reshape(n_out, n_in)
    scale = scale.reshape(n_out, n_in // BLOCK)
    offset = None if offset is None else offset.reshape(n_out, n_in // BLOCK)
    return HostQuant(np.ascontiguousarray(fix(codes).T), np.ascontiguousarray(fix(scale).T),
                     None if offset is None else np.ascontiguousarray(fix(offset).T), bits)
