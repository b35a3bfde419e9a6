"""`jaxpaged bench kernels` checks each kernel against its reference before timing it, and writes its table."""

import json

from jaxpaged.cli import build_parser


def test_bench_kernels_quick_checks_and_writes_json(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    ns = build_parser().parse_args(["bench", "kernels", "--quick", "--iters", "1", "--output-json", str(out)])
    ns.func(ns)
    data = json.loads(out.read_text())
    rows = {(r["kernel"], r["case"]): r for r in data["rows"]}
    assert ("paged_attention", "llama3-8b decode") in rows and ("sampling", "V=128256 top-p 0.9") in rows
    for r in data["rows"]:
        assert r["kernel_ms"] > 0 and r["reference_ms"] > 0
        if r["kernel"] == "paged_attention":
            assert r["max_abs_err"] < 1e-4
        else:
            assert r["draws_outside_kept_set"] == 0
    assert "Kernels vs references" in capsys.readouterr().out
