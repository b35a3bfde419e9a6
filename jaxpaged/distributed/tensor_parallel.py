"""Tensor parallelism over a 1-D device mesh with axis "tp": Megatron-style weight shardings, KV heads
replicated up to the mesh size where a model has fewer, and the KV pool sharded over its KV-head axis.

The step stays one jitted function: parameters and the pool carry `NamedSharding`s and XLA's SPMD partitioner
inserts the collectives (an all-reduce after the row-parallel o and down projections, a gather of the
vocabulary-parallel logits); the attention runs per shard under `shard_map` (`models/llama.py`), each device
over its own KV heads and the query heads that read them.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.config import ModelConfig

AXIS = "tp"
POOL_SPEC = P(None, None, None, None, AXIS)  # [L, 2, N, bs, KH, D]: each device holds its KV heads
# one layer's weights, by our names (models/llama.py): column-parallel q/k/v and gate/up (their fused columns are
# grouped per shard, `models.llama.model_params`), row-parallel o and down; norms and the o bias replicated
_LAYER_SPECS = {"wqkv": P(None, AXIS), "bqkv": P(AXIS), "w_gate_up": P(None, AXIS), "wo": P(AXIS, None),
                "w_down": P(AXIS, None)}


def check_tensor_parallel(cfg: ModelConfig, tp: int, dp: int = 1) -> None:
    """Raise ValueError, naming the config field, if `cfg` cannot be split `tp` ways (vLLM's rules: heads and the
    MLP width divide by tp; KV heads divide by tp, or tp by KV heads, which are then replicated), or `dp`
    replicas of `tp` devices each do not fit on the devices there are."""
    for name, v in (("tensor_parallel_size", tp), ("data_parallel_size", dp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if tp * dp > len(jax.devices()):
        raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} exceeds the {len(jax.devices())} "
                         f"{jax.default_backend()} device(s) available (on CPU, "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)")
    if tp == 1:
        return
    kh = cfg.num_kv_heads
    for name, value in (("num_attention_heads", cfg.num_heads), ("intermediate_size", cfg.intermediate_size)):
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name} ({value})")
    if kh % tp and tp % kh:
        raise ValueError(f"tensor_parallel_size={tp} and the model's num_key_value_heads ({kh}) do not divide one "
                         f"another (KV heads are split over devices, or replicated when fewer than devices)")


def tensor_parallel_mesh(tp: int, first: int = 0) -> Mesh:
    """A mesh over `tp` devices from device `first` on, axis "tp"."""
    return Mesh(np.array(jax.devices()[first : first + tp]), (AXIS,))


def replica_meshes(tp: int, dp: int) -> list[Mesh | None]:
    """One mesh per data-parallel replica, on disjoint devices (replica i: devices i * tp to (i + 1) * tp - 1);
    [None] for one replica on one device (the default placement)."""
    if tp == dp == 1:
        return [None]
    return [tensor_parallel_mesh(tp, i * tp) for i in range(dp)]


def mesh_size(mesh: Mesh | None) -> int:
    """Devices the attention heads are split over (1 without a mesh)."""
    return 1 if mesh is None else mesh.shape[AXIS]


def replicate_kv_heads(cfg: ModelConfig, weights: dict, tp: int) -> tuple[ModelConfig, dict]:
    """Where the model has fewer KV heads than devices, repeat each KV head's k/v columns (and biases) tp / KH
    times, so every device holds one; query head j keeps reading a copy of its own KV head. Returns the
    config with `num_kv_heads` = tp and the weights (unchanged where KH >= tp)."""
    kh, d = cfg.num_kv_heads, cfg.head_dim
    if kh >= tp:
        return cfg, weights
    r = tp // kh

    def repeat(w):  # [L, E, KH * D] or [L, KH * D] (or a quantized weight's scales: [L, G, KH * D])
        w = np.asarray(w).reshape(*w.shape[:-1], kh, d)
        return np.repeat(w, r, axis=-2).reshape(*w.shape[:-2], tp * d)

    out = dict(weights)
    for name in ("layers.wk", "layers.wv", "layers.bk", "layers.bv"):
        if name in out:  # (quantized weights, `models.quantize.HostQuant`, repeat their codes and scales alike)
            out[name] = out[name].map_columns(repeat) if hasattr(out[name], "map_columns") else repeat(out[name])
    return dataclasses.replace(cfg, num_kv_heads=tp), out


def param_sharding(mesh: Mesh, name: str, shape: tuple[int, ...], stacked: bool) -> NamedSharding:
    """The sharding of parameter `name` (a top-level name, or a layer weight's; `stacked`: with a leading [L])."""
    tp = mesh_size(mesh)
    if name == "embed":  # vocabulary-parallel where the vocabulary divides
        spec = P(AXIS, None) if shape[0] % tp == 0 else P()
    elif name == "lm_head":
        spec = P(None, AXIS) if shape[1] % tp == 0 else P()
    elif name in _LAYER_SPECS:
        spec = P(*((None,) if stacked else ()), *_LAYER_SPECS[name])
    else:
        spec = P()
    return NamedSharding(mesh, spec)


def lora_sharding(mesh: Mesh, name: str, shape: tuple[int, ...], stacked: bool) -> NamedSharding:
    """The sharding of a LoRA stack array (`layers/lora.py`) beside its layer: the B of a column-parallel
    projection (q, k, v, gate, up; [S, R, N]) split over N, the A of a row-parallel one (o, down; [K, P, S, R])
    over K, the rest replicated (also where the axis does not divide)."""
    tp, lead = mesh_size(mesh), (None,) * stacked
    body = shape[len(lead):]
    spec = P()
    if name in ("lora_b_q", "lora_b_k", "lora_b_v", "lora_b_gate", "lora_b_up") and body[-1] % tp == 0:
        spec = P(*lead, None, None, AXIS)
    elif name in ("lora_a_o", "lora_a_down") and body[0] % tp == 0:
        spec = P(*lead, AXIS, None, None, None)
    return NamedSharding(mesh, spec)


def replicated(mesh: Mesh | None):
    """The sharding of device state every shard reads whole (processor rows, last tokens); None without a mesh."""
    return None if mesh is None else NamedSharding(mesh, P())


def pool_sharding(mesh: Mesh | None):
    """The KV pool's sharding: over its KV-head axis; None without a mesh."""
    return None if mesh is None else NamedSharding(mesh, POOL_SPEC)
