"""`python -m jaxpaged.bench.lora_paths`: its grouped form equals the dense one (the bench asserts it), a table
row per shape."""

from jaxpaged.bench import lora_paths


def test_the_two_forms_agree_and_a_row_per_shape(monkeypatch, tmp_path):
    monkeypatch.setattr(lora_paths, "SHAPES", [(5, 16, 24, 3, 4), (9, 8, 8, 1, 2)])
    rows = lora_paths.main(["--output", str(tmp_path / "rows.json")])
    assert [(r["tokens"], r["slots"]) for r in rows] == [(5, 3), (9, 1)] and (tmp_path / "rows.json").exists()
