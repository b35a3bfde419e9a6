"""AWQ and GPTQ checkpoints' packed integer weights as codes and per-group scales (`HostQuant`), kept as they are.

Both store a Linear's weight as int32 words of 32 / bits codes (lowest bits first), with per-group float16 scales
and packed zero points; w[k, n] = (q[k, n] - z[g(k), n]) * s[g(k), n]. The layouts (AutoAWQ's WQLinear_GEMM,
AutoGPTQ's / GPTQModel's QuantLinear, as vLLM reads them):
- AWQ (4-bit, "gemm"): qweight [in, out / 8], words along the outputs, each word's 8 codes in the order
  0, 2, 4, 6, 1, 3, 5, 7 of its 8 columns; qzeros [in / group, out / 8] packed alike; scales [in / group, out].
- GPTQ (4 or 8 bits): qweight [in * bits / 32, out], words along the inputs (in order); qzeros
  [groups, out * bits / 32] along the outputs, stored minus one in the original format ("gptq"; "gptq_v2" stores
  them as they are); scales [groups, out]; g_idx [in], each input row's group: i // group, or, with act order
  (`desc_act`), a permutation's. Act-order rows are stored sorted by group with their order (`HostQuant.perm`).
Each becomes codes [in, out] (4-bit: unsigned, the zero point in the offset, -s * z; 8-bit: signed, q - 128)
with the checkpoint's float16 scales and float32 offsets (exact: the reference formula's values).
"""

from __future__ import annotations

import numpy as np

from jaxpaged.models.quantize import HostQuant

PACKED_TENSORS = ("qweight", "qzeros", "scales", "g_idx")  # a quantized Linear's tensors, beside its name
_AWQ_COLUMN_ORDER = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # column j of a word is its code _AWQ_COLUMN_ORDER[j]


def unpack(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> uint8 codes, 32 / bits a word (lowest bits first) laid out along `axis` (0 or -1)."""
    u = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(32 // bits, dtype=np.uint32) * bits
    codes = ((u[..., None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8)  # [R, C, per]
    if axis == 0:
        return codes.transpose(0, 2, 1).reshape(-1, u.shape[1])
    return codes.reshape(u.shape[0], -1)


def _host_quant(codes: np.ndarray, zeros: np.ndarray, scales: np.ndarray, bits: int,
                perm: np.ndarray | None = None) -> HostQuant:
    """(q - z) * s as `HostQuant`: codes [K, N] unsigned, zeros / scales [G, N]."""
    s = np.asarray(scales)
    offset = -s.astype(np.float32) * zeros.astype(np.float32)
    if bits == 8:  # (signed codes: (q - 128) * s + (128 - z) * s)
        return HostQuant((codes.astype(np.int16) - 128).astype(np.int8), s, offset + 128 * s.astype(np.float32), 8,
                         perm)
    return HostQuant(codes, s, offset, bits, perm)


def _check(name: str, codes: np.ndarray, scales: np.ndarray) -> None:
    if scales.ndim != 2 or scales.shape[1] != codes.shape[1] or codes.shape[0] % scales.shape[0]:
        raise ValueError(f"{name}: scales {scales.shape} do not group a [{codes.shape[0]}, {codes.shape[1]}] "
                         "weight")


def awq_host_quant(name: str, qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray) -> HostQuant:
    """An AWQ Linear ("gemm" layout, 4-bit) as `HostQuant` [in, out]."""
    def columns(words):
        c = unpack(words, 4, -1)
        return c.reshape(c.shape[0], -1, 8)[..., _AWQ_COLUMN_ORDER].reshape(c.shape)

    codes, zeros = columns(qweight), columns(qzeros)
    _check(name, codes, scales)
    return _host_quant(codes, zeros, scales, 4)


def gptq_host_quant(name: str, qweight: np.ndarray, qzeros: np.ndarray, scales: np.ndarray,
                    g_idx: np.ndarray | None, bits: int, zeros_minus_one: bool) -> HostQuant:
    """A GPTQ Linear as `HostQuant` [in, out]: rows sorted by group (with their order) where g_idx is not in
    order (act order)."""
    codes = unpack(qweight, bits, 0)
    zeros = unpack(qzeros, bits, -1)[:, :codes.shape[1]].astype(np.int32) + (1 if zeros_minus_one else 0)
    _check(name, codes, scales)
    k, groups = codes.shape[0], scales.shape[0]
    if g_idx is None or np.array_equal(g_idx, np.arange(k) // (k // groups)):
        return _host_quant(codes, zeros, scales, bits)
    g_idx = np.asarray(g_idx, np.int64)
    if g_idx.shape != (k,) or g_idx.min() < 0 or g_idx.max() >= groups or not (
            np.bincount(g_idx, minlength=groups) == k // groups).all():
        raise ValueError(f"{name}: g_idx does not give each of the {groups} groups {k // groups} rows")
    perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    return _host_quant(codes[perm], zeros, scales, bits, perm)
