"""`jaxpaged bench kernels` checks each kernel against its reference before timing it, and writes its table."""

import json

import pytest

from jaxpaged.cli import build_parser


def test_bench_kernels_quick_checks_and_writes_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    ns = build_parser().parse_args(["bench", "kernels", "--quick", "--iters", "1", "--output-json", str(out)])
    ns.func(ns)
    data = json.loads(out.read_text())
    rows = {(r["kernel"].replace("cpu_attention", "paged_attention"), r["case"]): r for r in data["rows"]}
    assert ("paged_attention", "llama3-8b decode 8x128") in rows and ("sampling", "V=128256 top-p 0.9") in rows
    assert ("paged_attention", "smollm2-135m prefill 2x64") in rows
    assert data["ceilings"]["copy_GBps"] > 0 and data["ceilings"]["matmul_TFLOPs"] > 0
    import jax

    from pallas_kernels import cpu_dense
    on_cpu = jax.default_backend() == "cpu" and bool(cpu_dense.panel())
    assert (("cpu_dense", "smollm2 x2 layers, 64 rows") in rows) == on_cpu
    for r in data["rows"]:
        assert r["kernel_ms"] > 0 and r["reference_ms"] > 0
        if r["kernel"] in ("paged_attention", "cpu_attention"):
            assert r["max_abs_err"] < 1e-4
            assert abs(r["kernel_pct_of_copy_bw"] * data["ceilings"]["copy_GBps"] / 100
                       - r["kv_bytes"] / r["kernel_ms"] / 1e6) < 1e-6 * r["kernel_kv_GBps"]
        elif r["kernel"] == "cpu_dense":
            assert r["max_rel_err"] < 1e-5
        else:
            assert r["draws_outside_kept_set"] == 0
    # 8 decodes at position 128 see 129 keys each, over 9 query heads of 64: QK^T and PV, 2 * 64 FLOPs a key each
    decode = rows[("paged_attention", "smollm2-135m decode 8x128")]
    assert decode["causal_flops"] == 8 * 129 * 9 * 2 * (2 * 64)
    tflops = decode["causal_flops"] / decode["kernel_ms"] / 1e9
    assert abs(decode["kernel_TFLOPs"] - tflops) < 1e-6 * tflops
    assert "Kernels vs references" in capsys.readouterr().out


def test_bench_kernels_on_cpu_times_the_cpu_attention(tmp_path, monkeypatch):
    """Off GPU the attention rows are the C++ kernel's (the one the CPU engine runs), checked like the others;
    without it, the interpreted Pallas kernel's."""
    from pallas_kernels import cpu_attention
    for built, kernel in ((True, "cpu_attention"), (False, "paged_attention")):
        if built and not cpu_attention.available():
            continue
        monkeypatch.setattr(cpu_attention, "available", lambda built=built: built)
        out = tmp_path / f"{kernel}.json"
        ns = build_parser().parse_args(["bench", "kernels", "--quick", "--only", "attention", "--iters", "1",
                                        "--dtype", "bfloat16", "--output-json", str(out)])
        ns.func(ns)
        data = json.loads(out.read_text())
        assert data["dtype"] == "bfloat16" and {r["kernel"] for r in data["rows"]} == {kernel}
        assert all(r["max_abs_err"] < 5e-2 for r in data["rows"])


def test_causal_flops_and_the_gpu_grid():
    from jaxpaged.bench.kernels import attention_workloads, causal_flops
    # a decode token at position 1,024 sees 1,025 keys; a fresh 3-token prompt sees 1 + 2 + 3
    assert causal_flops([(1024, 1)], heads=2, d=8) == 4 * 2 * 8 * 1025
    assert causal_flops([(0, 3)], heads=1, d=1) == 4 * 6
    gpu = attention_workloads(gpu_shapes=True, quick=False)
    decodes = {name: seqs for name, seqs in gpu.items() if name.startswith("decode")}
    assert {(len(s), s[0][0]) for s in decodes.values()} == {(n, c) for n in (64, 256, 512) for c in (1024, 8192)}
    assert "mixed" in gpu and gpu["prefill 4x2k"] == [(0, 2048)] * 4


