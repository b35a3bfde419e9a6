"""The dense building blocks of Llama-family models as pure functions of arrays: RMSNorm, matmuls (the CPU
dense call's packed panels among them), the gated MLP and the mixture of experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.layers.quant import Int8Panels, QuantizedWeight, panel_dense, quantized_dense
from pallas_kernels import cpu_onednn
from pallas_kernels.cpu_dense import can_pack, pack, packed_dense


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
    """x @ w in x's dtype. A 3-D w is laid out for a CPU dense call: float32 panels for `pallas_kernels.cpu_dense`,
    a bf16 [1, K, N] for oneDNN's GEMM (`pallas_kernels.cpu_onednn`); with `rows` either multiplies only x's first
    rows (the step's tokens before its padding) and zeros the rest. Narrower
    weights than activations (bf16 weights, float32 activations: the CPU form) take x rounded to w's dtype into
    a dot with float32 output, the form XLA:CPU runs on the CPU's bf16 dot instructions (twice float32's rate;
    a bf16-output dot takes a slow path). Quantized weights (`layers/quant.py`) are dequantized inside the dot,
    or (`Int8Panels`) run oneDNN's integer GEMM on x quantized per row."""
    if isinstance(w, Int8Panels):
        return panel_dense(x, w, rows)
    if isinstance(w, QuantizedWeight):
        return quantized_dense(x, w)
    if w.ndim == 3:
        call = cpu_onednn.onednn_dense if w.dtype == jnp.bfloat16 else packed_dense
        return call(x, w, rows).astype(x.dtype)
    if x.dtype == w.dtype:
        return x @ w
    y = jax.lax.dot_general(x.astype(w.dtype), w, (((x.ndim - 1,), (0,)), ((), ())),
                            preferred_element_type=jnp.float32)
    return y.astype(x.dtype)


def cpu_panels(w: np.ndarray) -> jax.Array | None:
    """A float32 [K, N] weight as the CPU dense call's column panels ([N / panel, K, panel], what `dense` takes
    as a 3-D w), or None where the call cannot take this shape."""
    return jnp.asarray(pack(w)) if can_pack(w) else None


def cpu_layout(w: np.ndarray, dtype) -> jax.Array | None:
    """A [K, N] weight laid out for a CPU dense call in `dtype` (float32: `cpu_panels`; bfloat16: oneDNN's
    [1, K, N]), or None where no call takes it (the weight then stays [K, N] for XLA's dot)."""
    if jnp.dtype(dtype) == jnp.float32:
        return cpu_panels(np.asarray(w).astype(np.float32, copy=False))
    if jnp.dtype(dtype) == jnp.bfloat16:
        return cpu_onednn.layout(w)
    return None


ACTIVATIONS = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}
# transformers' hidden_act names -> ours
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                  "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def gated_mlp(x: Float[Array, "T E"], w_gate_up: Float[Array, "E 2F"], w_down: Float[Array, "F E"], *,
              shards: int = 1, rows: Int[Array, ""] | None = None, activation: str = "silu",
              adapt=None) -> Float[Array, "T E"]:
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up as one matmul, act SiLU or GELU (`ACTIVATIONS`). Its
    columns come in `shards` groups (tensor parallelism: one per device), each [gate part | up part]; one group
    is [gate | up]. rows: as `dense`'s. adapt(group, input): LoRA updates to add, [gate, up] for "gate_up" and
    [down] for "down", each in natural column order (`layers/lora.py`), or None."""
    t = x.shape[0]
    gate, up = jnp.split(dense(x, w_gate_up, rows).reshape(t, shards, -1), 2, axis=-1)  # [T, shards, F / shards]
    if adapt is not None:
        d_gate, d_up = adapt("gate_up", x)
        gate, up = gate + d_gate.reshape(gate.shape), up + d_up.reshape(up.shape)
    h = (ACTIVATIONS[activation](gate) * up).reshape(t, -1)
    out = dense(h, w_down, rows)
    return out if adapt is None else out + adapt("down", h)[0]


def moe_mlp(x: Float[Array, "T E"], router: Float[Array, "E X"], w_gate_up: Float[Array, "X E 2F"],
            w_down: Float[Array, "X F E"], *, top_k: int, normalize: bool, shards: int = 1,
            rows: Int[Array, ""] | None = None, activation: str = "silu", grouped: bool | None = None,
            round_weights: bool = False) -> Float[Array, "T E"]:
    """Mixture of experts (Mixtral, Qwen-MoE): each token's router probabilities (a float32 softmax over the X
    experts), its top_k experts' gated MLPs weighted by them (renormalized to sum 1 with `normalize`).

    grouped (the default off CPUs): the T * top_k (token, expert) pairs sorted by expert, each expert's run
    multiplied by its weights in one grouped matmul (`lax.ragged_dot`), the results added back to their tokens:
    top_k MLPs a token. Else (CPUs) every expert on every token, batched over experts, weighted by the router's
    (zero for the experts not chosen): XLA:CPU runs the grouped form slower than that
    (`python -m jaxpaged.bench.moe_paths`; docs/benchmarks/design-choices.md).
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
