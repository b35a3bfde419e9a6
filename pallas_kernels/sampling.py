"""Top-k / top-p sampling with temperature, per row: a sort-free Pallas kernel and its reference.

Meaning (vLLM's): temperature first; then top-k keeps the k largest logits; then top-p keeps
the smallest set of the remaining (renormalized) distribution whose cumulative probability
reaches p, the crossing token included. k=0 and p=1 mean off; temperature 0 means argmax.

The kernel (`top_k_top_p_sampling`) never sorts the vocabulary. It is FlashInfer's rejection
sampling with dual pivots: draw a token from the mass not yet ruled out; the token is in the kept
set iff fewer than k tokens are more likely and their mass is below p (times the top-k mass); if
not, every token as unlikely is ruled out too, and so is everything below a second pivot halfway
to the most likely token when that pivot also fails. One program per row; each pass over the row
accumulates per lane with no reduction inside its loop, and the draw of the next round comes from
the lane sums of the check pass before it plus one column, so a round is one pass. When top-k and
top-p are both on, the k-th largest logit (for the top-k mass) is found first: the k-th largest lane max bounds
it from below and often is it (checked by one counting pass), then 4 pivots a pass around a guess interpolated
from the counts at the bracket's ends. With row_splits > 1 the first pass (max,
argmax, lane sums: no decision in it) is made by several programs per row in a kernel before, and merged.
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
    runs argmax's paired (value, index) reduction several times slower (docs/benchmarks/design-choices.md)."""
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
    needs_filter: bool | None = None,
) -> Int[Array, "B"]:
    """One token per row; `key` is one PRNG key (rows draw independently) or one key per row [B, 2].
    needs_filter: whether some row filters (known to the caller), or None: decided here (a `lax.cond`)."""
    check_sampling_args(logits, key, temperature, top_k, top_p)
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    greedy_rows = temperature <= 0
    scaled = logits / jnp.where(greedy_rows, 1.0, temperature)[:, None]
    if needs_filter is None:
        filtering = jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0))
        filtered = jax.lax.cond(filtering, top_k_top_p_mask, lambda x, *_: x, scaled, top_k, top_p)
    else:
        filtered = top_k_top_p_mask(scaled, top_k, top_p) if needs_filter else scaled
    weights = jnp.exp(filtered - filtered.max(axis=-1, keepdims=True))
    u = 1.0 - jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(row_keys(key, b))  # (0, 1]
    sampled = categorical_from_uniform(weights, u)
    return jnp.where(greedy_rows, first_argmax(logits), sampled).astype(jnp.int32)


MAX_ROUNDS = 32  # rejection rounds before falling back to the argmax (always in the kept set)
SEARCH_PASSES = 40  # for the k-th largest logit (top-k and top-p both on): 4 pivots a pass, the bracket at
GUESS_WIDTH = 0.02  # least halved each; two pivots this fraction of it either side of an interpolated guess
LANE_BISECTIONS = 16  # steps of the bisection for the k-th largest lane max (in registers, no pass over the row)


def _row_sweep(logits_ref, row, vocab: int, tile: int, inv_t):
    """sweep(fn, init, lo, hi) over one row of logits_ref [B, V]: fn(z, i, carry) folded over tiles [lo, hi), z
    tile i's [tile] scaled logits (-inf past the vocabulary), the next tile's load issued before this one's
    work."""
    width = logits_ref.shape[1]  # vocab, or padded to a multiple of tile (the interpreter's input)
    num_tiles = pl.cdiv(vocab, tile)
    lane = jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)

    def load_tile(i):
        if width % tile == 0:  # (a padded row's padding is -inf; the interpreter is slow with masked loads)
            x = logits_ref[row, pl.ds(i * tile, tile)]
        else:
            x = plgpu.load(logits_ref.at[row, pl.ds(i * tile, tile)], mask=i * tile + lane < vocab, other=-jnp.inf)
        return x.astype(jnp.float32) * inv_t

    def sweep(fn, init, lo=0, hi=num_tiles):
        def body(i, c):
            z, carry = c
            return load_tile(jnp.minimum(i + 1, hi - 1)), fn(z, i, carry)  # (no tile past hi: another part's)

        return jax.lax.fori_loop(lo, hi, body, (load_tile(jnp.minimum(lo, num_tiles - 1)), init))[1]

    return sweep


