"""Offline throughput: jaxpaged vs HF transformers static batching on the same seeded workload.

    jaxpaged bench throughput --num-prompts 64 --input-len 16:512 --output-len 16:256 --compare hf
    python -m jaxpaged.bench.throughput ...   (the same)

Prints a table and writes JSON (--output-json).
"""

from __future__ import annotations

import argparse
import logging
import time

from jaxpaged.bench.report import print_table, summarize, write_json
from jaxpaged.bench.workload import (
    BenchRequest,
    copy_workload,
    parse_range,
    random_token_workload,
    shared_prefix_workload,
)
from jaxpaged.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)


# The constraint of --compare-structured: JSON arrays of strings, open-ended enough for any output length.
STRUCTURED_SCHEMA = {"type": "array", "items": {"type": "string"}}


def run_jaxpaged(reqs: list[BenchRequest], engine_args: EngineArgs, n: int = 1, label: str = "jaxpaged",
                 temperature: float = 1.0, structured_fraction: float = 0.0, profile_dir: str | None = None,
                 lora_requests: list | None = None, after=None) -> dict:
    """Generate the workload with `LLM.generate` (EOS ignored, n samples each); the first `structured_fraction`
    of every ten requests constrained to STRUCTURED_SCHEMA. profile_dir: a JAX profiler trace of the timed run
    written there (device kernels and host threads, for TensorBoard's profile plugin or xprof). lora_requests: each
    request's LoRA adapter (None: the base model). after(llm, token_ids): more fields for the result, computed
    after the timed run with its engine (`bench/quantization.py`'s teacher-forced agreement)."""
    import contextlib

    import jax

    from jaxpaged import LLM, SamplingParams, StructuredOutputsParams

    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    llm.engine.wait_for_steps()  # (the step cache's background loads: in warmup, not the timed run)
    warmup = time.perf_counter() - t0
    constraint = StructuredOutputsParams(json=STRUCTURED_SCHEMA)
    params = [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=r.output_len, ignore_eos=True, n=n,
                             seed=i, structured_outputs=constraint if i % 10 < 10 * structured_fraction else None)
              for i, r in enumerate(reqs)]
    with jax.profiler.trace(profile_dir) if profile_dir else contextlib.nullcontext():
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt_token_ids for r in reqs], params, lora_request=lora_requests)
        wall = time.perf_counter() - t0
    got = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert got == n * sum(r.output_len for r in reqs), "jaxpaged generated a different number of tokens"
    eng = llm.engine
    kvs = [core.kv_cache_manager for core in eng.core.replicas]  # (data parallelism: every replica's)
    result = summarize(label, reqs, wall, warmup, peak_kv_blocks_used=eng.stats.peak_kv_blocks_used,
                       kv_blocks_total=(eng.config.cache_config.num_blocks - 1) * len(kvs),
                       num_steps=eng.stats.num_steps, compile_s=eng.warmup_seconds, n=n,
                       prefix_cache_hit_tokens=sum(kv.num_hit_tokens for kv in kvs),
                       prefix_cache_queried_tokens=sum(kv.num_queried_tokens for kv in kvs),
                       async_scheduling=eng.core.async_scheduling)
    if eng.config.speculative is not None:
        st = eng.stats
        result.update(speculative_config=vars(eng.config.speculative), spec_num_drafts=st.spec_num_drafts,
                      spec_num_draft_tokens=st.spec_num_draft_tokens,
                      spec_num_accepted_tokens=st.spec_num_accepted_tokens,
                      spec_mean_acceptance_length=st.mean_acceptance_length,
                      spec_draft_acceptance_rate=st.spec_num_accepted_tokens / max(st.spec_num_draft_tokens, 1))
    if structured_fraction:
        so = eng.structured
        result.update(structured_fraction=structured_fraction, mask_rows=so.mask_rows,
                      mask_us_per_row=1e6 * so.mask_seconds / max(so.mask_rows, 1),
                      mask_share_of_wall=so.mask_seconds / wall)
    result["token_ids"] = [o.outputs[0].token_ids for o in outs]
    result["weight_bytes"] = getattr(eng, "param_bytes", 0)
    if after is not None:
        result.update(after(llm, result["token_ids"]))
    if n > 1:  # every sample's tokens count as output
        result["output_tokens"] *= n
        result["output_tokens_per_s"] *= n
    return result


