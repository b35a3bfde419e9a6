"""Top-k / top-p sampling with temperature, per row: a sort-free Pallas kernel and its reference.

Meaning (vLLM's): temperature first; then top-k keeps the k largest logits; then top-p keeps
the smallest set of the remaining (renormalized) distribution whose cumulative probability
reaches p, the crossing token included. k=0 and p=1 mean off; temperature 0 means argmax.

The kernel (`top_k_top_p_sampling`) never sorts the vocabulary. It is FlashInfer's rejection
sampling with dual pivots: draw a token from the mass not yet ruled out; the token is in the kept
set iff fewer than k tokens are more likely and their mass is below p (times the top-k mass); if
not, every token as unlikely is ruled out too, and so is everything below a second pivot halfway
to the most likely token when that pivot also fails. A few passes over the row, whatever its length.
The reference (`reference_top_k_top_p_sampling`) sorts each row and masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int


def first_argmax(x: Float[Array, "B V"]) -> Int[Array, "B"]:
    """jnp.argmax over the last axis (the first index of the largest value), as a max and a masked min: XLA:CPU
    runs argmax's paired (value, index) reduction 4x slower (3.9 vs 1.0 ms for 32 x 49,152)."""
    v = x.shape[-1]
    hit = x == x.max(axis=-1, keepdims=True)
    return jnp.minimum(jnp.min(jnp.where(hit, jnp.arange(v, dtype=jnp.int32), v), axis=-1), v - 1)


def check_sampling_args(logits, key, temperature, top_k, top_p) -> None:
    """Raise ValueError on shapes the sampler cannot take."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    b = logits.shape[0]
    for name, a in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if a.shape != (b,):
            raise ValueError(f"{name} must be [B={b}], got shape {a.shape}")
    if not jnp.issubdtype(top_k.dtype, jnp.integer):
        raise ValueError(f"top_k must be integer, got {top_k.dtype}")
    kshape = jnp.shape(jax.random.key_data(key)) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key.shape
    if kshape not in ((2,), (b, 2)):
        raise ValueError(f"key must be one PRNG key or one per row [B={b}], got shape {key.shape}")


def row_keys(key, batch: int):
    """One key per row: a per-row key array as is, or `batch` independent keys split from one key."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    return data if data.ndim == 2 else jax.random.split(data, batch)


def top_k_top_p_mask(logits: Float[Array, "B V"], top_k: Int[Array, "B"], top_p: Float[Array, "B"]):
    """Logits with everything outside each row's top-k, then top-p, set to -inf (sorts each row)."""
    v = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)  # [B, V]
    k = jnp.where((top_k <= 0) | (top_k > v), v, top_k)
    rank = jnp.arange(v)[None, :]
    sorted_desc = jnp.where(rank < k[:, None], sorted_desc, -jnp.inf)  # top-k applied
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each rank
    keep = jnp.sum((before < top_p[:, None]) & (rank < k[:, None]), axis=-1)  # >= 1
    threshold = jnp.take_along_axis(sorted_desc, (keep - 1)[:, None], axis=-1)  # [B, 1]
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def categorical_from_uniform(weights: Float[Array, "B V"], u: Float[Array, "B"], *, tile: int = 128):
    """Inverse-CDF draw from unnormalized non-negative `weights` with one uniform u in (0, 1] per row.

    Two levels (tile sums, then one tile), so no [B, V] scan or per-element random numbers.
    """
    b, v = weights.shape
    pad = (-v) % tile
    w = jnp.pad(weights, ((0, 0), (0, pad))).reshape(b, -1, tile)  # [B, V/tile, tile]
    tile_cdf = jnp.cumsum(w.sum(-1), axis=-1)  # [B, V/tile]
    target = u * tile_cdf[:, -1]
    blk = jnp.minimum(jnp.sum(tile_cdf < target[:, None], axis=-1), tile_cdf.shape[1] - 1)
    before = jnp.where(blk > 0, jnp.take_along_axis(tile_cdf, jnp.maximum(blk - 1, 0)[:, None], -1)[:, 0], 0.0)
    inner_cdf = jnp.cumsum(jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0], axis=-1) + before[:, None]
    idx = blk * tile + jnp.minimum(jnp.sum(inner_cdf < target[:, None], axis=-1), tile - 1)
    return jnp.minimum(idx, v - 1)


