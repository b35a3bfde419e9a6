"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM2, Gemma, Granite, Phi-3) in flax nnx, over a paged
KV pool. The families differ in `ModelConfig` fields (norm offset, activation, scales, partial rotary), not code.

Layer weights come in one of two layouts. Stacked on a leading [L] axis and run under `lax.scan`, so compile
time does not grow with depth (the GPU default). Or one dict per layer and a Python loop over them (the CPU
default): XLA:CPU copies each layer's weights out of a stacked array before its dots can read them (~540 MB a
step for SmolLM2-135M in float32, 17 ms of a 126 ms decode step), while separate arrays are read in place.
q/k/v and gate/up are fused into one matmul each. The KV pool is threaded functionally: in, updated in
place, out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxpaged.config import ModelConfig
from jaxpaged.distributed.multihost import place
from jaxpaged.distributed.tensor_parallel import (
    AXIS,
    POOL_SPEC,
    lora_sharding,
    mesh_size,
    replicate_kv_heads,
    replicated,
)
from jaxpaged.layers.attention import paged_attention, write_kv
from jaxpaged.layers.dense import dense, gated_mlp, moe_mlp, rms_norm
from jaxpaged.layers.lora import (
    a_name,
    adapter_slices,
    lora_deltas,
    lora_shapes,
    slot_axis,
    slot_gate,
    write_slot,
)
from jaxpaged.layers.quant import Int8Panels, QuantizedWeight, embedding_rows, is_quantized, quantized_dense
from jaxpaged.layers.rope import apply_rope, model_rope_angles
from jaxpaged.models.lora_adapter import LoRAAdapter, module_dims
from jaxpaged.models.param_tree import (  # noqa: F401  (LAYOUT_ENV, param_shapes, default_per_layer: re-exported)
    LAYOUT_ENV,
    default_per_layer,
    model_params,
    param_shapes,
)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Where each token of a step sits: the paged-attention inputs."""

    positions: Int[Array, "T"]  # position of each token in its sequence
    slot_mapping: Int[Array, "T"]  # pool slot its K/V goes to; padding: num_blocks * block_size
    token_seq: Int[Array, "T"]  # row of block_tables the token belongs to; -1 for padding
    decode_context_lens: Int[Array, "T"]  # for a decode token (1 new token): its cached tokens; else 0
    seq_context_lens: Int[Array, "S"]  # tokens of each sequence already in the pool before this step
    continuation_rows: Int[Array, "S"]  # rows with >1 new token and cached context, then -1
    block_tables: Int[Array, "S B"]  # physical block ids per sequence; padding: 0 (the null block)
    # tokens before the padding: the CPU dense call multiplies only those rows (`layers.dense.dense`), so a
    # step costs its tokens rather than its bucket. None: all T.
    num_real_tokens: Int[Array, ""] | None = None
    # static: the most new tokens any one sequence has in the step, when the caller knows it (functional
    # prefill); lets the attention read only nearby keys for the new tokens. None: up to T.
    max_query_len: int | None = field(default=None, metadata={"static": True})


def forward(
    cfg: ModelConfig, params: dict, token_ids: Int[Array, "T"], kv_pool: Float[Array, "L 2 N bs KH D"],
    meta: AttentionMetadata, *, attention_backend: str = "reference", kv_chunk: int = 32, mesh=None,
    lora_slots: Int[Array, "T"] | None = None,
) -> tuple[Float[Array, "T E"], Float[Array, "L 2 N bs KH D"]]:
    """Run all layers on a flat batch of tokens; returns final hidden states and the updated pool.

    `params` is our parameter tree (`model_params`): embed, final_norm, optional lm_head, and the layer
    weights under "layers" (stacked [L, ...] and scanned over with `lax.scan`, or a list of per-layer dicts).
    mesh: tensor parallelism (`distributed/tensor_parallel.py`): params sharded as `model_params(..., mesh=mesh)`
    places them and the pool by KV heads; the KV write and the attention run per shard.
    lora_slots: each token's adapter slot in the layers' LoRA stack (`layers/lora.py`; -1: the base model), for
    a model with one (`LlamaForCausalLM.add_lora_stack`); None: no adapter.
    """
    t = token_ids.shape[0]
    h, kh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    tp = mesh_size(mesh)

    def attend(q, k, v, pool, idx, meta, window):  # per shard under a mesh: its KV heads and their query heads
        pool = write_kv(pool, idx, k, v, meta.slot_mapping)
        a = paged_attention(
            q, k, v, pool, idx, meta.block_tables, meta.token_seq, meta.positions,
            meta.decode_context_lens, meta.seq_context_lens, meta.continuation_rows,
            sm_scale=cfg.sm_scale, sliding_window=window, kv_chunk=kv_chunk,
            backend=attention_backend, max_query_len=meta.max_query_len, softcap=cfg.attn_softcap,
        )
        return a, pool

    if mesh is not None:
        heads = P(None, AXIS, None)
        per_shard = attend

        def attend(q, k, v, pool, idx, meta, window):
            return jax.shard_map(lambda *a: per_shard(*a, window), mesh=mesh,
                                 in_specs=(heads, heads, heads, POOL_SPEC, P(), P()), out_specs=(heads, POOL_SPEC),
                                 check_vma=False)(q, k, v, pool, idx, meta)
    kv_scale = params.get("kv_scale")  # [L, 2, KH] fp8 KV scales (models/kv_scales.py), or None
    cpu_rope = attention_backend == "cpu" and mesh is None
    angles = model_rope_angles(meta.positions, cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling,
                               cfg.max_position_embeddings, cpu_kernel=cpu_rope)
    local_angles = angles if cfg.local_rope_theta is None else model_rope_angles(
        meta.positions, cfg.rope_dim, cfg.local_rope_theta, None, cfg.max_position_embeddings, cpu_kernel=cpu_rope)
    x = embedding_rows(params["embed"], token_ids, cfg.compute_dtype)  # [T, E]
    if cfg.embed_scale != 1.0:  # (a float32 product rounded once, as torch's bf16 x scalar)
        x = (x.astype(jnp.float32) * cfg.embed_scale).astype(x.dtype)
    x = x.astype(cfg.compute_dtype)
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    rows = meta.num_real_tokens
    first = params["layers"][0] if isinstance(params["layers"], (list, tuple)) else params["layers"]
    gate = None  # [T, S] each token's adapter slot, one-hot
    if lora_slots is not None and a_name("qkv") in first:
        gate = slot_gate(lora_slots, first[a_name("qkv")].shape[-2], x.dtype)

    def scaled(y):  # a block's output into the residual stream: Granite's residual_multiplier, a float32 product
        return y if cfg.residual_scale == 1.0 else (y.astype(jnp.float32) * cfg.residual_scale).astype(y.dtype)

    def kind(i: int):  # layer i's sliding window and rotary tables (the local ones where it has a window)
        window = cfg.window_of(i)
        return window, angles if window is None else local_angles

    def layer(carry, xs, window, angles):
        x, pool = carry
        w, idx = xs
        y = rms_norm(x, w["input_norm"], eps, offset)
        qkv = dense(y, w["wqkv"], rows)  # [T, (H + 2 KH) D], in tp groups of [q | k | v] columns (`model_params`)
        if cfg.qkv_bias:
            qkv = qkv + w["bqkv"]
        q, k, v = jnp.split(qkv.reshape(t, tp, -1), [h * d // tp, (h + kh) * d // tp], axis=-1)
        if gate is not None:  # (each delta in natural head order: tp groups of whole heads, as q/k/v's)
            dq, dk, dv = lora_deltas(y, w, "qkv", gate)
            q, k, v = q + dq.reshape(q.shape), k + dk.reshape(k.shape), v + dv.reshape(v.shape)
        q, k = q.reshape(t, h, d), k.reshape(t, kh, d)
        if cfg.qk_norm:  # (per head, over head_dim; before RoPE)
            q, k = rms_norm(q, w["q_norm"], eps, offset), rms_norm(k, w["k_norm"], eps, offset)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        v = v.reshape(t, kh, d)
        if kv_scale is not None:  # the pool holds K / k_scale and V / v_scale: fold k_scale into q
            ks, vs = kv_scale[idx, 0], kv_scale[idx, 1]  # [KH]
            k, v = k / ks[:, None].astype(k.dtype), v / vs[:, None].astype(v.dtype)
            q = (q.reshape(t, kh, h // kh, d) * ks[:, None, None].astype(q.dtype)).reshape(t, h, d)
        a, pool = attend(q, k, v, pool, idx, meta, window)
        if kv_scale is not None:  # ... and v_scale into the output
            a = (a.reshape(t, kh, h // kh, d) * vs[:, None, None].astype(a.dtype)).reshape(t, h, d)
        o = dense(a.reshape(t, h * d), w["wo"], rows)
        if gate is not None:
            o = o + lora_deltas(a.reshape(t, h * d), w, "o", gate)[0]
        if cfg.o_bias:
            o = o + w["bo"]
        if cfg.sandwich_norms:
            o = rms_norm(o, w["attn_out_norm"], eps, offset)
        x = x + scaled(o)
        m = mlp(rms_norm(x, w["post_norm"], eps, offset), w)
        if cfg.sandwich_norms:
            m = rms_norm(m, w["mlp_out_norm"], eps, offset)
        x = x + scaled(m)
        return (x, pool), None

    def mlp(y, w):  # the dense MLP, the experts, or both (a shared expert)
        out = None
        if cfg.num_experts:
            out = moe_mlp(y, w["router"], w["we_gate_up"], w["we_down"], top_k=cfg.num_experts_per_tok,
                          normalize=cfg.norm_topk_prob, round_weights=cfg.round_router_weights, shards=tp, rows=rows,
                          activation=cfg.hidden_act)
        if cfg.dense_mlp:
            adapt = None if gate is None or a_name("gate_up") not in w else (
                lambda group, z: lora_deltas(z, w, group, gate))
            d = gated_mlp(y, w["w_gate_up"], w["w_down"], shards=tp, rows=rows, activation=cfg.hidden_act,
                          adapt=adapt)
            if cfg.shared_expert:
                d = d * jax.nn.sigmoid(dense(y, w["shared_gate"], rows))
            out = d if out is None else out + d
        return out

    if isinstance(params["layers"], (list, tuple)):  # one dict per layer: a Python loop, weights read in place
        carry = (x, kv_pool)
        for i, w in enumerate(params["layers"]):
            carry, _ = layer(carry, (w, jnp.int32(i)), *kind(i))
        x, kv_pool = carry
    else:
        if not cfg.uniform_layers:
            raise ValueError("layers of different kinds (sliding and full attention) need the per-layer layout")
        xs = (params["layers"], jnp.arange(cfg.num_layers, dtype=jnp.int32))
        (x, kv_pool), _ = jax.lax.scan(lambda c, xs: layer(c, xs, *kind(0)), (x, kv_pool), xs)
    return rms_norm(x, params["final_norm"], eps, offset), kv_pool


def compute_logits(params: dict, hidden: Float[Array, "S E"], mesh=None,
                   rows: Int[Array, ""] | None = None, scale: float = 1.0,
                   softcap: float | None = None) -> Float[Array, "S V"]:
    """Vocabulary logits in float32 (the tied embedding when the model has no lm_head); with a mesh, gathered
    from the vocabulary-parallel shards onto every device (the sampler reads whole rows). rows: only the first
    rows' logits are needed (a packed LM head then leaves the others zero; other heads compute them all).
    scale: the logits times it (`ModelConfig.logits_scale`). softcap: then squashed to softcap * tanh(x / softcap)."""
    head = params.get("lm_head", params["embed"])
    if isinstance(head, QuantizedWeight):
        logits = quantized_dense(hidden, head, jnp.float32)
    elif is_quantized(head) or ("lm_head" in params and head.ndim == 3):  # packed for a CPU call
        logits = dense(hidden, head, rows).astype(jnp.float32)
    elif "lm_head" in params:
        logits = jax.lax.dot_general(hidden.astype(params["lm_head"].dtype), params["lm_head"],
                                     (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    else:  # contracting the embedding's own axis 1: `embed.T` would have XLA:CPU copy the 56-113 MB table each call
        embed = params["embed"]
        logits = jax.lax.dot_general(hidden.astype(embed.dtype), embed, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
    if scale != 1.0:
        logits = logits * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    return logits if mesh is None else jax.lax.with_sharding_constraint(logits, replicated(mesh))


_data = getattr(nnx, "data", lambda x: x)  # (flax >= 0.12 wants data attributes first set to None marked)


def _value(v: nnx.Variable):
    """A variable's value, an array or a quantized weight's pytree (`v[...]` indexes, which a pytree cannot)."""
    return v.get_value() if hasattr(v, "get_value") else v.value


class LlamaLayers(nnx.Module):
    """Decoder layer weights: all layers stacked on a leading [L] axis, or one layer's."""

    def __init__(self, weights: dict[str, jax.Array]):
        for name, w in weights.items():
            setattr(self, name, nnx.Param(w))

    def arrays(self) -> dict[str, jax.Array]:
        return {k: _value(v) for k, v in vars(self).items() if isinstance(v, nnx.Param)}