def run_beam_search(reqs: list[BenchRequest], engine_args: EngineArgs, width: int, max_tokens: int,
                    label: str) -> dict:
    """Beam search (width beams, max_tokens each, EOS ignored) over the workload's prompts."""
    from jaxpaged import LLM, BeamSearchParams

    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    llm.engine.wait_for_steps()  # (the step cache's background loads: in warmup, not the timed run)
    warmup = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.beam_search([r.prompt_token_ids for r in reqs],
                           BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    eng = llm.engine
    result = summarize(label, reqs, wall, warmup, peak_kv_blocks_used=eng.stats.peak_kv_blocks_used,
                       kv_blocks_total=(eng.config.cache_config.num_blocks - 1) * len(eng.core.replicas),
                       num_steps=eng.stats.num_steps, beam_width=width,
                       cow_copies=sum(core.kv_cache_manager.num_cow_copies for core in eng.core.replicas))
    result["output_tokens"] = sum(len(s.tokens) - len(r.prompt_token_ids) for r, o in zip(reqs, outs)
                                  for s in o.sequences)
    result["output_tokens_per_s"] = result["output_tokens"] / wall
    return result


def run_hf(reqs: list[BenchRequest], model_path: str, batch_size: int, temperature: float = 1.0,
           load_format: str = "auto", dtype: str = "float32") -> dict:
    """HF transformers `generate` in static batches: left padding, each batch runs to its longest output."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from jaxpaged.models.registry import is_gguf

    t0 = time.perf_counter()
    kw = {"gguf_file": os.path.basename(model_path)} if is_gguf(model_path) else {}
    folder = os.path.dirname(model_path) if kw else model_path
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if load_format == "dummy":
        from transformers import AutoConfig

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").to(device).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), **kw).to(device).eval()
    warmup = time.perf_counter() - t0
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    for i in tqdm(range(0, len(reqs), batch_size), desc="HF static batches"):
        batch = reqs[i : i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        n = max(r.output_len for r in batch)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(
            do_sample=False)
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0, **sampling)
        assert out.shape[1] == width + n
    wall = time.perf_counter() - t0
    return summarize("hf", reqs, wall, warmup, hf_batch_size=batch_size, dtype=dtype)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="16:512", help="N or LO:HI (uniform, inclusive)")
    p.add_argument("--output-len", default="16:256", help="N or LO:HI (uniform, inclusive)")
    p.add_argument("--backend", choices=["jaxpaged", "hf"], default="jaxpaged")
    p.add_argument("--compare", choices=["hf", "vllm"], default=None,
                   help="also run HF static batching or vLLM (--vllm-python), print the ratio")
    p.add_argument("--hf-batch-size", type=int, default=None, help="HF static batch size (default: max_num_seqs)")
    p.add_argument("--shared-prefix", default=None, metavar="PREFIX:SUFFIX",
                   help="shared-prefix workload: every prompt is one PREFIX-token prefix + a SUFFIX-token suffix "
                        "(output length: the upper end of --output-len)")
    p.add_argument("--compare-prefix-caching", action="store_true",
                   help="run jaxpaged with prefix caching on and off, and print the ratio")
    p.add_argument("--compare-offload", action="store_true",
                   help="with --shared-prefix: time to first token of the prefix returning after the device pool "
                        "evicted it, recomputed vs from the host tier vs the disk tier vs after a restart")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (parallel sampling)")
    p.add_argument("--beam-width", type=int, default=None,
                   help="beam search with this many beams per prompt (max_tokens: the upper end of --output-len)")
    p.add_argument("--compare-sharing", action="store_true",
                   help="run jaxpaged with KV sharing (forked blocks, prefix caching) and without, and compare "
                        "peak KV blocks")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default: %(default)s)")
    p.add_argument("--compare-async", action="store_true",
                   help="run jaxpaged with async scheduling off and on, and compare")
    p.add_argument("--compare-structured", type=float, default=None, metavar="FRACTION",
                   help="run jaxpaged with no request constrained, then with FRACTION of them constrained to a "
                        "JSON schema (structured output), and compare; reports the host mask cost")
    p.add_argument("--compare-speculative", default=None, metavar="JSON",
                   help="run jaxpaged without, then with this speculative_config (e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4}'), and compare; reports the mean acceptance length")
    p.add_argument("--compare-lora", type=int, default=None, metavar="N",
                   help="the workload over N random LoRA adapters and the base model, against the base model alone")
    p.add_argument("--lora-rank", type=int, default=16, help="with --compare-lora: the adapters' rank")
    p.add_argument("--compare-quantization", default=None, metavar="LIST",
                   help="run jaxpaged as given, then once per comma-separated entry (a --quantization method: int8, "
                        "fp8, gguf; a dtype: bfloat16; or model:PATH, an AWQ / GPTQ / fp8 checkpoint of the same "
                        "model), and compare throughput, weight memory and greedy agreement (by position, prefix "
                        "and teacher-forced) with the first")
    p.add_argument("--workload", choices=["random", "copy"], default="random",
                   help="random: random-token prompts (--input-len, --output-len); copy: chat prompts asking to "
                        "repeat a paragraph word for word (output: its length, capped by the upper --output-len)")
    p.add_argument("--vllm-python", default=None,
                   help="with --compare vllm: the python of a venv with vLLM installed (run in a subprocess)")
    p.add_argument("--profile-dir", default=None,
                   help="write a JAX profiler trace of jaxpaged's timed run there (where one engine runs)")
    p.add_argument("--output-json", default="bench_results/throughput.json")
    EngineArgs.add_cli_args(p)


def main(ns: argparse.Namespace) -> list[dict]:
    from jaxpaged.models.registry import default_model_path, load_tokenizer

    engine_args = EngineArgs.from_cli_args(ns)
    engine_args.model = engine_args.model or default_model_path()
    tok = load_tokenizer(engine_args.tokenizer or engine_args.model)
    if ns.shared_prefix:
        prefix, _, suffix = ns.shared_prefix.partition(":")
        prefix_len, suffix_len = int(prefix), int(suffix or 0)
        reqs = shared_prefix_workload(ns.num_prompts, prefix_len, suffix_len, parse_range(ns.output_len)[1],
                                      len(tok), ns.seed, set(tok.all_special_ids))
    elif ns.workload == "copy":
        reqs = copy_workload(ns.num_prompts, tok, ns.seed, parse_range(ns.output_len)[1])
    else:
        reqs = random_token_workload(ns.num_prompts, parse_range(ns.input_len), parse_range(ns.output_len),
                                     len(tok), ns.seed, set(tok.all_special_ids))
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    if engine_args.max_model_len is None:
        engine_args.max_model_len = max(max_len, 128)
    results = []
    if ns.compare_sharing or ns.beam_width:
        import dataclasses

        variants = [("on", True, engine_args.enable_prefix_caching)]
        if ns.compare_sharing:
            variants.append(("off", False, False))
        for name, share, caching in variants:
            args = dataclasses.replace(engine_args, share_forked_blocks=share, enable_prefix_caching=caching)
            label = f"jaxpaged sharing {name}" if ns.compare_sharing else "jaxpaged"
            if ns.beam_width:
                results.append(run_beam_search(reqs, args, ns.beam_width, parse_range(ns.output_len)[1], label))
            else:
                results.append(run_jaxpaged(reqs, args, ns.n, label))
        return _report(results, ns)
    if ns.compare_offload:
        import numpy as np

        from jaxpaged.bench.offload import compare_offload

        if not ns.shared_prefix:
            raise SystemExit("--compare-offload needs --shared-prefix PREFIX:SUFFIX")
        vocab = np.setdiff1d(np.arange(len(tok)), np.asarray(sorted(tok.all_special_ids), int))
        prefix = reqs[0].prompt_token_ids[:prefix_len]
        results = compare_offload(engine_args, prefix, suffix_len, vocab, ns.seed)
        write_json(results, ns.output_json)
        return results
    if ns.compare_lora:
        from jaxpaged.bench.lora import compare_lora

        return _report(compare_lora(reqs, engine_args, ns.compare_lora, ns.lora_rank, ns.temperature, run_jaxpaged), ns)
    if ns.compare_quantization:
        from jaxpaged.bench.quantization import compare_quantization

        entries = [e.strip() for e in ns.compare_quantization.split(",") if e.strip()]
        return _report(compare_quantization(reqs, engine_args, entries, ns.temperature, run_jaxpaged), ns)
    if ns.compare_prefix_caching:
        import dataclasses

        for on in (True, False):
            args = dataclasses.replace(engine_args, enable_prefix_caching=on)
            results.append(run_jaxpaged(reqs, args, ns.n, f"jaxpaged prefix-cache {'on' if on else 'off'}"))
        return _report(results, ns)
    if ns.compare_async:
        import dataclasses

        for on in (False, True):
            args = dataclasses.replace(engine_args, async_scheduling=on)
            results.append(run_jaxpaged(reqs, args, ns.n, f"jaxpaged async {'on' if on else 'off'}",
                                        ns.temperature))
        if ns.temperature == 0:
            assert results[0]["token_ids"] == results[1]["token_ids"], "async scheduling changed greedy outputs"
        return _report(results, ns)
    if ns.compare_speculative is not None:
        import dataclasses

        for config in (None, ns.compare_speculative):
            args = dataclasses.replace(engine_args, speculative_config=config)
            results.append(run_jaxpaged(reqs, args, ns.n, "jaxpaged speculative" if config else "jaxpaged",
                                        ns.temperature))
        ratio = results[1]["output_tokens_per_s"] / results[0]["output_tokens_per_s"]
        print(f"speculative / plain output tokens/s: {ratio:.2f}x; mean acceptance length "
              f"{results[1]['spec_mean_acceptance_length'] or 0:.2f} tokens per verifying step "
              f"(draft acceptance {results[1]['spec_draft_acceptance_rate']:.1%})")
        return _report(results, ns)
    if ns.compare_structured is not None:
        for fraction in (0.0, ns.compare_structured):
            results.append(run_jaxpaged(reqs, engine_args, ns.n, f"jaxpaged {fraction:.0%} constrained",
                                        ns.temperature, fraction))
        a, b = (r.pop("token_ids") for r in results)
        if ns.temperature == 0:
            free = [i for i in range(len(a)) if i % 10 >= 10 * ns.compare_structured]
            same = all(a[i] == b[i] for i in free)
            print(f"free requests' greedy outputs unchanged by the constrained ones: {same}")
            results[1]["free_outputs_unchanged"] = same
        ratio = results[1]["output_tokens_per_s"] / results[0]["output_tokens_per_s"]
        print(f"constrained / free output tokens/s: {ratio:.2f}x; host mask cost "
              f"{results[1]['mask_us_per_row']:.0f} us per constrained row per step "
              f"({results[1]['mask_share_of_wall']:.1%} of wall)")
        return _report(results, ns)
    backends = [ns.backend] + ([ns.compare] if ns.compare and ns.compare != ns.backend else [])
    for b in backends:
        if b == "jaxpaged":
            results.append(run_jaxpaged(reqs, engine_args, ns.n, temperature=ns.temperature,
                                        profile_dir=ns.profile_dir))
        elif b == "vllm":
            from jaxpaged.bench.vllm_peer import run_vllm

            results.append(run_vllm(reqs, engine_args, ns.vllm_python, ns.temperature))
        else:
            bs = ns.hf_batch_size or engine_args.max_num_seqs or 64
            results.append(run_hf(reqs, engine_args.model, bs, ns.temperature, engine_args.load_format,
                                  engine_args.resolved_dtype()))
    return _report(results, ns)


def _report(results: list[dict], ns: argparse.Namespace) -> list[dict]:
    same = [r.pop("token_ids", None) for r in results]
    if ns.temperature == 0 and len(same) == 2 and None not in same:
        print(f"greedy outputs equal: {same[0] == same[1]}")
        for r in results:
            r["greedy_outputs_equal"] = same[0] == same[1]
    for r in results:
        r.update(num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len, seed=ns.seed,
                 shared_prefix=ns.shared_prefix)
    print_table(results)
    write_json(results, ns.output_json)
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    main(parser.parse_args())