def reference_top_k_top_p_sampling(
    logits: Float[Array, "B V"],
    key,
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
) -> Int[Array, "B"]:
    """One token per row; `key` is one PRNG key (rows draw independently) or one key per row [B, 2]."""
    check_sampling_args(logits, key, temperature, top_k, top_p)
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    greedy_rows = temperature <= 0
    scaled = logits / jnp.where(greedy_rows, 1.0, temperature)[:, None]
    needs_filter = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0))
    filtered = jax.lax.cond(needs_filter, top_k_top_p_mask, lambda x, *_: x, scaled, top_k, top_p)
    weights = jnp.exp(filtered - filtered.max(axis=-1, keepdims=True))
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(row_keys(key, b))  # (0, 1]
    sampled = categorical_from_uniform(weights, u)
    return jnp.where(greedy_rows, first_argmax(logits), sampled).astype(jnp.int32)


MAX_ROUNDS = 32  # rejection rounds before falling back to the argmax (always in the kept set)
_BISECT_ROUNDS = 48  # for the k-th largest logit, when top-k and top-p are both on


def _sampling_kernel(logits_ref, temperature_ref, top_k_ref, top_p_ref, uniforms_ref, out_ref, *, vocab: int,
                     tile: int):
    """One row: pl.program_id(0). logits_ref [B, Vp] (padding -inf), uniforms_ref [B, MAX_ROUNDS]."""
    row = pl.program_id(0)
    num_tiles = logits_ref.shape[1] // tile
    temp = temperature_ref[row]

    def z_tile(i):  # scaled logits of tile i, the row's max at 0 once m is known
        return logits_ref[row, pl.ds(i * tile, tile)].astype(jnp.float32) / temp

    def reduce_tiles(fn, init):
        return jax.lax.fori_loop(0, num_tiles, lambda i, c: fn(z_tile(i), i, c), init)

    @pl.when(temp > 0)
    def _():
        def online(z, _, c):
            m, s = c
            m_new = jnp.maximum(m, jnp.max(z))
            return m_new, s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(z - m_new))

        zmax, total = reduce_tiles(online, (jnp.float32(-jnp.inf), jnp.float32(0.0)))
        k, p = top_k_ref[row], top_p_ref[row]
        k_on = (k > 0) & (k < vocab)
        k = jnp.where(k_on, k, vocab + 1)

        def weight(z):
            return jnp.exp(z - zmax)

        def count_ge(t):
            return reduce_tiles(lambda z, _, c: c + jnp.sum((z >= t).astype(jnp.int32)), jnp.int32(0))

        def top_k_mass():  # bisection on the scaled logit for the k-th largest value; its mass
            zmin = reduce_tiles(lambda z, _, c: jnp.minimum(c, jnp.min(jnp.where(z > -jnp.inf, z, zmax))), zmax)

            def cond(c):
                lo, hi, n, it = c
                return (n != k) & (it < _BISECT_ROUNDS) & (hi > lo)

            def body(c):
                lo, hi, n, it = c
                mid = lo + (hi - lo) / 2
                c_mid = count_ge(mid)
                take = c_mid >= k
                return jnp.where(take, mid, lo), jnp.where(take, hi, mid), jnp.where(take, c_mid, n), it + 1

            lo, _, _, _ = jax.lax.while_loop(cond, body, (zmin, zmax + 1.0, count_ge(zmin), jnp.int32(0)))
            return reduce_tiles(lambda z, _, c: c + jnp.sum(jnp.where(z >= lo, weight(z), 0.0)), jnp.float32(0.0))

        kept_mass = jax.lax.cond(k_on & (p < 1.0), top_k_mass, lambda: total * 1.0)
        p_mass = jnp.where(p < 1.0, p * kept_mass, jnp.inf)  # top-p bound on the mass above a kept token

        def draw(low, mass, r):  # inverse CDF over tokens with z > low
            target = uniforms_ref[row, r] * mass

            def step(z, i, c):
                acc, tok = c
                w = jnp.where(z > low, weight(z), 0.0)
                cdf = acc + jnp.cumsum(w)
                end = jnp.max(cdf)  # the tile's last cdf value (cdf is non-decreasing)
                inside = (tok < 0) & (end >= target)
                j = jnp.minimum(jnp.sum((cdf < target).astype(jnp.int32)), tile - 1)
                return end, jnp.where(inside, i * tile + j, tok)

            _, tok = reduce_tiles(step, (jnp.float32(0.0), jnp.int32(-1)))
            return tok

        def aggregate(p0, p1):  # count and mass strictly above each pivot
            def step(z, _, c):
                c0, s0, c1, s1 = c
                w = weight(z)
                a0, a1 = z > p0, z > p1
                return (c0 + jnp.sum(a0.astype(jnp.int32)), s0 + jnp.sum(jnp.where(a0, w, 0.0)),
                        c1 + jnp.sum(a1.astype(jnp.int32)), s1 + jnp.sum(jnp.where(a1, w, 0.0)))

            return reduce_tiles(step, (jnp.int32(0), jnp.float32(0.0), jnp.int32(0), jnp.float32(0.0)))

        def cond(c):
            _, _, _, tok, done, r = c
            return (~done) & (r < MAX_ROUNDS)

        def body(c):
            low, high, mass, _, _, r = c
            tok = draw(low, mass, r)
            ok = tok >= 0
            z_tok = jnp.where(ok, logits_ref[row, jnp.maximum(tok, 0)].astype(jnp.float32) / temp, high)
            pivot1 = (z_tok + high) / 2
            c0, s0, c1, s1 = aggregate(z_tok, pivot1)
            accept = ok & (c0 < k) & (s0 < p_mass)
            mid_ok = (c1 < k) & (s1 < p_mass)
            narrow = ok & ~accept  # (no token drawn, when rounding put the target past the row's sum: redraw)
            low = jnp.where(narrow, jnp.where(mid_ok, z_tok, pivot1), low)
            high = jnp.where(narrow & mid_ok, pivot1, high)
            mass = jnp.where(narrow, jnp.where(mid_ok, s0, s1), mass)
            return low, high, mass, tok, accept, r + 1

        init = (jnp.float32(-jnp.inf), zmax, total, jnp.int32(-1), False, jnp.int32(0))
        _, _, _, tok, done, _ = jax.lax.while_loop(cond, body, init)
        out_ref[row] = jnp.where(done, tok, -1)  # -1: take the argmax (rounds exhausted)