class LlamaForCausalLM(nnx.Module):
    """Decoder-only Llama-family model over a paged KV pool: the engine's holder of `forward`'s params.

    per_layer: one weight dict per layer and a Python loop (default on CPU, where it is faster), else stacked
    weights under `lax.scan` (see the module docstring). packed: weights laid out for the CPU dense calls
    (`model_params`); by default with the CPU attention kernel."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray], *, attention_backend: str = "reference",
                 kv_chunk: int = 32, per_layer: bool | None = None, mesh=None, packed: bool | None = None):
        packed = attention_backend == "cpu" if packed is None else packed  # (with the other CPU kernels)
        params = model_params(cfg, weights, per_layer=per_layer, mesh=mesh, packed=packed)
        self.cfg = cfg
        self.attention_backend = attention_backend
        self.kv_chunk = kv_chunk
        self.mesh = mesh  # tensor parallelism: params sharded over it (`distributed/tensor_parallel.py`)
        self.embed = nnx.Param(params["embed"])
        self.final_norm = nnx.Param(params["final_norm"])
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None
        if isinstance(params["layers"], list):
            self.layers = nnx.List([LlamaLayers(w) for w in params["layers"]])
        else:
            self.layers = LlamaLayers(params["layers"])
        self.kv_scale = None  # fp8 KV scales [L, 2, KH] (`set_kv_scales`)
        self.lora_slots = 0  # adapters the layers' LoRA stack holds (`add_lora_stack`); 0: none

    def add_lora_stack(self, num_slots: int, max_rank: int) -> None:
        """Give every layer an empty LoRA stack: `num_slots` adapters of rank up to `max_rank` resident at once
        (`layers/lora.py`), in the activations' dtype, sharded with their layers under a mesh. Before the engine
        splits the model (a change of the state's structure recompiles)."""
        cfg = self.cfg
        shapes = lora_shapes(module_dims(cfg), num_slots, max_rank, mlp=cfg.dense_mlp and not cfg.num_experts)
        dtype = jnp.dtype(cfg.compute_dtype)
        stacked = isinstance(self.layers, LlamaLayers)
        for layer in [self.layers] if stacked else list(self.layers):
            for name, shape in shapes.items():
                shape = (cfg.num_layers, *shape) if stacked else shape
                zeros = np.zeros(shape, dtype)
                value = jnp.asarray(zeros) if self.mesh is None else place(
                    zeros, lora_sharding(self.mesh, name, shape, stacked))
                setattr(layer, name, nnx.Param(value))
        self.lora_slots = num_slots

    def write_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put `adapter` (host arrays, `models/lora_adapter.py`) into slot `slot` of the LoRA stack. The stack's
        arrays are replaced, not written in place: a step still in flight reads the old ones."""
        stacked = isinstance(self.layers, LlamaLayers)
        containers = [self.layers] if stacked else list(self.layers)
        names = {n for n in vars(containers[0]) if n.startswith("lora_")}
        b = dict(adapter.b)
        heads = b["k"].shape[-1] // self.cfg.head_dim  # (the checkpoint's KV heads: tensor parallelism may have
        if heads != self.cfg.num_kv_heads:  # replicated them up to the devices, wk/wv's columns and so B's too)
            _, kv = replicate_kv_heads(dataclasses.replace(self.cfg, num_kv_heads=heads),
                                       {"layers.wk": b["k"], "layers.wv": b["v"]}, self.cfg.num_kv_heads)
            b["k"], b["v"] = kv["layers.wk"], kv["layers.wv"]
        values = adapter_slices(adapter.a, b, names)
        for i, layer in enumerate(containers):
            for name, value in values.items():
                param = getattr(layer, name)
                param.value = write_slot(param.value, name, value if stacked else value[i], slot, stacked)

    def warm_lora_writes(self) -> None:
        """Compile `write_lora`'s slot writes (warmup): slot 0 written with its own contents."""
        stacked = isinstance(self.layers, LlamaLayers)
        for layer in [self.layers] if stacked else list(self.layers):
            for name in [n for n in vars(layer) if n.startswith("lora_")]:
                param = getattr(layer, name)
                value = np.asarray(jnp.take(param.value, 0, axis=slot_axis(name, stacked)))
                param.value = write_slot(param.value, name, value, 0, stacked)

    def set_kv_scales(self, scales: np.ndarray) -> None:
        """Use fp8 KV scales [L, 2, KH] (models/kv_scales.py): K and V are stored divided by them. Before the
        engine splits the model (a change of the state's structure recompiles)."""
        scales = np.asarray(scales, np.float32)
        self.kv_scale = _data(nnx.Variable(jnp.asarray(scales) if self.mesh is None else
                                           place(scales, replicated(self.mesh))))

    @property
    def pays_for_padding(self) -> bool:
        """Whether a step costs its whole token bucket: False where the layers' weights are packed for the CPU
        dense call, which multiplies only the step's real tokens (`AttentionMetadata.num_real_tokens`)."""
        # (stacked layers' [L, K, N] weights are 3-D too, and never packed)
        if not isinstance(self.layers, nnx.List):
            return True
        wqkv = self.layers[0].arrays()["wqkv"]
        return not (isinstance(wqkv, Int8Panels) or (not is_quantized(wqkv) and wqkv.ndim == 3))

    def params(self) -> dict:
        """The parameter tree `forward` takes."""
        layers = self.layers.arrays() if isinstance(self.layers, LlamaLayers) else [x.arrays() for x in self.layers]
        out = {"embed": _value(self.embed), "final_norm": self.final_norm[...], "layers": layers}
        if self.lm_head is not None:
            out["lm_head"] = _value(self.lm_head)
        if self.kv_scale is not None:
            out["kv_scale"] = self.kv_scale[...]
        return out

    def __call__(
        self, token_ids: Int[Array, "T"], kv_pool: Float[Array, "L 2 N bs KH D"], meta: AttentionMetadata,
        lora_slots: Int[Array, "T"] | None = None,
    ) -> tuple[Float[Array, "T E"], Float[Array, "L 2 N bs KH D"]]:
        """Run all layers on a flat batch of tokens; returns final hidden states and the updated pool.
        lora_slots: each token's adapter slot (-1: none), with a LoRA stack."""
        return forward(self.cfg, self.params(), token_ids, kv_pool, meta, attention_backend=self.attention_backend,
                       kv_chunk=self.kv_chunk, mesh=self.mesh, lora_slots=lora_slots)

    def compute_logits(self, hidden: Float[Array, "S E"], rows: Int[Array, ""] | None = None) -> Float[Array, "S V"]:
        """Vocabulary logits in float32 (on every device, under a mesh); rows: only the first rows' are needed."""
        return compute_logits(self.params(), hidden, self.mesh, rows, self.cfg.logits_scale, self.cfg.final_softcap)
