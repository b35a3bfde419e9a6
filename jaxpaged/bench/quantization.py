"""`bench throughput --compare-quantization int8,gguf,bfloat16`: the workload with the weights as given (the
first run, the reference), then once per entry (a `--quantization` method, or a dtype), in one run; the table adds
each run's weight memory and its greedy agreement with the reference.

Agreement: the share of output positions whose token equals the reference's at that position, and the mean
share of each output before its first difference. On random-token prompts the next-token distributions are flat
and near-ties common, so one flip changes the rest of an output: bfloat16 alone (no quantization) is the yardstick
for what rounding costs there."""

from __future__ import annotations

import dataclasses

import numpy as np

DTYPE_ENTRIES = ("bfloat16", "float16", "float32")


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(position agreement, prefix agreement) of `tokens` with `reference`, each output counted alike."""
    pos, prefix = [], []
    for a, b in zip(tokens, reference):
        a, b = np.asarray(a), np.asarray(b)
        same = a[:len(b)] == b[:len(a)]
        pos.append(float(same.mean()) if len(same) else 1.0)
        prefix.append(float(np.argmin(same)) / len(same) if not same.all() else 1.0)
    return float(np.mean(pos)), float(np.mean(prefix))


def compare_quantization(reqs, engine_args, entries: list[str], temperature: float, run_jaxpaged) -> list[dict]:
    """[the weights as given, then each entry's] on the same workload."""
    first = run_jaxpaged(reqs, engine_args, label=f"jaxpaged {engine_args.quantization or engine_args.dtype}",
                         temperature=temperature)
    results = [first]
    for entry in entries:
        args = (dataclasses.replace(engine_args, dtype=entry) if entry in DTYPE_ENTRIES else
                dataclasses.replace(engine_args, quantization=entry))
        results.append(run_jaxpaged(reqs, args, label=f"jaxpaged {entry}", temperature=temperature))
    base = first["output_tokens_per_s"]
    print(f"{'run':<26} {'out tok/s':>10} {'ratio':>6} {'weights MiB':>12} {'pos agree':>10} {'prefix agree':>13}")
    for r in results:
        pos, pre = agreement(r["token_ids"], first["token_ids"])
        r.update(ratio_to_first=r["output_tokens_per_s"] / base, position_agreement=pos, prefix_agreement=pre)
        print(f"{r['backend']:<26} {r['output_tokens_per_s']:>10.1f} {r['ratio_to_first']:>5.2f}x "
              f"{r.get('weight_bytes', 0) / 2**20:>12.0f} {pos:>10.3f} {pre:>13.3f}")
    return results
