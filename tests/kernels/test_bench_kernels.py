"""`jaxpaged bench kernels` checks each kernel against its reference before timing it, and writes its table."""

import json

from jaxpaged.cli import build_parser


def test_bench_kernels_quick_checks_and_writes_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    ns = build_parser().parse_args(["bench", "kernels", "--quick", "--iters", "1", "--output-json", str(out)])
    ns.func(ns)
    data = json.loads(out.read_text())
    rows = {(r["kernel"].replace("cpu_attention", "paged_attention"), r["case"]): r for r in data["rows"]}
    assert ("paged_attention", "llama3-8b decode") in rows and ("sampling", "V=128256 top-p 0.9") in rows
    import jax

    from pallas_kernels import cpu_dense
    on_cpu = jax.default_backend() == "cpu" and bool(cpu_dense.panel())
    assert (("cpu_dense", "smollm2 x2 layers, 64 rows") in rows) == on_cpu
    for r in data["rows"]:
        assert r["kernel_ms"] > 0 and r["reference_ms"] > 0
        if r["kernel"] in ("paged_attention", "cpu_attention"):
            assert r["max_abs_err"] < 1e-4
        elif r["kernel"] == "cpu_dense":
            assert r["max_rel_err"] < 1e-5
        else:
            assert r["draws_outside_kept_set"] == 0
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
