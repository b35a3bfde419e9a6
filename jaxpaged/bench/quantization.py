"""`bench throughput --compare-quantization int8,gguf,bfloat16`: the workload with the weights as given (the
first run, the reference), then once per entry (a `--quantization` method, a dtype, or `model:PATH`, a quantized
checkpoint of the same model such as an AWQ or GPTQ folder), in one run; the table adds each run's weight memory
and its greedy agreement with the reference.

Agreement, three ways: the share of output positions whose token equals the reference's at that position; the
mean share of each output before its first difference; and teacher-forced, the share of the reference's output
tokens that are the run's own top-1 choice given the reference's tokens before them (each prediction judged on the
same context, so one flip does not change the rest; computed after the timed run, through `prompt_logprobs`). On
random-token prompts the next-token distributions are flat and near-ties common, so one flip changes the rest of
an output: bfloat16 alone (no quantization) is the yardstick for what rounding costs there."""

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


def teacher_forced_agreement(llm, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """The share of `reference`'s output tokens that rank first in `llm`'s distribution after the prompt and the
    reference's tokens before them."""
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([list(p) + list(r[:-1]) for p, r in zip(prompts, reference)], params, use_tqdm=False)
    top = [row[tok].rank == 1 for o, p in zip(outs, prompts)
           for row, tok in zip(o.prompt_logprobs[len(p):], o.prompt_token_ids[len(p):])]
    firsts = [o.outputs[0].token_ids[0] == r[-1] for o, r in zip(outs, reference)]  # (the last reference token)
    return float(np.mean(top + firsts))


def compare_quantization(reqs, engine_args, entries: list[str], temperature: float, run_jaxpaged) -> list[dict]:
    """[the weights as given, then each entry's] on the same workload."""
    prompts = [r.prompt_token_ids for r in reqs]

    def forced(reference):
        return lambda llm, own: {"teacher_forced_agreement": teacher_forced_agreement(llm, prompts,
                                                                                       reference or own)}

    first = run_jaxpaged(reqs, engine_args, label=f"jaxpaged {engine_args.quantization or engine_args.dtype}",
                         temperature=temperature, after=forced(None))
    results = [first]
    for entry in entries:
        if entry.startswith("model:"):  # (a quantized checkpoint of the same model: AWQ, GPTQ, fp8)
            args = dataclasses.replace(engine_args, model=entry[len("model:"):], quantization=None)
        elif entry in DTYPE_ENTRIES:
            args = dataclasses.replace(engine_args, dtype=entry)
        else:
            args = dataclasses.replace(engine_args, quantization=entry)
        results.append(run_jaxpaged(reqs, args, label=f"jaxpaged {entry}", temperature=temperature,
                                    after=forced(first["token_ids"])))
    base = first["output_tokens_per_s"]
    print(f"{'run':<26} {'out tok/s':>10} {'ratio':>6} {'weights MiB':>12} {'pos agree':>10} {'prefix agree':>13} "
          f"{'forced agree':>13}")
    for r in results:
        pos, pre = agreement(r["token_ids"], first["token_ids"])
        r.update(ratio_to_first=r["output_tokens_per_s"] / base, position_agreement=pos, prefix_agreement=pre)
        print(f"{r['backend']:<26} {r['output_tokens_per_s']:>10.1f} {r['ratio_to_first']:>5.2f}x "
              f"{r.get('weight_bytes', 0) / 2**20:>12.0f} {pos:>10.3f} {pre:>13.3f} "
              f"{r['teacher_forced_agreement']:>13.3f}")
    return results
