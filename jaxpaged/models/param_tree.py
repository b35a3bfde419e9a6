"""The Llama-family parameter tree: the names and shapes the loaders produce (`param_shapes`), and the tree
`forward` takes, built from them (`model_params`): q/k/v and gate/up fused, layers stacked or one dict each,
placed on a mesh's shards, packed for the CPU dense calls, or kept quantized (`models/quantize.py`)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.multihost import place
from jaxpaged.distributed.tensor_parallel import mesh_size, param_sharding
from jaxpaged.layers.dense import cpu_layout
from jaxpaged.models.quantize import (
    QUANTIZED_WEIGHTS,
    HostQuant,
    bf16_layout,
    device_weight,
    panels,
    quantize,
    quantize_int8,
    vocab_groups,
)
from jaxpaged.models.quantize import concat as quant_concat

# Our parameter tree: name -> shape, for L layers; HF/GGUF loaders produce exactly these names.
LAYER_PARAMS = ("input_norm", "wq", "wk", "wv", "wo", "post_norm", "w_gate", "w_up", "w_down")
QKV_BIAS_PARAMS = ("bq", "bk", "bv")


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter the model expects, keyed by our names."""
    E, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "embed": (V, E), "final_norm": (E,),
        "layers.input_norm": (L, E), "layers.post_norm": (L, E),
        "layers.wq": (L, E, q), "layers.wk": (L, E, kv), "layers.wv": (L, E, kv), "layers.wo": (L, q, E),
    }
    if cfg.dense_mlp:
        shapes.update({"layers.w_gate": (L, E, F), "layers.w_up": (L, E, F), "layers.w_down": (L, F, E)})
    if cfg.num_experts:  # (router [E, X]; expert weights [X, in, out])
        X, Fe = cfg.num_experts, cfg.moe_intermediate_size
        shapes.update({"layers.router": (L, E, X), "layers.we_gate": (L, X, E, Fe), "layers.we_up": (L, X, E, Fe),
                       "layers.we_down": (L, X, Fe, E)})
    if cfg.shared_expert:
        shapes["layers.shared_gate"] = (L, E, 1)
    if cfg.sandwich_norms:
        shapes.update({"layers.attn_out_norm": (L, E), "layers.mlp_out_norm": (L, E)})
    if cfg.qkv_bias:
        shapes.update({"layers.bq": (L, q), "layers.bk": (L, kv), "layers.bv": (L, kv)})
    if cfg.o_bias:
        shapes["layers.bo"] = (L, E)
    if cfg.qk_norm:
        shapes.update({"layers.q_norm": (L, cfg.head_dim), "layers.k_norm": (L, cfg.head_dim)})
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, V)
    return shapes


FUSED = {"wqkv": ("wq", "wk", "wv"), "bqkv": ("bq", "bk", "bv"), "w_gate_up": ("w_gate", "w_up"),
         "we_gate_up": ("we_gate", "we_up")}


