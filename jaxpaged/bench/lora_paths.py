"""The multi-LoRA update of one projection timed two ways on this machine: the dense form `layers.lora` runs
(x @ A over every slot, masked to each token's slot, then @ B) and a grouped matmul over the tokens sorted by
adapter (`lax.ragged_dot`, Punica's SGMV idea). Prints a table and writes JSON:
`python -m jaxpaged.bench.lora_paths [--output lora_paths.json]`."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.bench.moe_paths import time_ms
from jaxpaged.bench.report import write_json
from jaxpaged.layers.lora import lora_deltas, slot_gate

# (tokens, in, out, slots, rank): SmolLM2-135M's gate/up input (576 -> 1536) and a 1B model's (2048 -> 8192)
SHAPES = [(8, 576, 1536, 4, 16), (64, 576, 1536, 4, 16), (256, 576, 1536, 4, 16), (64, 576, 1536, 16, 64),
          (64, 2048, 8192, 4, 16), (64, 2048, 8192, 16, 64)]


def dense_form(x, a, b, slots):
    return lora_deltas(x, {"lora_a_down": a, "lora_b_down": b}, "down", slot_gate(slots, a.shape[2], x.dtype))[0]


def grouped_form(x, a, b, slots):
    """Tokens sorted by slot (the base model's last, in no group), two ragged_dots, unsorted again."""
    s = a.shape[2]
    key = jnp.where(slots < 0, s, slots)
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=s + 1)[:s].astype(jnp.int32)
    a_g = jnp.transpose(a[:, 0], (1, 0, 2))  # [S, K, R]
    u = jax.lax.ragged_dot(x[order], a_g, sizes)
    y = jax.lax.ragged_dot(u, b, sizes)
    return jnp.zeros_like(y).at[order].set(y)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file for the rows (default: none)")
    ns = ap.parse_args(argv)
    rows = []
    print(f"{'tokens':>6} {'in':>5} {'out':>5} {'slots':>5} {'rank':>4} {'dense ms':>9} {'grouped ms':>10} "
          f"{'grouped/dense':>13}")
    for t, k, n, s, r in SHAPES:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)
        a = jnp.asarray(0.02 * rng.standard_normal((k, 1, s, r)), jnp.float32)
        b = jnp.asarray(0.02 * rng.standard_normal((s, r, n)), jnp.float32)
        slots = jnp.asarray(rng.integers(-1, s, t), jnp.int32)  # (the base model's rows among them)
        np.testing.assert_allclose(dense_form(x, a, b, slots), grouped_form(x, a, b, slots), rtol=2e-4, atol=2e-5)
        ms = {name: time_ms(jax.jit(fn), x, a, b, slots) for name, fn in (("dense", dense_form),
                                                                          ("grouped", grouped_form))}
        rows.append(dict(tokens=t, d_in=k, d_out=n, slots=s, rank=r, dense_ms=ms["dense"], grouped_ms=ms["grouped"],
                         platform=jax.default_backend()))
        print(f"{t:>6} {k:>5} {n:>5} {s:>5} {r:>4} {ms['dense']:>9.3f} {ms['grouped']:>10.3f} "
              f"{ms['grouped'] / ms['dense']:>12.1f}x")
    write_json(rows, ns.output)
    return rows


if __name__ == "__main__":
    main()
