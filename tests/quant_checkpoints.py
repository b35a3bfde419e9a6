"""AWQ and GPTQ checkpoints written from a float HF folder, in the layouts AutoAWQ's WQLinear_GEMM and AutoGPTQ's
QuantLinear write (their packing loops, word by word, not the engine's vectorized reader), quantized by
round-to-nearest with asymmetric per-group zero points (the quantizer's search does not change the layout).
Each writer also returns the float weights the checkpoint encodes (the reference formula, (q - z) * s)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's order_map: word slot i holds column order[i] of its 8


def rtn(w: np.ndarray, group: int, bits: int, order: np.ndarray | None = None):
    """[out, in] float weights -> (codes [out, in] ints, zeros [G, out] ints, scales [G, out] float16, g_idx [in]).
    order: input rows assigned to groups in this permutation's order (GPTQ's act order, `desc_act`)."""
    out_f, in_f = w.shape
    groups = in_f // group
    g_idx = np.arange(in_f) // group
    if order is not None:
        g_idx = np.empty(in_f, np.int64)
        g_idx[order] = np.arange(in_f) // group
    top = (1 << bits) - 1
    scales = np.zeros((groups, out_f), np.float16)
    zeros = np.zeros((groups, out_f), np.int64)
    codes = np.zeros((out_f, in_f), np.int64)
    for g in range(groups):
        rows = g_idx == g
        lo, hi = np.minimum(w[:, rows].min(1), 0), np.maximum(w[:, rows].max(1), 0)
        s = np.maximum((hi - lo) / top, 1e-5).astype(np.float16)
        z = np.clip(np.round(-lo / s.astype(np.float32)), 1, top)  # (>= 1: GPTQ's original format stores z - 1)
        scales[g], zeros[g] = s, z
        codes[:, rows] = np.clip(np.round(w[:, rows] / s.astype(np.float32)[:, None]) + z[:, None], 0, top)
    return codes, zeros, scales, g_idx


def dequantized(codes, zeros, scales, g_idx) -> np.ndarray:
    """The [out, in] float32 weight (q - z) * s."""
    return ((codes - zeros[g_idx].T) * scales[g_idx].T.astype(np.float32)).astype(np.float32)


def pack_awq(codes, zeros, scales):
    """AutoAWQ's WQLinear_GEMM.from_linear packing: qweight [in, out / 8], qzeros [G, out / 8], scales [G, out]."""
    def pack_columns(ints):  # [rows, cols] -> [rows, cols / 8] int32
        out = np.zeros((ints.shape[0], ints.shape[1] // 8), np.uint32)
        for col in range(out.shape[1]):
            for i in range(8):
                out[:, col] |= ints[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << (i * 4)
        return out.view(np.int32)

    return {"qweight": pack_columns(codes.T), "qzeros": pack_columns(zeros), "scales": scales}


def pack_gptq(codes, zeros, scales, g_idx, bits: int, v2: bool):
    """AutoGPTQ's QuantLinear.pack: qweight [in * bits / 32, out] (words along the inputs), qzeros
    [G, out * bits / 32] (zeros minus one unless v2), scales [G, out], g_idx [in]."""
    per = 32 // bits
    ints = codes.T.astype(np.uint32)  # [in, out]
    qweight = np.zeros((ints.shape[0] // per, ints.shape[1]), np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= ints[row * per + j] << (bits * j)
    z = (zeros if v2 else zeros - 1).astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // per), np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= z[:, col * per + j] << (bits * j)
    return {"qweight": qweight.view(np.int32), "qzeros": qzeros.view(np.int32), "scales": scales,
            "g_idx": g_idx.astype(np.int32)}


def write_quantized_checkpoint(src: str, dst: str, method: str, *, group: int = 32, bits: int = 4,
                               act_order: bool = False, v2: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """`src`'s HF folder as an AWQ or GPTQ checkpoint at `dst` (every decoder Linear packed; embeddings, norms and
    the LM head as they were); returns {Linear weight name: the [out, in] float weight it encodes}."""
    from safetensors.torch import load_file, save_file

    rng = np.random.default_rng(seed)
    shutil.copytree(src, dst)
    [name] = [f for f in os.listdir(dst) if f.endswith(".safetensors")]
    tensors = load_file(os.path.join(dst, name))
    out, encoded, orders = {}, {}, {}
    for key, t in sorted(tensors.items()):
        if not (key.startswith("model.layers.") and key.endswith("proj.weight")):
            out[key] = t
            continue
        # act order: one permutation per layer input (GPTQ's, from the input's Hessian: q/k/v share one, gate/up)
        shared = key.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        order = orders.setdefault(shared, rng.permutation(t.shape[1])) if act_order else None
        codes, zeros, scales, g_idx = rtn(t.float().numpy(), group, bits, order)
        encoded[key] = dequantized(codes, zeros, scales, g_idx)
        packed = pack_awq(codes, zeros, scales) if method == "awq" else pack_gptq(codes, zeros, scales, g_idx,
                                                                                   bits, v2)
        stem = key[:-len(".weight")]
        out.update({f"{stem}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.items()})
    save_file(out, os.path.join(dst, name))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group,
                                         "desc_act": act_order, "sym": False,
                                         "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return encoded
