"""Read checkpoints into our parameter tree: HF safetensors folders (float, fp8, AWQ and GPTQ ones) and GGUF files.

Both produce {our name: numpy array}, matmul weights as [in, out] and layers stacked on axis 0.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
from collections.abc import Callable
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from jaxpaged.config import ModelConfig
from jaxpaged.models.awq_gptq import PACKED_TENSORS, awq_host_quant, gptq_host_quant
from jaxpaged.models.quantize import HostQuant, gptq_zeros_minus_one
from jaxpaged.models.quantize import stack as stack_quant

# HF per-layer tensor name -> (our name, transpose?)
_HF_LAYER = {
    "input_layernorm.weight": ("input_norm", False),
    "post_attention_layernorm.weight": ("post_norm", False),
    "self_attn.q_proj.weight": ("wq", True), "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.weight": ("wk", True), "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.weight": ("wo", True), "self_attn.o_proj.bias": ("bo", False),
    "self_attn.q_norm.weight": ("q_norm", False), "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    # mixture of experts: the router (Mixtral's block_sparse_moe.gate, Qwen-MoE's mlp.gate) and Qwen2-MoE's
    # shared expert (the dense MLP's names) with its sigmoid gate; the experts themselves: `_HF_EXPERT`
    "block_sparse_moe.gate.weight": ("router", True), "mlp.gate.weight": ("router", True),
    "mlp.shared_expert.gate_proj.weight": ("w_gate", True), "mlp.shared_expert.up_proj.weight": ("w_up", True),
    "mlp.shared_expert.down_proj.weight": ("w_down", True), "mlp.shared_expert_gate.weight": ("shared_gate", True),
}
# "<prefix>.experts.<j>.<name>.weight" -> our stacked [L, X, in, out] name (Mixtral's w1/w3/w2, Qwen-MoE's)
_HF_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_NAMES = {"gate_proj": "we_gate", "w1": "we_gate", "up_proj": "we_up", "w3": "we_up", "down_proj": "we_down",
                 "w2": "we_down"}
# Gemma 3 norms every block's input and output: its post_attention_layernorm is the attention output's
_HF_SANDWICH_LAYER = {**_HF_LAYER, "post_attention_layernorm.weight": ("attn_out_norm", False),
                      "pre_feedforward_layernorm.weight": ("post_norm", False),
                      "post_feedforward_layernorm.weight": ("mlp_out_norm", False)}
_HF_GLOBAL = {"model.embed_tokens.weight": ("embed", False), "model.norm.weight": ("final_norm", False),
              "lm_head.weight": ("lm_head", True)}

_GGUF_LAYER = {
    "attn_norm.weight": ("input_norm", False), "ffn_norm.weight": ("post_norm", False),
    "attn_q.weight": ("wq", True), "attn_q.bias": ("bq", False),
    "attn_k.weight": ("wk", True), "attn_k.bias": ("bk", False),
    "attn_v.weight": ("wv", True), "attn_v.bias": ("bv", False),
    "attn_output.weight": ("wo", True), "attn_output.bias": ("bo", False),
    "attn_q_norm.weight": ("q_norm", False), "attn_k_norm.weight": ("k_norm", False),
    "ffn_gate.weight": ("w_gate", True), "ffn_up.weight": ("w_up", True), "ffn_down.weight": ("w_down", True),
}
_GGUF_GLOBAL = {"token_embd.weight": ("embed", False), "output_norm.weight": ("final_norm", False),
                "output.weight": ("lm_head", True)}


def _oriented(w, transpose: bool):
    """A loaded tensor in our [in, out] orientation (quantized ones come oriented)."""
    return w.T if transpose and not isinstance(w, HostQuant) else w


def _stack(slots: list):
    return stack_quant(slots) if isinstance(slots[0], HostQuant) else np.stack(slots)


def _stack_layers(cfg: ModelConfig, items, layer_map, global_map, layer_prefix: str) -> dict[str, np.ndarray]:
    """Collect (name, loader) pairs into our tree, stacking per-layer tensors."""
    out: dict[str, np.ndarray] = {}
    per_layer: dict[str, list] = {}
    experts: dict[str, list[list]] = {}  # our name -> [layer][expert]
    for name, load in items:
        if name in global_map:
            ours, transpose = global_map[name]
            out[ours] = _oriented(load(), transpose)
            continue
        if not name.startswith(layer_prefix):
            continue
        idx_str, _, rest = name[len(layer_prefix):].partition(".")
        if (m := _HF_EXPERT.fullmatch(rest)) and m.group(2) in _EXPERT_NAMES and cfg.num_experts:
            if int(m.group(1)) >= cfg.num_experts:
                raise ValueError(f"checkpoint has {name} but the config has {cfg.num_experts} experts")
            grid = experts.setdefault(_EXPERT_NAMES[m.group(2)],
                                      [[None] * cfg.num_experts for _ in range(cfg.num_layers)])
            grid[int(idx_str)][int(m.group(1))] = load().T
            continue
        if rest not in layer_map:
            continue
        ours, transpose = layer_map[rest]
        slots = per_layer.setdefault(ours, [None] * cfg.num_layers)
        slots[int(idx_str)] = _oriented(load(), transpose)
    for ours, slots in per_layer.items():
        if any(s is None for s in slots):
            raise ValueError(f"checkpoint lacks {ours} for some layers")
        if len({type(s) for s in slots}) != 1:
            raise ValueError(f"checkpoint has {ours} quantized in some layers and not in others")
        out["layers." + ours] = _stack(slots)
    for ours, grid in experts.items():
        if any(s is None for row in grid for s in row):
            raise ValueError(f"checkpoint lacks {ours} for some layers' experts")
        out["layers." + ours] = np.stack([np.stack(row) for row in grid])
    if cfg.tie_word_embeddings:
        out.pop("lm_head", None)
    elif "lm_head" not in out:
        raise ValueError("checkpoint has no lm_head weight but the config does not tie embeddings")
    return out


def load_safetensors_weights(folder: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Load an HF checkpoint folder's *.safetensors into our tree."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    handles = [safe_open(f, framework="flax") for f in files]  # flax: bfloat16 tensors load too
    where = {name: h for h in handles for name in h.keys()}
    packed = {name[:-len(".qweight")] for name in where if name.endswith(".qweight")}  # AWQ / GPTQ Linears
    if packed and cfg.quantization not in ("awq", "gptq"):
        raise ValueError(f"{folder} holds packed .qweight tensors (AWQ / GPTQ) but its config.json names no such "
                         f"quantization_config (quantization={cfg.quantization!r})")
    if cfg.quantization in ("awq", "gptq") and not packed:
        raise ValueError(f"quantization {cfg.quantization!r}: {folder} holds no .qweight tensors")

    def items():
        for file, h in zip(files, handles):
            names = set(h.keys())
            for name in names:
                stem, _, kind = name.rpartition(".")
                if stem in packed:
                    if kind == "qweight":
                        yield from _split_fused(cfg, stem + ".weight", _packed_loader(folder, cfg, where, stem))
                    if kind in PACKED_TENSORS:
                        continue
                if name.endswith(_FP8_SIDE):
                    if name.endswith("weight_scale_inv"):
                        raise ValueError(f"{name}: block-wise fp8 scales are not supported (per-tensor and "
                                         "per-channel weight_scale are)")
                    continue
                load = lambda h=h, name=name: np.asarray(h.get_tensor(name))  # noqa: E731
                if name + "_scale" in names and cfg.quantization == "fp8":
                    load = _fp8_loader(h, file, name)
                yield from _split_fused(cfg, name, load)

    layer_map = _HF_SANDWICH_LAYER if cfg.sandwich_norms else _HF_LAYER
    return _stack_layers(cfg, items(), layer_map, _HF_GLOBAL, "model.layers.")


def _packed_loader(folder: str, cfg: ModelConfig, where: dict, stem: str) -> Callable[[], HostQuant]:
    """An AWQ / GPTQ Linear's packed tensors (`models/awq_gptq.py`) as `HostQuant` [in, out]."""
    def load():
        def get(kind):
            name = f"{stem}.{kind}"
            return np.asarray(where[name].get_tensor(name)) if name in where else None

        qweight, qzeros, scales = get("qweight"), get("qzeros"), get("scales")
        if qzeros is None or scales is None:
            raise ValueError(f"{stem}: a packed qweight needs its qzeros and scales")
        if cfg.quantization == "awq":
            return awq_host_quant(stem, qweight, qzeros, scales)
        with open(os.path.join(folder, "config.json")) as f:
            qc = json.load(f)["quantization_config"]
        zeros_minus_one = gptq_zeros_minus_one(SimpleNamespace(quantization_config=qc))
        return gptq_host_quant(stem, qweight, qzeros, scales, get("g_idx"), int(qc.get("bits", 4)), zeros_minus_one)
    return load