def test_bench_kernels_saves_each_case_as_it_goes(tmp_path, monkeypatch):
    """A run cut short (a stage's time limit on the GPU machine) keeps the rows it measured."""
    from jaxpaged.bench import kernels

    def cut_short(*args, **kwargs):
        raise TimeoutError("cut short")

    monkeypatch.setattr(kernels, "bench_sampling", cut_short)
    out = tmp_path / "kernels.json"
    ns = build_parser().parse_args(["bench", "kernels", "--quick", "--iters", "1", "--output-json", str(out)])
    try:
        ns.func(ns)
    except TimeoutError:
        pass
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6 and all(r["kernel"] in ("paged_attention", "cpu_attention") for r in rows)


def test_tune_times_each_variant_after_checking_it(monkeypatch):
    """--tune: every (kv_blocks, num_splits) variant is checked against the reference, then timed; one that is
    wrong is named so and never the best, one that fails to compile is reported, and neither stops the run."""
    import jax.numpy as jnp

    from jaxpaged.bench import kernels
    from pallas_kernels.paged_attention import reference_ragged_paged_attention

    args, _ = kernels.attention_case([(100, 1), (40, 1)], 6, 2, 16, jnp.float32)
    ref = reference_ragged_paged_attention(*args, sm_scale=0.25)
    times, errors = kernels.tune_case(args, 0.25, interpret=True, iters=1, reference=ref)
    assert list(times) == [kernels.variant_name(*c) for c in kernels.TUNE_CONFIGS] and min(times.values()) > 0
    assert max(errors.values()) < 1e-5
    times, errors = kernels.tune_case(args, 0.25, interpret=True, iters=1, reference=ref, decode=False)
    assert list(times) == [kernels.prefill_variant_name(*v) for v in kernels.PREFILL_VARIANTS]
    assert "bm128_kv8_w8_st3" in times and max(errors.values()) < 1e-5
    real = kernels.ragged_paged_attention

    def broken(*a, kv_blocks, num_splits, **kw):  # splits lose what one key of 141 moves; kv_blocks=8 won't build
        if kv_blocks == 8:
            raise RuntimeError("out of shared memory")
        out = real(*a, kv_blocks=kv_blocks, num_splits=num_splits, **kw)
        return out.at[1, 0, 0].add(0.01) if num_splits > 1 else out

    monkeypatch.setattr(kernels, "ragged_paged_attention", broken)
    times, errors = kernels.tune_case(args, 0.25, interpret=True, iters=1, reference=ref)
    assert errors["kv4_split8_fill2048"].startswith("wrong: max abs error") and "kv4_split8_fill2048" in times
    assert errors["kv8_split1"].startswith("failed: RuntimeError: out of shared memory") and "kv8_split1" not in times
    assert isinstance(errors["kv4_split1"], float)
    rows = [{"head_dim": 16, "variants_ms": {**times, "kv4_split8_fill2048": 1e-9}, "variants_max_abs_err": errors}]
    assert kernels.best_triton_variant(rows, 16) in ("kv1_split1", "kv4_split1")  # (kv8: not on every row)
    assert kernels.best_triton_variant(rows, 64) is None
    prefill_row = {"head_dim": 16, "variants_ms": {"bm16": 1.0, "bm64": 0.5}, "variants_max_abs_err": {}}
    assert kernels.best_triton_variant([prefill_row, *rows], 16) == kernels.best_triton_variant(rows, 16)

    def first_is_wrong(*a, kv_blocks, num_splits, **kw):  # the baseline itself off by a lost key
        out = real(*a, kv_blocks=kv_blocks, num_splits=num_splits, **kw)
        return out.at[1, 0, 0].add(0.01) if kv_blocks == 1 and num_splits == 1 else out

    monkeypatch.setattr(kernels, "ragged_paged_attention", first_is_wrong)
    times, errors = kernels.tune_case(args, 0.25, interpret=True, iters=1, reference=ref, only=("kv1_split1", "kv4"))
    assert errors["kv1_split1"].startswith("wrong:") and isinstance(errors["kv4_split1"], float)
    assert set(errors) == {"kv1_split1", "kv4_split1", "kv4_split8_fill2048"}


