"""The project's GPU benchmark: one script, each stage time-boxed, one table at the end.

    PYTHONPATH=. python -m jaxpaged.bench.gpu --output-dir "$OUT"          # on a machine with an NVIDIA GPU
    PYTHONPATH=. python -m jaxpaged.bench.gpu --smoke --output-dir /tmp/x  # the same stages, tiny, on CPU

Stages (each a subprocess with its own time limit, so one that hangs or fails costs only itself), kernels first:
  1. a weightless 1.07B Llama-shaped model (Llama-3.2-1B layers, SmolLM2's 49,152-token vocabulary);
  2. `jaxpaged bench kernels`: the device's copy bandwidth and matmul rate, then each kernel against its
     reference and those ceilings (decode at 64-512 sequences of 1k-8k tokens, mixed, long prefill, sampling);
     it saves each case as it goes, so a stage cut short keeps its rows;
  3. with --with-tune: `jaxpaged bench kernels --only attention --tune`, each decode case also timed with the
     Triton kernel's kv_blocks / num_splits variants (splits sized per tile by fill_programs too), prefill and
     mixed with its query tile sizes, key steps, warps and pipeline stages; then, in a
     stage of its own (a kernel that hangs costs 60 s), the Mosaic GPU decode kernel against the Triton
     kernel's tuned defaults on sm90, and the sampler's tile / num_warps variants;
  4. jaxpaged `LLM.generate`: 1,024 prompts of random ids (16-512 tokens), 128 greedy tokens each, EOS ignored,
     bf16, max_num_seqs 256 (async scheduling, the default);
  5. HF transformers static batching (bs 256, sdpa, bf16) on the same prompts and token counts (--no-hf: not);
  6. with --with-tuned-engine, where the tuning found a Triton variant faster than the tuned default at the
     model's head_dim (64): stage 4 again with that variant ($JAXPAGED_PALLAS_ATTENTION);
  7. with --with-functional: `jaxpaged bench functional`, `functional.generate` against `LLM.generate`, 64
     prompts of 128 ids, 128 greedy tokens each (one process, both on the dummy model);
  8. with --with-sync: jaxpaged again without async scheduling;
  9. with --with-profile: jaxpaged on 256 of the prompts, 64 tokens each, under the JAX profiler (a trace in
     --output-dir/profile, summed up in profile_summary.json by `trace_summary`: where a step's time goes on
     the device, kernel by kernel, and on the host; on an H200 the engine took 12.7 ms a step where its host
     work is ~0.7 ms, `jaxpaged bench host`).
 10. with --with-step-variants: stage 4 with the layers as a Python loop ($JAXPAGED_LAYER_LAYOUT=per_layer),
     with XLA's conditionals and while loops recorded into its CUDA graphs (XLA_FLAGS), and with the step's
     branches decided on the device (`--step-branches device`, the conditionals the GPU default now leaves out),
     against the profile of 2026-12-04 (the host waiting in a conditional, the layer scan's loop).
Needs only what the GPU machine has (jax, flax, transformers, torch); installs nothing. Writes JSON per stage
and `gpu_bench.json` under --output-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

STAGES = {  # name -> (time limit in seconds, smoke time limit), in the order they run: 9.3 minutes with --with-tune
    "kernels": (80, 300), "kernels_tune": (150, 300), "kernels_mosaic": (60, 300),  # (tune, mosaic: --with-tune)
    "kernels_sampling_tune": (60, 300),  # with --with-tune
    "jaxpaged_seqs256": (110, 300), "hf_static_bs256": (100, 300),  # (H200, 2026-12-04: 55, 77, -, 60, 81 s)
    "jaxpaged_tuned_seqs256": (70, 300),  # with --with-tuned-engine, when a variant beat the default
    "functional": (50, 300), "jaxpaged_sync_seqs256": (60, 300),  # with --with-functional / --with-sync only
    "jaxpaged_profile": (80, 300),  # with --with-profile only
    "jaxpaged_per_layer_seqs256": (70, 300), "jaxpaged_cb_seqs256": (70, 300),  # with --with-step-variants only
    "jaxpaged_device_branches_seqs256": (70, 300),  # (also): the step's conditionals decided on the device
}

# stage -> environment of the engine variants timed by --with-step-variants (an H200 profile, 2026-12-04: per
# step, the host waits ~5 ms in one XLA conditional and runs the stacked layers' scan as a while loop of one
# command buffer per layer, 145 small device-to-device copies a step beside it)
STEP_VARIANTS = {
    "jaxpaged_per_layer_seqs256": {"JAXPAGED_LAYER_LAYOUT": "per_layer"},  # a Python loop over the layers
    "jaxpaged_cb_seqs256": {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"},  # (2026-12-04:
    # greedy +4.6%, sampled +1.7%, one pair each)
}


def _throughput_cmd(model: str, out: str, ns, *, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "jaxpaged", "bench", "throughput", "--model", model, "--load-format", "dummy",
            "--num-prompts", str(ns.num_prompts), "--input-len", ns.input_len, "--output-len", ns.output_len,
            "--temperature", "0", "--seed", "0", "--output-json", out, *extra]


def _tuned_variant(path: str, head_dim: int) -> str | None:
    """$JAXPAGED_PALLAS_ATTENTION for the Triton variant the tune stage found fastest at head_dim, None where
    it found none faster than the default (or saved nothing)."""
    from jaxpaged.bench.kernels import best_triton_variant, variant_name, variant_settings
    from pallas_kernels.paged_attention import default_variant

    if not os.path.exists(path):
        return None
    best = best_triton_variant(json.load(open(path))["rows"], head_dim)
    if best is None or best == variant_name(**default_variant(head_dim, 16)):
        return None
    return ",".join(f"{k}={v}" for k, v in variant_settings(best).items())


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output-dir", default="bench_results/gpu")
    p.add_argument("--smoke", action="store_true", help="tiny model and workload (checks the script on CPU)")
    p.add_argument("--with-sync", action="store_true", help="also run jaxpaged without async scheduling (+60 s)")
    p.add_argument("--with-tune", action="store_true",
                   help="also time the attention kernel's variants, the Mosaic GPU kernel and the sampler's "
                        "variants (+240 s)")
    p.add_argument("--with-tuned-engine", action="store_true",
                   help="also run the engine with the attention variant the tuning found fastest, where it is not "
                        "the default (+70 s; with --with-tune)")
    p.add_argument("--with-functional", action="store_true", help="also time functional.generate (+50 s)")
    p.add_argument("--no-hf", action="store_true",
                   help="skip the HF transformers stage (-100 s; where its number is already on record)")
    p.add_argument("--with-step-variants", action="store_true",
                   help="also run the engine with its layers as a Python loop, and with XLA's conditionals and "
                        "while loops in its CUDA graphs (+140 s)")
    p.add_argument("--skip", default="",
                   help="stages to leave out, comma-separated (e.g. kernels_mosaic,jaxpaged_seqs256: a kernels-only "
                        "run in a short device budget)")
    p.add_argument("--with-profile", action="store_true",
                   help="also trace the engine on a short run with the JAX profiler (+80 s; DIR/profile)")
    ns = p.parse_args(argv)
    ns.skip = set(filter(None, ns.skip.split(",")))
    unknown = ns.skip - set(STAGES)
    if unknown:
        p.error(f"--skip: no stage {', '.join(sorted(unknown))} (stages: {', '.join(STAGES)})")
    ns.num_prompts, ns.input_len, ns.output_len = (16, "8:32", "8") if ns.smoke else (1024, "16:512", "128")
    os.makedirs(ns.output_dir, exist_ok=True)
    from jaxpaged.bench.dummy_model import write_dummy_model

    model = write_dummy_model(os.path.join(ns.output_dir, "model"), "tiny" if ns.smoke else "1b",
                              max_position_embeddings=1024)
    dtype = "float32" if ns.smoke else "bfloat16"
    stages = {  # (the sync run reuses the first run's compiled steps from the persistent compilation cache)
        "kernels": [sys.executable, "-m", "jaxpaged", "bench", "kernels", *(["--quick"] if ns.smoke else [])],
        "kernels_tune": [sys.executable, "-m", "jaxpaged", "bench", "kernels", "--only", "attention", "--tune",
                         "--tune-variants", "kv,bm", "--no-ceilings", *(["--quick"] if ns.smoke else [])],
        "kernels_mosaic": [sys.executable, "-m", "jaxpaged", "bench", "kernels", "--only", "attention", "--tune",
                           "--tune-variants", "kv4_split1,kv8_split1,mosaic", "--no-ceilings",
                           *(["--quick"] if ns.smoke else [])],
        "kernels_sampling_tune": [sys.executable, "-m", "jaxpaged", "bench", "kernels", "--only", "sampling",
                                  "--tune", "--no-ceilings", *(["--quick"] if ns.smoke else [])],
        "jaxpaged_seqs256": _throughput_cmd(model, "", ns, extra=["--max-num-seqs", "256", "--dtype", dtype]),
        "hf_static_bs256": _throughput_cmd(model, "", ns, extra=["--backend", "hf", "--hf-batch-size", "256",
                                                                 "--dtype", dtype]),
        "jaxpaged_tuned_seqs256": _throughput_cmd(model, "", ns, extra=["--max-num-seqs", "256", "--dtype", dtype]),
        "functional": [sys.executable, "-m", "jaxpaged", "bench", "functional", "--model", model, "--load-format",
                       "dummy", "--dtype", dtype, *(["--num-prompts", "4", "--input-len", "8", "--output-len", "8"]
                                                    if ns.smoke else ["--num-prompts", "64"])],
        "jaxpaged_sync_seqs256": _throughput_cmd(model, "", ns, extra=["--max-num-seqs", "256", "--dtype", dtype,
                                                                       "--no-async-scheduling"]),
        **{name: _throughput_cmd(model, "", ns, extra=["--max-num-seqs", "256", "--dtype", dtype])
           for name in STEP_VARIANTS},
        "jaxpaged_device_branches_seqs256": _throughput_cmd(model, "", ns, extra=[
            "--max-num-seqs", "256", "--dtype", dtype, "--step-branches", "device"]),
        "jaxpaged_profile": _throughput_cmd(model, "", ns, extra=[
            "--max-num-seqs", "256", "--dtype", dtype, "--profile-dir", os.path.join(ns.output_dir, "profile")]),
    }
    if ns.with_profile:  # (a short run: a trace of the whole 1,024-prompt run would not come back from the machine)
        cmd = stages["jaxpaged_profile"]
        cmd[cmd.index("--num-prompts") + 1] = str(min(ns.num_prompts, 256))
        cmd[cmd.index("--output-len") + 1] = "8" if ns.smoke else "64"
    for name, wanted in (("kernels_tune", ns.with_tune), ("kernels_mosaic", ns.with_tune),
                         ("kernels_sampling_tune", ns.with_tune),
                         ("jaxpaged_tuned_seqs256", ns.with_tune and ns.with_tuned_engine),  # (this run's tuning)
                         ("functional", ns.with_functional), ("jaxpaged_sync_seqs256", ns.with_sync),
                         ("jaxpaged_profile", ns.with_profile), ("hf_static_bs256", not ns.no_hf),
                         ("jaxpaged_device_branches_seqs256", ns.with_step_variants),
                         *((name, ns.with_step_variants) for name in STEP_VARIANTS)):
        if not wanted:
            del stages[name]
    for name in ns.skip:
        stages.pop(name, None)
    rows = []
    for name, cmd in stages.items():
        out = os.path.join(ns.output_dir, f"{name}.json")
        if "--output-json" in cmd:
            cmd[cmd.index("--output-json") + 1] = out
        else:
            cmd += ["--output-json", out]
        if os.path.exists(out):  # (the summary below reads it: nothing from an earlier run)
            os.remove(out)
        limit = STAGES[name][1 if ns.smoke else 0]
        env = None
        if name == "jaxpaged_tuned_seqs256":  # the variant the tuning found fastest at the model's head_dim
            variant = _tuned_variant(os.path.join(ns.output_dir, "kernels_tune.json"), head_dim=64)
            if variant is None:
                rows.append({"stage": name, "status": "skipped (no variant beat the default)", "stage_s": 0.0})
                print(json.dumps(rows[-1]), flush=True)
                continue
            env = {**os.environ, "JAXPAGED_PALLAS_ATTENTION": variant}
        elif name in STEP_VARIANTS:
            env = {**os.environ, **STEP_VARIANTS[name]}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            status = "ok" if proc.returncode == 0 else f"failed ({proc.returncode})"
            log = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            status, log = f"timed out after {limit} s", (e.stdout or b"").decode() + (e.stderr or b"").decode()
        with open(os.path.join(ns.output_dir, f"{name}.log"), "w") as f:
            f.write(log)
        row = {"stage": name, "status": status, "stage_s": round(time.perf_counter() - t0, 1),
               **({"variant": env["JAXPAGED_PALLAS_ATTENTION"]} if name == "jaxpaged_tuned_seqs256" else
                  {"variant": STEP_VARIANTS[name]} if name in STEP_VARIANTS else {})}
        if status == "ok" and name == "functional":
            engine, functional = json.load(open(out))
            row.update(output_tok_s=round(functional["output_tokens_per_s"], 1), wall_s=round(functional["wall_s"], 2),
                       engine_output_tok_s=round(engine["output_tokens_per_s"], 1),
                       rows_equal=functional["rows_equal_to_engine"])
        elif status == "ok" and not name.startswith("kernels"):
            r = json.load(open(out))[0]
            row.update(output_tok_s=round(r["output_tokens_per_s"], 1), wall_s=round(r["wall_s"], 2),
                       warmup_s=round(r["warmup_s"], 1), num_steps=r.get("num_steps"))
        if status == "ok" and name == "jaxpaged_profile":  # the trace's few telling lines, small enough to bring back
            from jaxpaged.bench.trace_summary import newest_trace, print_summary, summarize

            try:
                summary = summarize(newest_trace(os.path.join(ns.output_dir, "profile")), top=30)
                with open(os.path.join(ns.output_dir, "profile_summary.json"), "w") as f:
                    json.dump(summary, f, indent=1)
                print_summary(summary)
            except Exception as e:  # noqa: BLE001
                row["status"] = f"ok (no summary: {type(e).__name__}: {e})"
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| stage | status | output tok/s | wall s | warmup s | stage s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage']} | {r['status']} | {r.get('output_tok_s', '-')} | {r.get('wall_s', '-')} | "
              f"{r.get('warmup_s', '-')} | {r['stage_s']} |")
    for name in ("kernels", "kernels_tune", "kernels_mosaic", "kernels_sampling_tune"):
        path = os.path.join(ns.output_dir, f"{name}.json")
        if name in stages and os.path.exists(path):  # (also from a stage cut short: it saves each case as it goes)
            from jaxpaged.bench.kernels import print_table
            k = json.load(open(path))
            print_table(k["rows"], k["device"], k.get("ceilings"))
    for r in rows:
        if r["stage"] == "functional" and "engine_output_tok_s" in r:
            print(f"\nfunctional.generate {r['output_tok_s']} vs LLM.generate {r['engine_output_tok_s']} output tok/s "
                  f"on the same batch; greedy rows equal: {r['rows_equal']}")
    with open(os.path.join(ns.output_dir, "gpu_bench.json"), "w") as f:
        json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