def _row_stats(sweep, vocab: int, tile: int, lo=0, hi=None):  # (hi None: the row's end)
    """One pass over tiles [lo, hi) of a row: (max, first argmax (vocab if none), per-lane mass [tile] as
    sum exp(z - max), smallest finite logit, count of finite logits, per-lane max [tile])."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)

    def stats(z, i, c):  # per lane: running max, sum of exp below it, first argmax, finite min and count
        m, s, arg, zmin, nfin = c
        hi_, lo_ = jnp.maximum(m, z), jnp.minimum(m, z)
        e = jnp.exp(lo_ - jnp.where(hi_ > -jnp.inf, hi_, 0.0))  # exp(-|z - m|); 0 while the lane saw only -inf
        up = z > m
        finite = z > -jnp.inf
        return (hi_, jnp.where(up, s * e + 1.0, s + e), jnp.where(up, i * tile + lane, arg),
                jnp.where(finite, jnp.minimum(zmin, z), zmin), nfin + finite.astype(jnp.int32))

    init = (jnp.full((tile,), -jnp.inf, jnp.float32), jnp.zeros((tile,), jnp.float32),
            jnp.full((tile,), vocab, jnp.int32), jnp.full((tile,), jnp.inf, jnp.float32),
            jnp.zeros((tile,), jnp.int32))
    m, s, arg, zmin, nfin = sweep(stats, init, lo, pl.cdiv(vocab, tile) if hi is None else hi)
    zmax = jnp.max(m)
    argmax = jnp.min(jnp.where(m == zmax, arg, vocab))
    lane_w = jnp.where(m > -jnp.inf, s * jnp.exp(jnp.where(m > -jnp.inf, m - zmax, 0.0)), 0.0)
    return zmax, argmax, lane_w, jnp.min(zmin), jnp.sum(nfin), m


def _row_part_stats_kernel(logits_ref, temperature_ref, w_ref, lane_max_ref, max_ref, arg_ref, min_ref, count_ref, *,
                           vocab: int, tile: int, parts: int):
    """Program (row, part): `_row_stats` over part pl.program_id(1) of `parts` runs of the row's tiles, written
    to w_ref and lane_max_ref [B, parts, tile] and max/arg/min/count_ref [B, parts] (merged by
    `_sampling_kernel`)."""
    row, part = pl.program_id(0), pl.program_id(1)
    temp = temperature_ref[row]
    sweep = _row_sweep(logits_ref, row, vocab, tile, 1.0 / jnp.where(temp > 0, temp, 1.0))
    per = pl.cdiv(pl.cdiv(vocab, tile), parts)
    lo = part * per
    zmax, argmax, lane_w, zmin, nfin, lane_max = _row_stats(sweep, vocab, tile, lo,
                                                            jnp.minimum(lo + per, pl.cdiv(vocab, tile)))
    w_ref[row, part, :] = lane_w
    lane_max_ref[row, part, :] = lane_max
    max_ref[row, part] = zmax
    arg_ref[row, part] = argmax
    min_ref[row, part] = zmin
    count_ref[row, part] = nfin


def _sampling_kernel(logits_ref, temperature_ref, top_k_ref, top_p_ref, uniforms_ref, *refs, vocab: int,
                     tile: int, parts: int):
    """One row: pl.program_id(0). logits_ref [B, V], uniforms_ref [B, MAX_ROUNDS]; refs: out_ref [B], or with
    parts > 1 the first pass's results from `_row_part_stats_kernel` (w, max, arg, min, count) then out_ref.

    Every pass over the row accumulates per lane (a lane: one position of the tile, so tokens j, j + tile, ...)
    with no reduction inside its loop, and loads the next tile before working on this one; the lanes are reduced
    once at the end. A draw picks a lane from the lane sums of the previous pass, then the token within that
    lane's column (one gathered load of V / tile logits): each rejection round is one pass over the row.
    """
    row = pl.program_id(0)
    out_ref = refs[-1]
    width = logits_ref.shape[1]  # vocab, or padded to a multiple of tile (the interpreter's input)
    num_tiles = pl.cdiv(vocab, tile)
    col_len = pl.next_power_of_2(num_tiles)
    lane = jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)
    temp = temperature_ref[row]
    inv_t = 1.0 / jnp.where(temp > 0, temp, 1.0)
    sweep = _row_sweep(logits_ref, row, vocab, tile, inv_t)
    if parts > 1:  # the first pass, done by `parts` programs: merged
        w_ref, lane_max_ref, max_ref, arg_ref, min_ref, count_ref, _ = refs
        part_max = max_ref[row, :]  # [parts]
        zmax = jnp.max(part_max)
        weight = jnp.where(part_max > -jnp.inf, jnp.exp(jnp.where(part_max > -jnp.inf, part_max - zmax, 0.0)), 0.0)
        lane_w = jnp.sum(w_ref[row, :, :] * weight[:, None], axis=0)  # [tile]
        argmax = jnp.min(jnp.where(part_max == zmax, arg_ref[row, :], vocab))
        zmin, nfin = jnp.min(min_ref[row, :]), jnp.sum(count_ref[row, :])
        lane_max = jnp.max(lane_max_ref[row, :, :], axis=0)  # [tile]
    else:
        zmax, argmax, lane_w, zmin, nfin, lane_max = _row_stats(sweep, vocab, tile)
    zeros_f, zeros_i = jnp.zeros((tile,), jnp.float32), jnp.zeros((tile,), jnp.int32)
    out_ref[row] = jnp.where(argmax < vocab, argmax, 0)  # greedy rows, and rows whose rounds run out

    @pl.when(temp > 0)
    def _():
        total = jnp.sum(lane_w)
        k, p = top_k_ref[row], top_p_ref[row]
        k_on = (k > 0) & (k < vocab)
        k = jnp.where(k_on, k, vocab + 1)

        def kth_largest():  # a threshold keeping exactly the k largest (their ties too): 4 pivots a pass
            def cond(c):
                *_, done, moved, it = c
                return ~done & moved & (it < SEARCH_PASSES)

            def body(c):  # count(lo) >= k > count(hi) throughout
                lo, hi, c_lo, c_hi, _, _, _, it = c
                # Where log(count) would cross log(k) were it linear in the logit between lo and hi (a tail's
                # counts fall about exponentially): two pivots close around it, two halfway to each end (so the
                # bracket at least halves however wrong the guess).
                guess = (jnp.log(c_lo) - jnp.log(k.astype(jnp.float32))) / (
                    jnp.log(c_lo) - jnp.log(jnp.maximum(c_hi, 0.5)))
                guess = jnp.clip(guess, 2 * GUESS_WIDTH, 1 - 2 * GUESS_WIDTH)
                fractions = (guess / 2, guess - GUESS_WIDTH, guess + GUESS_WIDTH, (1 + guess) / 2)
                pivots = [lo + (hi - lo) * fr for fr in fractions]

                def count(z, _, cs):
                    return tuple(cj + (z >= t).astype(jnp.int32) for cj, t in zip(cs, pivots))

                counts = [jnp.sum(c) for c in sweep(count, (zeros_i,) * len(pivots))]
                new_lo, new_hi, new_c_lo, new_c_hi, hit, found = lo, hi, c_lo, c_hi, lo, False
                for t, n in zip(pivots, counts):  # (the pivots in any order)
                    up, down = (n >= k) & (t > new_lo), (n < k) & (t < new_hi)
                    new_lo, new_c_lo = jnp.where(up, t, new_lo), jnp.where(up, n.astype(jnp.float32), new_c_lo)
                    new_hi, new_c_hi = jnp.where(down, t, new_hi), jnp.where(down, n.astype(jnp.float32), new_c_hi)
                    hit = jnp.where(~found & (n == k), t, hit)
                    found = found | (n == k)
                moved = (new_lo != lo) | (new_hi != hi)
                return new_lo, new_hi, new_c_lo, new_c_hi, hit, found, moved, it + 1

            hi0 = zmax + jnp.maximum(1.0, jnp.abs(zmax) * 1e-3)  # above every logit: count 0 < k
            # The k-th largest lane max is a lower bound with count >= k, and often the answer: the k largest
            # logits in k different lanes (a numpy simulation, 128k logits, k = 50: 22 of 30 rows; passes 4.1-4.6
            # -> 1.7-1.8 on average). Found by bisection over the lanes (no pass over the row), then snapped to
            # the lane max there; one counting pass checks it.
            finite_lane = lane_max > -jnp.inf
            use_lanes = k <= jnp.sum(finite_lane.astype(jnp.int32))

            def bisect(_, c):  # count_lanes(>= lo) >= k > count_lanes(>= hi)
                lo, hi = c
                mid = (lo + hi) / 2
                up = jnp.sum((lane_max >= mid).astype(jnp.int32)) >= k
                return jnp.where(up, mid, lo), jnp.where(up, hi, mid)

            lane_lo, _ = jax.lax.fori_loop(0, LANE_BISECTIONS, bisect,
                                           (jnp.min(jnp.where(finite_lane, lane_max, jnp.inf)), hi0))
            bound = jnp.min(jnp.where(lane_max >= lane_lo, lane_max, jnp.inf))

            def count_at_bound():  # tokens >= the bound, and > it: the bound is the k-th value itself (ties
                # and all) when fewer than k are above it
                ge, gt = sweep(lambda z, _, c: (c[0] + (z >= bound).astype(jnp.int32),
                                                c[1] + (z > bound).astype(jnp.int32)), (zeros_i, zeros_i))
                return jnp.sum(ge), jnp.sum(gt)

            c_bound, c_above = jax.lax.cond(use_lanes, count_at_bound, lambda: (nfin, nfin))
            lo0 = jnp.where(use_lanes, bound, zmin)
            found0 = use_lanes & (c_above < k)
            init = (lo0, hi0, c_bound.astype(jnp.float32), nfin.astype(jnp.float32) * 0.0, lo0, found0, True,
                    jnp.int32(0))
            lo, _, _, _, hit, found, _, _ = jax.lax.while_loop(cond, body, init)
            return jnp.where(found, hit, lo)  # (not found: lo holds the k-th value and its ties)

        search = k_on & (p < 1.0) & (nfin > k)
        t_k = jnp.where(search, jax.lax.cond(search, kth_largest, lambda: zmax), -jnp.inf)  # (Triton: no literal
        # branch results)

        def draw(lane_mass, low, r):  # inverse CDF over tokens with z > low, lanes first; -1 if none
            cum = jnp.cumsum(lane_mass)
            target = uniforms_ref[row, r] * jnp.max(cum)
            j = jnp.minimum(jnp.sum((cum < target).astype(jnp.int32)), tile - 1)
            before = jnp.sum(jnp.where(lane == j - 1, cum, 0.0))
            idx = jax.lax.broadcasted_iota(jnp.int32, (col_len,), 0)
            pos = j + idx * tile
            col = logits_ref[row, jnp.minimum(pos, width - 1)].astype(jnp.float32) * inv_t
            col = jnp.where(pos < vocab, col, -jnp.inf)  # [col_len]: lane j's column
            w = jnp.where(col > low, jnp.exp(col - zmax), 0.0)
            last = jnp.max(jnp.where(w > 0, idx, -1))
            i = jnp.minimum(jnp.sum((before + jnp.cumsum(w) < target).astype(jnp.int32)), last)
            return jnp.where(i >= 0, j + i * tile, -1), jnp.max(jnp.where(idx == i, col, -jnp.inf))

        def aggregate(p0, p1):  # per pivot, count and lane masses strictly above; the top-k mass
            def step(z, _, c):
                c0, l0, c1, l1, mk = c
                w = jnp.exp(z - zmax)
                a0, a1 = z > p0, z > p1
                return (c0 + a0.astype(jnp.int32), l0 + jnp.where(a0, w, 0.0), c1 + a1.astype(jnp.int32),
                        l1 + jnp.where(a1, w, 0.0), mk + jnp.where(z >= t_k, w, 0.0))

            c0, l0, c1, l1, mk = sweep(step, (zeros_i, zeros_f, zeros_i, zeros_f, zeros_f))
            return jnp.sum(c0), l0, jnp.sum(c1), l1, jnp.sum(mk)

        check = k_on | (p < 1.0)  # (neither: the first draw is kept)

        def cond(c):
            _, _, _, _, done, r = c
            return (~done) & (r < MAX_ROUNDS)

        def body(c):
            low, high, lane_mass, _, _, r = c
            tok, z_tok = draw(lane_mass, low, r)
            ok = tok >= 0
            z_tok = jnp.where(ok, z_tok, high)
            pivot1 = (z_tok + high) / 2
            c0, l0, c1, l1, mk = jax.lax.cond(check & ok, aggregate, lambda *_: (
                nfin * 0, lane_mass * 0.0, nfin * 0, lane_mass * 0.0, total * 0.0), z_tok, pivot1)
            s0, s1 = jnp.sum(l0), jnp.sum(l1)
            p_mass = jnp.where(p < 1.0, p * mk, jnp.inf)  # top-p bound on the mass above a kept token
            accept = ok & (c0 < k) & (s0 < p_mass)
            mid_ok = (c1 < k) & (s1 < p_mass)
            narrow = ok & ~accept  # (no token drawn, when rounding put the target past the row's sum: redraw)
            low = jnp.where(narrow, jnp.where(mid_ok, z_tok, pivot1), low)
            high = jnp.where(narrow & mid_ok, pivot1, high)
            lane_mass = jnp.where(narrow, jnp.where(mid_ok, l0, l1), lane_mass)
            return low, high, lane_mass, tok, accept, r + 1

        init = (jnp.float32(-jnp.inf), zmax, lane_w, jnp.int32(-1), False, jnp.int32(0))
        _, _, _, tok, done, _ = jax.lax.while_loop(cond, body, init)

        @pl.when(done)
        def _():
            out_ref[row] = tok


def top_k_top_p_sampling(
    logits: Float[Array, "B V"],
    key,
    temperature: Float[Array, "B"],
    top_k: Int[Array, "B"],
    top_p: Float[Array, "B"],
    *,
    tile: int = 4096,
    num_warps: int = 16,
    row_splits: int = 1,
    interpret: bool = False,
) -> Int[Array, "B"]:
    """One token per row from the top-k/top-p filtered distribution, without sorting (Pallas, Triton).

    Args:
      logits: [B, V] (any float dtype; -inf entries are never drawn).
      key: one PRNG key (rows draw independently) or one key per row [B, 2] / [B] typed keys.
      temperature: [B]; <= 0 means greedy (argmax). top_k: [B] int, 0 or >= V is off.
      top_p: [B] in (0, 1], 1 is off.
      tile: lanes, vocabulary elements per step of a pass (a power of two; smaller for small V). num_warps: per
        row. The defaults were the fastest measured on an H200 (2026-12-04, 64 rows of 49k and 128k logits,
        against 2,048-8,192 lanes and 4-32 warps: README).
      row_splits: programs per row for the first pass (max, argmax, lane sums: no decision in it), a power of two;
        their results merged by the row's program, which makes the other passes. 1: that program makes the first
        pass too. (64 rows keep 64 of an H200's 132 SMs busy, each on one row's pass.)
      interpret: run through the Pallas interpreter (CPU tests) instead of Triton.
    Returns [B] int32 token ids.
    """
    check_sampling_args(logits, key, temperature, top_k, top_p)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if row_splits < 1 or row_splits & (row_splits - 1):
        raise ValueError(f"row_splits must be a power of two >= 1, got {row_splits}")
    return _top_k_top_p_sampling(logits, row_keys(key, logits.shape[0]), temperature, top_k, top_p, tile=tile,
                                 num_warps=num_warps, row_splits=row_splits, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("tile", "num_warps", "row_splits", "interpret"))
def _top_k_top_p_sampling(logits, keys, temperature, top_k, top_p, *, tile, num_warps, row_splits, interpret):
    b, v = logits.shape
    tile = min(tile, pl.next_power_of_2(v))
    parts = min(row_splits, pl.next_power_of_2(pl.cdiv(v, tile)))  # (no more parts than tiles, rounded up)
    uniforms = jax.vmap(lambda k: 1.0 - jax.random.uniform(k, (MAX_ROUNDS,), jnp.float32))(keys)  # (0, 1]
    if interpret:  # (masked loads are slow in the interpreter; on a GPU they cost nothing, a padded copy does)
        logits = jnp.pad(logits, ((0, 0), (0, (-v) % tile)), constant_values=-jnp.inf)
    temperature = temperature.astype(jnp.float32)
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    first_pass = ()
    if parts > 1:  # [B, parts, tile] lane sums and maxima, [B, parts] max / argmax / finite min / finite count
        first_pass = pl.pallas_call(
            functools.partial(_row_part_stats_kernel, vocab=v, tile=tile, parts=parts),
            grid=(b, parts),
            out_shape=(jax.ShapeDtypeStruct((b, parts, tile), jnp.float32),
                       jax.ShapeDtypeStruct((b, parts, tile), jnp.float32),
                       jax.ShapeDtypeStruct((b, parts), jnp.float32), jax.ShapeDtypeStruct((b, parts), jnp.int32),
                       jax.ShapeDtypeStruct((b, parts), jnp.float32), jax.ShapeDtypeStruct((b, parts), jnp.int32)),
            compiler_params=params,
            interpret=interpret,
            name=f"top_k_top_p_first_pass_{parts}_parts",
        )(logits, temperature)
    return pl.pallas_call(
        functools.partial(_sampling_kernel, vocab=v, tile=tile, parts=parts),
        grid=(b,),
        out_shape=jax.ShapeDtypeStruct((b,), jnp.int32),
        compiler_params=params,
        interpret=interpret,
        name="top_k_top_p_rejection_sampling",
    )(logits, temperature, top_k.astype(jnp.int32), top_p.astype(jnp.float32), uniforms, *first_pass)