def test_tune_variants_filter_by_name(monkeypatch):
    """--tune-variants takes name prefixes; a decode-only filter leaves out the prefill and mixed cases."""
    import jax.numpy as jnp

    from jaxpaged.bench import kernels

    names = list(kernels.tune_variants(0.1, interpret=True, only=("kv", "bm")))
    assert names == [kernels.variant_name(*c) for c in kernels.TUNE_CONFIGS]
    assert list(kernels.tune_variants(0.1, interpret=True, only=("kv", "bm"), decode=False)) == [
        kernels.prefill_variant_name(*v) for v in kernels.PREFILL_VARIANTS]
    rows = list(kernels.bench_attention(quick=True, iters=1, interpret=True, dtype=jnp.float32, tune=True,
                                        variants=("kv1_split1",)))
    assert rows and all("decode" in r["case"] and set(r["variants_ms"]) == {"kv1_split1"} for r in rows)


def test_best_triton_variant_is_fastest_over_all_cases():
    """The geometric mean of each variant's time relative to the default over the cases at one head_dim."""
    from jaxpaged.bench.kernels import TUNE_CONFIGS, best_triton_variant, variant_name, variant_settings

    names = [variant_name(*c) for c in TUNE_CONFIGS]
    assert [tuple(variant_settings(n).values()) for n in names] == list(TUNE_CONFIGS)
    errors = dict.fromkeys(names, 1e-3)
    fast_on_one = {n: 1.0 for n in names} | {"kv4_split1": 0.2, "kv8_split1": 0.6}
    fast_on_other = {n: 1.0 for n in names} | {"kv4_split1": 2.0, "kv8_split1": 0.6}
    rows = [{"head_dim": 64, "variants_ms": ms, "variants_max_abs_err": errors} for ms in (fast_on_one, fast_on_other)]
    assert best_triton_variant(rows, 64) == "kv8_split1"  # 0.6 on both beats kv4's sqrt(0.2 * 2.0) = 0.63
    rows[1]["variants_ms"]["kv4_split1"] = 1.0  # now kv4: sqrt(0.2) = 0.45
    assert best_triton_variant(rows, 64) == "kv4_split1"
    rows[1]["variants_max_abs_err"] = {**errors, "kv4_split1": "wrong: max abs error 1e-2"}  # wrong on a case
    assert best_triton_variant(rows, 64) == "kv8_split1"


def test_median_ms_times_back_to_back_calls_over_the_argument_sets():
    """Each sample dispatches several calls before it waits (no host round trip per short kernel), cycling
    through the given argument sets (inputs past the GPU's L2); the time is per call."""
    import time

    import jax.numpy as jnp

    from jaxpaged.bench.device_ceilings import median_ms
    from jaxpaged.bench.kernels import CACHE_SPAN_BYTES, copies_past_cache

    seen = []

    def slow(x):
        seen.append(int(x[0]))
        time.sleep(0.002)
        return x

    sets = [(jnp.full(4, i),) for i in range(3)]
    # (a sample of ~50 ms: even where a loaded machine (the suite's parallel workers) stretches the 2 ms sleep
    # several-fold, a sample still holds several calls, and a time per sample would show as >= 25 ms)
    ms = median_ms(slow, *sets[0], iters=4, arg_sets=sets, sample_ms=50.0)
    assert 1.9 < ms < 25.0  # per call, not per sample of several calls
    timed = seen[4:]  # (after a warm-up call on each set and one synchronized call)
    assert len(timed) >= 4 * 2 and set(timed) == {0, 1, 2} and timed[:3] == [0, 1, 2]
    assert copies_past_cache(50 << 20) == 6 and copies_past_cache(CACHE_SPAN_BYTES) == 1
    assert copies_past_cache(1) == 8