def _fuse(parts: list[np.ndarray], shards: int) -> np.ndarray:
    """Concatenate `parts` on their last axis in `shards` groups: [p0 part 0 | p1 part 0 | ... | p0 part 1 | ...],
    so a column-parallel split into `shards` gives each device whole pieces of every part. Quantized parts
    (`HostQuant`) alike, their codes and scales together."""
    if any(isinstance(p, HostQuant) for p in parts):  # (a float part beside quantized ones: int8, in their groups)
        groups = min(p.scale.shape[-2] for p in parts if isinstance(p, HostQuant))
        parts = [p if isinstance(p, HostQuant) else quantize_int8(p, groups) for p in parts]

        def piece(p: HostQuant, s: int) -> HostQuant:
            n = p.shape[-1] // shards
            return p.map_columns(lambda a: a[..., s * n:(s + 1) * n])

        return quant_concat([piece(p, s) for s in range(shards) for p in parts])
    grouped = [np.asarray(p).reshape(*p.shape[:-1], shards, p.shape[-1] // shards) for p in parts]
    fused = np.concatenate(grouped, axis=-1)
    return fused.reshape(*fused.shape[:-2], -1)


# Tied float32 tables up to this size get an [E, V] copy for the LM head on CPU (SmolLM2-135M: 113 MB, 360M:
# 189 MB); bigger models, where the head is a smaller share of a step, keep their memory.
TIED_HEAD_COPY_MAX_BYTES = 256 << 20


# The weights `packed=True` lays out for the CPU dense call (`pallas_kernels.cpu_dense`).
PACKED_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")


# Quantized weights the CPU may run through oneDNN's integer GEMM (`layers.quant.Int8Panels`: inputs quantized
# per row), with $JAXPAGED_CPU_INT8_GEMM=1; the others' inputs (after the input norm, into the down projection,
# into the LM head) have outlier dims that one scale a row flattens (SmolLM2's logits off by 10-20). Off by
# default: even on these two, SmolLM2's greedy agreement with float32 fell to 0.42 (bf16 alone: 0.89) for 1.43x
# float32's throughput, below bf16's 1.64x (docs/benchmarks/quantization.md). Otherwise packed CPU weights run
# oneDNN's bf16 GEMM, dequantized at load; the quantized forms stay in memory on the plain-JAX paths.
INTEGER_GEMM_WEIGHTS = ("wo", "w_gate_up")
INT8_GEMM_ENV = "JAXPAGED_CPU_INT8_GEMM"


LAYOUT_ENV = "JAXPAGED_LAYER_LAYOUT"  # "per_layer" or "stacked": overrides the backend's default layout


def default_per_layer() -> bool:
    """Whether layers default to one weight dict each (CPU) or stacked under `lax.scan` (elsewhere), unless
    $JAXPAGED_LAYER_LAYOUT names one: on a GPU the scan is an XLA while loop, one command buffer per layer and
    its carries copied (an H200 profile, 2026-12-04), which the per-layer loop may avoid; there to time both."""
    layout = os.environ.get(LAYOUT_ENV, "")
    if layout not in ("", "per_layer", "stacked"):
        raise ValueError(f"${LAYOUT_ENV} must be 'per_layer' or 'stacked', got {layout!r}")
    return layout == "per_layer" if layout else jax.default_backend() == "cpu"


def resolve_per_layer(cfg: ModelConfig, per_layer: bool | None) -> bool:
    """The layout to use: `per_layer` as asked (None: `default_per_layer()`), but per layer whatever the default
    for layers of different kinds (Gemma 3's sliding and full ones: one scan body cannot hold both)."""
    if not cfg.uniform_layers:
        if per_layer is False:
            raise ValueError("layers of different kinds (sliding and full attention) need the per-layer layout")
        return True
    return default_per_layer() if per_layer is None else per_layer


def model_params(cfg: ModelConfig, weights: dict[str, np.ndarray], *, per_layer: bool | None = None,
                 mesh=None, packed: bool = False) -> dict:
    """Our parameter tree from the loaders' flat names ("layers.wq" -> params["layers"]["wq"]), in cfg.dtype.

    q/k/v (and their biases) and gate/up are concatenated on their output axis into "wqkv", "bqkv" and
    "w_gate_up" (in one group per device of `mesh`: `_fuse`). per_layer=False: params["layers"] is a dict of
    [L, ...] arrays; True: a list of L dicts; None: `default_per_layer()` (per layer on CPU, stacked elsewhere;
    see the module docstring). mesh: tensor parallelism; each array goes from the host straight to its shards
    (`tensor_parallel.param_sharding`), so no device ever holds a whole model. packed: per-layer weights are
    laid out for a CPU dense call (`layers.dense.cpu_layout`; `dense` and `compute_logits` take either form):
    float32 ones (and a float32 [E, V] LM head) as column panels [N / panel, K, panel], so XLA:CPU does not
    repack them; bf16 ones as [1, K, N] for oneDNN's bf16 GEMM, where it is installed (the bf16 LM head keeps
    XLA's dot, as fast there).
    """
    per_layer = resolve_per_layer(cfg, per_layer)
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"weights are missing {missing}")
    for name, shape in expected.items():
        got = tuple(weights[name].shape)
        if name == "embed" and isinstance(weights[name], HostQuant):
            got = got[::-1]  # (a quantized table is kept as the LM head's [E, V])
        if got != shape:
            raise ValueError(f"weight {name} has shape {got}, expected {shape}")
    dtype = jnp.dtype(cfg.dtype)
    method = cfg.quantization

    def put(name: str, x, stacked: bool = False):
        if isinstance(x, HostQuant):
            return put_quantized(name, x, stacked)
        if mesh is None:
            return jnp.asarray(x, dtype)
        x = np.asarray(x)
        return place(x if x.dtype == dtype else x.astype(dtype), param_sharding(mesh, name, x.shape, stacked))

    def put_quantized(name: str, h: HostQuant, stacked: bool):
        """Codes, scales and offsets placed as the weight would be (an axis that does not divide replicated);
        the row order (`perm`) replicated. A quantized table is the LM head's [E, V]."""
        if mesh is None:
            return device_weight(h)
        spec = param_sharding(mesh, "lm_head" if name == "embed" else name, h.shape, stacked).spec
        tp = mesh_size(mesh)

        def to_device(a: np.ndarray):
            if a.ndim != len(h.shape):
                return place(a, NamedSharding(mesh, P()))
            axes = tuple(spec) + (None,) * (a.ndim - len(spec))
            axes = [ax if ax is None or a.shape[i] % tp == 0 else None for i, ax in enumerate(axes)]
            return place(a, NamedSharding(mesh, P(*axes)))
        return device_weight(h, to_device)

    layers = {name[len("layers."):]: weights[name] for name in expected if name.startswith("layers.")}
    for fused, parts in FUSED.items():
        if all(p in layers for p in parts):
            layers[fused] = _fuse([layers.pop(p) for p in parts], mesh_size(mesh))
    packed = packed and per_layer and mesh is None and dtype in (jnp.float32, jnp.bfloat16)
    top = {name: weights[name] for name in expected if not name.startswith("layers.")}
    from_checkpoint = any(isinstance(w, HostQuant) for w in weights.values())
    if method in ("int8", "fp8") and not from_checkpoint:  # (quantized at load; an fp8 checkpoint's come so)
        for name in QUANTIZED_WEIGHTS:
            group = layers if name in layers else top
            if name in group and not isinstance(group[name], HostQuant):
                w = np.asarray(group[name], np.float32)
                w = w.T if name == "embed" else w
                vocab = name in ("embed", "lm_head")
                group[name] = quantize(w, method, vocab_groups(w.shape[0]) if vocab else 1)

    def put_layer(name: str, x):  # (laid out for a CPU dense call where one takes it, else as `put`)
        integer = os.environ.get(INT8_GEMM_ENV) == "1" and name in INTEGER_GEMM_WEIGHTS
        if isinstance(x, HostQuant) and packed and integer and (p := panels(x)) is not None:
            return p
        if isinstance(x, HostQuant) and packed and name in PACKED_WEIGHTS and (b := bf16_layout(x)) is not None:
            return b
        if isinstance(x, HostQuant):
            return put_quantized(name, x, False)
        laid_out = None
        if packed and name in PACKED_WEIGHTS and (name != "lm_head" or dtype == jnp.float32):
            laid_out = cpu_layout(x, dtype)
        return put(name, x) if laid_out is None else laid_out

    params: dict = {name: (put_layer if name in ("lm_head", "embed") else put)(name, w) for name, w in top.items()}
    if isinstance(top["embed"], HostQuant):
        if cfg.tie_word_embeddings and packed:  # (an LM head for the CPU call beside the table's codes)
            if (head := bf16_layout(top["embed"])) is not None:
                params["lm_head"] = head
    elif (cfg.tie_word_embeddings and per_layer and mesh is None and dtype == jnp.float32
            and weights["embed"].size * 4 <= TIED_HEAD_COPY_MAX_BYTES):
        # A float32 LM head of its own, [E, V]: XLA:CPU's dot transposes a tied [V, E] table every call
        # (docs/benchmarks/design-choices.md). bf16's tied dot is faster as is.
        params["lm_head"] = put_layer("lm_head", np.ascontiguousarray(np.asarray(weights["embed"]).T))
    if per_layer:
        params["layers"] = [{k: put_layer(k, v[i]) for k, v in layers.items()} for i in range(cfg.num_layers)]
    else:
        params["layers"] = {k: put(k, v, stacked=True) for k, v in layers.items()}
    return params

