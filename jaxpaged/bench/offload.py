"""Time to first token for a returning prefix after the device pool evicted it: recomputed, loaded from the host
tier, from the disk tier, and from the disk tier by a restarted engine.

    jaxpaged bench throughput --shared-prefix 2048:16 --compare-offload

Each mode: an engine whose pool holds about one request; the prefix's first request, then two filler prompts
as long as the prefix (random tokens) that push it out of the device pool (and out of the host tier's staging
slots in the disk mode), then the prefix again with another suffix, one output token: its wall time is the
TTFT. The restart mode is a new engine over the disk mode's folder, asked the returning request first.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time

import numpy as np

from jaxpaged.engine.arg_utils import EngineArgs


def _ttft(llm, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first (greedy) token of `prompt`, and that token."""
    from jaxpaged import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0, out[0].outputs[0].token_ids[0]


def compare_offload(engine_args: EngineArgs, prefix: list[int], suffix_len: int, vocab: np.ndarray,
                    seed: int) -> list[dict]:
    """Rows of mode, TTFT (s), speedup over recompute, blocks loaded per tier and bytes."""
    from jaxpaged import LLM

    rng = np.random.default_rng(seed + 1)
    first, returning = (prefix + rng.choice(vocab, size=suffix_len).tolist() for _ in range(2))
    fillers = [rng.choice(vocab, size=len(prefix)).tolist() for _ in range(2)]
    bs = engine_args.block_size
    blocks = -(-(len(prefix) + suffix_len + 1) // bs) + 2  # one request's worth: each filler evicts the prefix
    folder = tempfile.mkdtemp(prefix="jaxpaged-kv-offload-")
    # (max_model_len sizes the disk mode's host staging slots: one prompt's worth, so the fillers evict it there)
    base = dataclasses.replace(engine_args, num_kv_blocks=blocks, max_model_len=len(prefix) + suffix_len + 2)
    rows: list[dict] = []
    host_gb = 0.0
    for name in ("recompute", "host tier", "disk tier", "disk tier after restart"):
        extra = ({"kv_offload_host_gb": host_gb} if name == "host tier"  # room for the prefix and both fillers
                 else {"kv_offload_dir": folder} if name.startswith("disk") else {})
        llm = LLM(**vars(dataclasses.replace(base, **extra)))
        llm.engine.wait_for_steps()  # (a step still loading in the background would be in the first TTFT)
        host_gb = host_gb or 4 * llm.engine.core.runner.kv_pool.nbytes / 2**30
        cold = None
        if name != "disk tier after restart":
            cold = _ttft(llm, first)[0]
            for f in fillers:
                _ttft(llm, f)
            llm.engine.flush_kv_offload()
        offload = llm.engine.core.offload
        before = offload.stats() if offload else {}
        ttft, token = _ttft(llm, returning)
        after = offload.stats() if offload else {}
        llm.engine.flush_kv_offload()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("host_hit_blocks", "disk_hit_blocks",
                                                                 "disk_read_bytes", "host_loaded_bytes")}
        rows.append({"mode": name, "ttft_s": ttft, "cold_ttft_s": cold, "first_token": token, **delta,
                     "prefix_len": len(prefix), "suffix_len": suffix_len, "num_kv_blocks": blocks,
                     "kv_offload": extra})
        del llm
    for r in rows:
        r["speedup_vs_recompute"] = rows[0]["ttft_s"] / r["ttft_s"]
    print(f"\nReturning {len(prefix)}-token prefix + {suffix_len}-token suffix after eviction from a "
          f"{blocks}-block pool (block size {bs}):")
    print(f"{'mode':>24} | {'TTFT s':>8} | {'vs recompute':>12} | {'host blocks':>11} | {'disk blocks':>11} | "
          f"{'MiB read from disk':>18}")
    for r in rows:
        print(f"{r['mode']:>24} | {r['ttft_s']:8.3f} | {r['speedup_vs_recompute']:11.2f}x | "
              f"{r['host_hit_blocks']:>11} | {r['disk_hit_blocks']:>11} | {r['disk_read_bytes'] / 2**20:18.1f}")
    same = len({r["first_token"] for r in rows}) == 1
    print(f"returning prompt's greedy first token equal in every mode: {same}")
    for r in rows:
        r["first_tokens_equal"] = same
    return rows