def test_sampler_tune_checks_each_variant_and_survives_one_that_fails(monkeypatch):
    """--tune on the sampler: each (tile, num_warps) variant must draw inside the kept set to be timed as the
    best; one the compiler rejects is reported and the case still comes out."""
    from jaxpaged.bench import kernels

    real = kernels.top_k_top_p_sampling

    def sampler(*a, tile=1024, num_warps=4, **kw):
        if tile == 4096:
            raise RuntimeError("too many registers")
        return real(*a, tile=tile, num_warps=num_warps, **kw)

    monkeypatch.setattr(kernels, "SAMPLER_TUNE", ((1024, 4, 1), (256, 4, 2), (4096, 4, 1)))
    monkeypatch.setattr(kernels, "top_k_top_p_sampling", sampler)
    row = next(kernels.bench_sampling(quick=True, iters=1, interpret=True, tune=True))
    assert row["draws_outside_kept_set"] == 0
    assert row["variants_outside"]["tile1024_w4"] == 0 and row["variants_outside"]["tile256_w4_r2"] == 0
    assert row["variants_outside"]["tile4096_w4"].startswith("failed: RuntimeError: too many registers")
    assert set(row["variants_ms"]) == {"tile1024_w4", "tile256_w4_r2"}
    assert row["best_variant"] in row["variants_ms"] and "tuned: " in kernels.row_line(row)


def test_the_tuned_variant_reaches_the_engine_through_the_environment(tmp_path, monkeypatch):
    """The GPU script's tuned-engine stage: the fastest variant of the tune stage's JSON becomes
    $JAXPAGED_PALLAS_ATTENTION, which the kernel reads back as the same settings; the default gives none."""
    import json

    from jaxpaged.bench.gpu import _tuned_variant
    from jaxpaged.bench.kernels import TUNE_CONFIGS, variant_name
    from pallas_kernels.paged_attention import VARIANT_ENV, kernel_variant

    names = [variant_name(*c) for c in TUNE_CONFIGS]
    ms = dict.fromkeys(names, 1.0) | {"kv8_split8_fill1024": 0.5}
    path = tmp_path / "kernels_tune.json"
    path.write_text(json.dumps({"rows": [{"head_dim": 64, "variants_ms": ms,
                                          "variants_max_abs_err": dict.fromkeys(names, 1e-3)}]}))
    env = _tuned_variant(str(path), head_dim=64)
    assert env == "kv_blocks=8,num_splits=8,fill_programs=1024"
    monkeypatch.setenv(VARIANT_ENV, env)
    assert kernel_variant(64) == {"kv_blocks": 8, "num_splits": 8, "fill_programs": 1024, "block_m": 16,
                                  "num_warps": 4, "num_stages": 2}
    ms["kv8_split8_fill1024"], ms["kv8_split1"] = 1.0, 0.5  # the default at head_dim 64
    path.write_text(json.dumps({"rows": [{"head_dim": 64, "variants_ms": ms,
                                          "variants_max_abs_err": dict.fromkeys(names, 1e-3)}]}))
    assert _tuned_variant(str(path), head_dim=64) is None


def test_sampler_passes_bench_counts_fewer_passes_from_the_lane_bound(tmp_path):
    """The numpy mirror of the sampler's k-th-largest search: from the lane bound it needs fewer passes than from
    the row's minimum where k is small against the lanes (at most one more, the counting pass, where not), and at
    k = 5 the bound is the answer (one counting pass) unless the row has ties."""
    import json

    from jaxpaged.bench import sampler_passes

    out = tmp_path / "passes.json"
    rows = sampler_passes.main(["--rows", "3", "--vocab", "20000", "--tile", "1024", "--output", str(out)])
    assert json.loads(out.read_text())["rows"] == rows and len(rows) == 9
    assert all(r["passes_now_mean"] < r["passes_before_mean"] for r in rows if r["k"] == 5)
    assert all(r["passes_now_mean"] <= r["passes_before_mean"] + 1 for r in rows)
    assert all(r["passes_now_max"] == 1 for r in rows if r["k"] == 5 and "bf16" not in r["logits"])


def test_gpu_script_refuses_an_unknown_stage_to_skip(tmp_path, capsys):
    from jaxpaged.bench import gpu

    with pytest.raises(SystemExit):
        gpu.main(["--skip", "kernels_mosaic,kernel", "--output-dir", str(tmp_path)])
    assert "no stage kernel " in capsys.readouterr().err