def top_k_top_p_sampling(
    logits: Float[Array, "B V"],
    key,
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    *,
    tile: int = 4096,
    num_warps: int = 8,
    interpret: bool = False,
) -> Int[Array, "B"]:
    """One token per row from the top-k/top-p filtered distribution, without sorting (Pallas, Triton).

    Args:
      logits: [B, V] (any float dtype; -inf entries are never drawn).
      key: one PRNG key (rows draw independently) or one key per row [B, 2] / [B] typed keys.
      temperature: [B]; <= 0 means greedy (argmax). top_k: [B] int, 0 or >= V is off.
      top_p: [B] in (0, 1], 1 is off.
      tile: vocabulary elements per pass step (a power of two; smaller for small V). num_warps: per row.
        The defaults were the fastest measured on an H200 (2026-12-04, 64 rows: 2.0-2.6x faster than 1,024 and
        4 at V=49k and 128k; each pass is a loop of steps ending in block-wide reductions, so fewer, wider steps
        pay).
      interpret: run through the Pallas interpreter (CPU tests) instead of Triton.
    Returns [B] int32 token ids.
    """
    check_sampling_args(logits, key, temperature, top_k, top_p)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    return _top_k_top_p_sampling(logits, row_keys(key, logits.shape[0]), temperature, top_k, top_p, tile=tile,
                                 num_warps=num_warps, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tile", "num_warps", "interpret"))
def _top_k_top_p_sampling(logits, keys, temperature, top_k, top_p, *, tile, num_warps, interpret):
    b, v = logits.shape
    tile = min(tile, pl.next_power_of_2(v))
    padded = jnp.pad(logits, ((0, 0), (0, (-v) % tile)), constant_values=-jnp.inf)
    uniforms = jax.vmap(lambda k: 1.0 - jax.random.uniform(k, (MAX_ROUNDS,), jnp.float32))(keys)  # (0, 1]
    kernel = functools.partial(_sampling_kernel, vocab=v, tile=tile)
    drawn = pl.pallas_call(
        kernel,
        grid=(b,),
        out_shape=jax.ShapeDtypeStruct((b,), jnp.int32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="top_k_top_p_rejection_sampling",
    )(padded, temperature.astype(jnp.float32), top_k.astype(jnp.int32), top_p.astype(jnp.float32), uniforms)
    greedy = first_argmax(logits)
    return jnp.where((temperature > 0) & (drawn >= 0), drawn, greedy)