_FP8_SIDE = (".weight_scale", ".input_scale", ".weight_scale_inv")  # (an fp8 checkpoint's tensors beside weights)


def _raw_tensor(file: str, name: str) -> np.ndarray:
    """A tensor read from a safetensors file's own layout (an 8-byte header size, a JSON header, the bytes):
    safetensors' numpy and flax readers have no float8 dtype."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(size))[name]
    kinds = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
    if entry["dtype"] not in kinds:
        raise ValueError(f"{name}: dtype {entry['dtype']} where an fp8 weight was expected")
    start, end = entry["data_offsets"]
    raw = np.memmap(file, np.uint8, "r", offset=8 + size + start, shape=(end - start,))
    return np.asarray(raw).view(kinds[entry["dtype"]]).reshape(entry["shape"])


def _fp8_loader(handle, file: str, name: str) -> Callable[[], HostQuant]:
    """An fp8 checkpoint's weight ([out, in] float8 e4m3) and its weight_scale (one, or one per output) as
    `HostQuant` [in, out]; the activations' input_scale is not used (weights only)."""
    def load():
        w = _raw_tensor(file, name)
        scale = np.asarray(handle.get_tensor(name + "_scale"), np.float32).reshape(-1)
        if w.ndim != 2 or w.dtype != ml_dtypes.float8_e4m3fn:
            raise ValueError(f"{name}: an fp8 checkpoint's weight must be 2-D float8_e4m3fn, got {w.dtype} {w.shape}")
        if scale.size not in (1, w.shape[0]):
            raise ValueError(f"{name}_scale has {scale.size} values for {w.shape[0]} rows: per-tensor or "
                             "per-channel scales are supported")
        return HostQuant(np.ascontiguousarray(w.T), np.broadcast_to(scale, (w.shape[0],)).reshape(1, -1).copy())
    return load


