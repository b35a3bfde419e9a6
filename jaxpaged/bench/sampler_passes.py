"""Passes over a row that the Pallas sampler's k-th-largest search makes (top-k and top-p both on), counted by
a numpy mirror of its loop in `pallas_kernels/sampling.py`: from the row's smallest logit (before 2026-12-05)
against from the k-th largest lane max (now). A pass over 128k logits costs one program ~25-40 us on an H200
(README), so passes are what the search costs. Prints a table and writes JSON:
`python -m jaxpaged.bench.sampler_passes [--rows 30] [--output sampler_passes.json]`."""

from __future__ import annotations

import argparse

import numpy as np

from jaxpaged.bench.report import write_json
from pallas_kernels.sampling import GUESS_WIDTH, LANE_BISECTIONS, SEARCH_PASSES

ROWS = {  # name -> one row of scaled logits (temperature applied)
    "normal x 3 / 0.8": lambda rng, v: rng.normal(size=v).astype(np.float32) * 3 / 0.8,
    "heavy-tailed (t, 3 dof) x 2": lambda rng, v: (rng.standard_t(3, size=v) * 2).astype(np.float32),
    "normal x 3, bf16-rounded (ties)": lambda rng, v: _bf16(rng.normal(size=v).astype(np.float32) * 3),
}


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16's 8 bits of mantissa (to nearest even), as float32."""
    bits = x.view(np.uint32)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def search_passes(z: np.ndarray, k: int, lo: float, c_lo: int, passes: int = 0) -> int:
    """The kernel's `kth_largest` loop from bracket [lo, above the max) with count(z >= lo) = c_lo: its passes."""
    zmax = float(z.max())
    hi, c_hi, found, moved = zmax + max(1.0, abs(zmax) * 1e-3), 0, c_lo == k, True
    while not found and moved and passes < SEARCH_PASSES:
        guess = (np.log(c_lo) - np.log(k)) / (np.log(c_lo) - np.log(max(c_hi, 0.5)))
        guess = float(np.clip(guess, 2 * GUESS_WIDTH, 1 - 2 * GUESS_WIDTH))
        pivots = [np.float32(lo + (hi - lo) * f) for f in (guess / 2, guess - GUESS_WIDTH, guess + GUESS_WIDTH,
                                                          (1 + guess) / 2)]
        counts = [int((z >= t).sum()) for t in pivots]
        passes += 1
        new = (lo, hi, c_lo, c_hi)
        for t, n in zip(pivots, counts):
            if n >= k and t > new[0]:
                new = (t, new[1], n, new[3])
            if n < k and t < new[1]:
                new = (new[0], t, new[2], n)
            found |= n == k
        moved = new[:2] != (lo, hi)
        lo, hi, c_lo, c_hi = new
    return passes


def lane_bound(z: np.ndarray, k: int, tile: int) -> float:
    """The kernel's lower bound: the k-th largest lane max (bisection over the lanes, snapped to a lane's max)."""
    lane_max = np.concatenate([z, np.full((-len(z)) % tile, -np.inf, np.float32)]).reshape(-1, tile).max(0)
    zmax = float(z.max())
    lo, hi = float(lane_max[np.isfinite(lane_max)].min()), zmax + max(1.0, abs(zmax) * 1e-3)
    for _ in range(LANE_BISECTIONS):
        mid = np.float32((lo + hi) / 2)
        lo, hi = (mid, hi) if (lane_max >= mid).sum() >= k else (lo, mid)
    return float(lane_max[lane_max >= lo].min())


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=30, help="random rows per case")
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--tile", type=int, default=4096, help="the kernel's lanes")
    ap.add_argument("--output", default=None, help="JSON file for the rows (default: none)")
    ns = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'logits':<34}{'k':>6}{'passes before (mean, max)':>28}{'now (mean, max)':>18}{'bound exact':>13}")
    for name, make in ROWS.items():
        for k in (5, 50, 1000):
            before, now, exact = [], [], 0
            for _ in range(ns.rows):
                z = make(rng, ns.vocab)
                before.append(search_passes(z, k, float(z.min()), len(z)))
                bound = lane_bound(z, k, ns.tile)
                c, above = int((z >= bound).sum()), int((z > bound).sum())
                exact += above < k  # (the bound is the k-th value, ties and all)
                now.append(1 if above < k else search_passes(z, k, bound, c, passes=1))  # (1: the counting pass)
            row = {"logits": name, "k": k, "vocab": ns.vocab, "tile": ns.tile, "rows": ns.rows,
                   "passes_before_mean": float(np.mean(before)), "passes_before_max": max(before),
                   "passes_now_mean": float(np.mean(now)), "passes_now_max": max(now), "bound_exact": exact}
            rows.append(row)
            print(f"{name:<34}{k:>6}{np.mean(before):>20.1f}, {max(before):>5}{np.mean(now):>11.1f}, {max(now):>4}"
                  f"{exact:>9} / {ns.rows}")
    write_json({"rows": rows}, ns.output)
    return rows


if __name__ == "__main__":
    main()
