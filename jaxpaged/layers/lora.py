"""Multi-LoRA on the device: every resident adapter's low-rank update of a projection, per token, with no
branch and no compile per mix of adapters (the Punica/SGMV idea in dense form).

The stack holds S = max_loras adapters, each with rank up to R. A projection's A is [K, P, S, R] (P parts
sharing the input: q/k/v, gate/up), each part's B is [S, R, N]. A token's update is
    u = x @ A  [T, P, S*R], masked to its own slot's R columns (a one-hot gate [T, S]; slot -1: none),
    delta_p = u_p @ B_p  [T, N]:
two dense matmuls whatever the mix, costing (K + N) * S * R per token and part: at S * R = 64 for SmolLM2
~15% of its layers' own work. A grouped matmul over tokens sorted by adapter (`lax.ragged_dot`) does the same
arithmetic where XLA has no native grouped kernel (it masks per group), plus a sort: 1.2-3.2x slower on CPU
(`python -m jaxpaged.bench.lora_paths`, docs/benchmarks/lora.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

# The fused projections of the stack: a name per shared input, its parts (our module names, `models/lora_adapter.py`)
LORA_PARTS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def a_name(group: str) -> str:
    return f"lora_a_{group}"


def b_name(part: str) -> str:
    return f"lora_b_{part}"


def lora_shapes(dims: dict[str, tuple[int, int]], num_slots: int, max_rank: int, mlp: bool = True
                ) -> dict[str, tuple[int, ...]]:
    """A layer's stack arrays: name -> shape, from each module's (in, out) `dims`. mlp=False: attention only
    (a model whose MLP is experts)."""
    shapes = {}
    for group, parts in LORA_PARTS.items():
        if not mlp and group in ("gate_up", "down"):
            continue
        shapes[a_name(group)] = (dims[parts[0]][0], len(parts), num_slots, max_rank)
        for part in parts:
            shapes[b_name(part)] = (num_slots, max_rank, dims[part][1])
    return shapes


def slot_gate(slots: Int[Array, "T"], num_slots: int, dtype) -> Float[Array, "T S"]:
    """One-hot [T, S] of each token's adapter slot (all zeros for -1: the base model)."""
    return (slots[:, None] == jnp.arange(num_slots, dtype=slots.dtype)[None, :]).astype(dtype)


def lora_deltas(x: Float[Array, "T K"], layer: dict, group: str, gate: Float[Array, "T S"]
                ) -> list[Float[Array, "T N"]]:
    """Each part's update [T, N_p] of projection group `group` for x, from the layer's stack arrays."""
    a = layer[a_name(group)]
    k, p, s, r = a.shape
    t = x.shape[0]
    u = jnp.dot(x.astype(a.dtype), a.reshape(k, p * s * r)).reshape(t, p, s, r) * gate.astype(a.dtype)[:, None, :, None]
    outs = []
    for i, part in enumerate(LORA_PARTS[group]):
        b = layer[b_name(part)]
        outs.append(jnp.dot(u[:, i].reshape(t, s * r), b.reshape(s * r, -1)).astype(x.dtype))
    return outs


def adapter_slices(a: dict[str, np.ndarray], b: dict[str, np.ndarray], names: set[str]) -> dict[str, np.ndarray]:
    """One adapter's host arrays ([L, in, R] and [L, R, out] per module) as the stack's slot slices, stacked over
    layers: A [L, K, P, R], B [L, R, N]; only the arrays in `names` (the stack's)."""
    out = {}
    for group, parts in LORA_PARTS.items():
        if a_name(group) in names:
            out[a_name(group)] = np.stack([a[p] for p in parts], axis=2)
            for part in parts:
                out[b_name(part)] = b[part]
    return out


def slot_axis(name: str, stacked: bool) -> int:
    """The slot axis of stack array `name`: A [K, P, S, R] axis 2, B [S, R, N] axis 0; one later with a leading [L]."""
    return (2 if name.startswith("lora_a_") else 0) + (1 if stacked else 0)


def _write(stack: jax.Array, value: jax.Array, slot: Int[Array, ""], axis: int) -> jax.Array:
    index = (slice(None),) * axis + (slot,)
    return stack.at[index].set(value.astype(stack.dtype))


_write_jit = jax.jit(_write, static_argnums=3)


def write_slot(stack: jax.Array, name: str, value: np.ndarray, slot: int, stacked: bool) -> jax.Array:
    """The stack array `name` with slot `slot` replaced by `value` (its slot slice; a new array: a step still in
    flight reads the old one). stacked: the array has a leading [L] axis (and `value` too)."""
    return _write_jit(stack, value, np.int32(slot), slot_axis(name, stacked))