# Checkpoints with fused projections (Phi-3): their [out, in] rows split into the separate tensors' names.
_FUSED_HF = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def _split_fused(cfg: ModelConfig, name: str, load: Callable[[], np.ndarray]):
    """(name, loader) pairs for one checkpoint tensor: itself, or a fused projection's parts (q | k | v rows,
    gate | up rows), slices of the tensor read once."""
    stem, _, kind = name.rpartition(".")
    fused = next((f for f in _FUSED_HF if stem.endswith("." + f)), None)
    if fused is None:
        yield name, load
        return
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sizes = (q, kv, kv) if fused == "self_attn.qkv_proj" else (cfg.intermediate_size, cfg.intermediate_size)
    starts = np.cumsum((0,) + sizes)
    prefix = stem[:-len(fused)]
    whole = functools.cache(load)  # (read once for all its parts)

    def part_loader(lo: int, hi: int) -> Callable[[], np.ndarray]:
        def load_part():
            w = whole()
            if isinstance(w, HostQuant):
                raise ValueError(f"{name}: quantized fused projections (qkv_proj, gate_up_proj) are not supported")
            if w.shape[0] != starts[-1]:
                raise ValueError(f"{name} has {w.shape[0]} rows, the config needs {starts[-1]}")
            return w[lo:hi]
        return load_part

    for part, lo, hi in zip(_FUSED_HF[fused], starts[:-1], starts[1:]):
        yield f"{prefix}{part}.{kind}", part_loader(int(lo), int(hi))


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation ([out, in] layout) back to HF's rotate-half order."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF matmul tensors `quantization="gguf"` keeps in their blocks (`models/gguf_blocks.py`)
_GGUF_KEPT = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
              "ffn_up.weight", "ffn_down.weight", "token_embd.weight", "output.weight")


def load_gguf_weights(path: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A GGUF file's tensors in our tree: dequantized (any gguf-supported quantization) to float32, or with
    cfg.quantization "gguf" its matmul weights kept as quantized blocks (`HostQuant`)."""
    import gguf

    from jaxpaged.models.gguf_blocks import gguf_host_quant

    reader = gguf.GGUFReader(path)
    # llama.cpp permutes q/k rows only where it runs interleaved RoPE (its `llama` architecture, Mistral
    # included); Qwen2/Qwen3 files keep HF's rotate-half order (NEOX RoPE), as transformers' GGUF reader assumes
    permuted = cfg.architecture in ("LlamaForCausalLM", "MistralForCausalLM")
    keep = cfg.quantization == "gguf"

    def rows_fix(name: str):
        if permuted and name.endswith("attn_q.weight"):
            return lambda w: _unpermute_rope(w, cfg.num_heads)
        if permuted and name.endswith("attn_k.weight"):
            return lambda w: _unpermute_rope(w, cfg.num_kv_heads)
        return None

    def loader(t) -> Callable[[], np.ndarray]:
        def load():
            if keep and t.name.endswith(_GGUF_KEPT):
                quantized = gguf_host_quant(t, rows_fix(t.name))
                if quantized is not None:
                    return quantized
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            w = w.reshape(tuple(int(x) for x in reversed(t.shape)))
            if permuted and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = _unpermute_rope(w, cfg.num_heads)
            elif permuted and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = _unpermute_rope(w, cfg.num_kv_heads)
            return w
        return load

    return _stack_layers(cfg, ((t.name, loader(t)) for t in reader.tensors), _GGUF_LAYER, _GGUF_GLOBAL, "blk.")
