"""The C++ CPU attention kernel equals the plain-JAX reference; it builds once, and falls back where it cannot."""

import ctypes
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers.attention import write_kv
from jaxpaged.layers.backends import resolve_attention_backend
from pallas_kernels import cpu_attention, cpu_build
from pallas_kernels.kv_storage import encode, storage_dtype
from pallas_kernels.paged_attention import reference_ragged_paged_attention
from tests.kernels.attention_inputs import make_step

LAYER = jnp.int32(1)
CASES = {
    "edges": [(0, 1), (15, 1), (16, 1), (255, 1)],  # length 1, ends on a block boundary, one past, full table
    "mixed": [(40, 1), (31, 1), (20, 12), (0, 9)],  # a prefill chunk that starts mid-block
    "long prefill": [(7, 40), (0, 33), (3, 1)],  # several 16-token tiles per sequence
}


@pytest.fixture(scope="module")
def kernel_built():
    """Where a C++ compiler exists the kernel must build: a failed build fails here instead of skipping. (The
    fallback tests below need no compiler and do not use it.)"""
    if cpu_build._compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    assert cpu_attention.available(), "the CPU attention kernel did not build (see the log)"


needs_kernel = pytest.mark.usefixtures("kernel_built")


def run_both(x, window=None, softcap=None):
    pool = write_kv(x["pool"], LAYER, x["k"], x["v"], x["slots"])
    ref = reference_ragged_paged_attention(x["q"], pool, LAYER, x["tables"], jnp.maximum(x["token_seq"], 0),
                                           x["positions"], sm_scale=0.3, sliding_window=window,
                                           kv_chunk=2 * pool.shape[3], softcap=softcap)
    got = jax.jit(lambda q, pool: cpu_attention.ragged_paged_attention_cpu(
        q, pool, LAYER, x["tables"], x["token_seq"], x["positions"], sm_scale=0.3, sliding_window=window,
        softcap=softcap))(x["q"], pool)
    n = x["real"]
    assert got.dtype == x["q"].dtype and got.shape == x["q"].shape
    np.testing.assert_array_equal(np.asarray(got[n:], np.float32), 0.0)  # padding rows
    return np.asarray(got[:n], np.float32), np.asarray(ref[:n], np.float32)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("group", [1, 3, 4, 8])  # tiles of <= 16 query vectors per KV head take the per-key dot
# path, larger ones (prompt tiles of 6+ tokens with 3 heads) the transposed one; "mixed" has row counts that are not
# a multiple of 4
@needs_kernel
def test_kernel_matches_reference(case, group):
    x = make_step(np.random.default_rng(group), CASES[case], group=group, kh=2, d=64)
    got, ref = run_both(x)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("group,d", [(1, 64), (8, 64), (8, 16)])  # per-key dots, transposed rows, scalar path
@needs_kernel
def test_soft_capped_scores(group, d):
    """Gemma 2's cap * tanh(score / cap) on each score path, scores from tiny (the polynomial) to past the cap;
    the cap changes these outputs (checked), so a kernel that skipped it would fail."""
    x = make_step(np.random.default_rng(group + d), CASES["long prefill"], group=group, kh=2, d=d)
    got, ref = run_both(x, softcap=2.0)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    uncapped, _ = run_both(x)
    assert np.abs(uncapped - got).max() > 0.05


@pytest.mark.parametrize("d,block_size,window", [(16, 16, None), (80, 16, None), (128, 32, None), (64, 32, 20),
                                                 (64, 8, None), (64, 8, 13), (96, 16, 5)])
@needs_kernel
def test_head_dims_block_sizes_window(d, block_size, window):
    """head_dim 16 takes the scalar path, 64/80/96/128 the vector one; 8-token blocks put two blocks in one
    16-key chunk."""
    x = make_step(np.random.default_rng(d + block_size), CASES["mixed"] + [(70, 20)], group=3, kh=2, d=d,
                  block_size=block_size, table_width=256 // block_size, num_blocks=64)
    got, ref = run_both(x, window)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("stored_as_int", [True, False])
@needs_kernel
def test_narrow_pools(kv_dtype, stored_as_int):
    """bf16, f16 and fp8 KV, stored as the engine stores them (integers) or as plain floats: the kernel widens
    the same rounded values the reference reads."""
    x = make_step(np.random.default_rng(11), CASES["mixed"], group=3, kh=2, d=64)
    x["pool"] = encode(x["pool"], storage_dtype(kv_dtype))
    if not stored_as_int:
        x["pool"] = jax.lax.bitcast_convert_type(x["pool"], kv_dtype)
        x["k"], x["v"] = x["k"].astype(kv_dtype), x["v"].astype(kv_dtype)
    got, ref = run_both(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_bfloat16_queries():
    x = make_step(np.random.default_rng(5), CASES["mixed"], group=4, kh=2, d=64, dtype=jnp.bfloat16)
    got, ref = run_both(x)
    np.testing.assert_allclose(got, ref, rtol=8e-3, atol=8e-3)  # both accumulate in float32, round once


@needs_kernel
def test_any_order_of_sequences_and_of_positions_within_one():
    """Tiles are cut where the sequence changes, and a tile's key range comes from its lowest and highest
    position, so no order is assumed."""
    x = make_step(np.random.default_rng(7), CASES["long prefill"], group=2, d=64)
    rng, seq = np.random.default_rng(8), np.asarray(x["token_seq"])
    perm = np.concatenate([rng.permutation(np.flatnonzero(seq >= 0)), np.flatnonzero(seq < 0)])
    x.update(q=x["q"][perm], k=x["k"][perm], v=x["v"][perm], token_seq=x["token_seq"][perm],
             positions=x["positions"][perm], slots=x["slots"][perm])
    got, ref = run_both(x)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_many_tiles_on_the_thread_pool():
    """Far more work items than threads, each a different length: every one runs exactly once."""
    rng = np.random.default_rng(3)
    seqs = [(int(c), int(n)) for c, n in zip(rng.integers(0, 200, 60), rng.choice([1, 1, 1, 5, 17], 60))]
    x = make_step(rng, seqs, group=3, kh=3, d=64, table_width=16, num_blocks=1200)
    got, ref = run_both(x)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def _host_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in text for f in flags)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _host_has("avx2", "fma"),
                    reason="runs an AVX2 build: needs an x86 CPU with AVX2")
@needs_kernel
def test_the_avx2_build_matches_the_reference(tmp_path, monkeypatch):
    """Each machine builds for itself (-march=native), and its vector width decides the code (16 floats on
    AVX-512, 8 otherwise): an AVX-512 machine checks the AVX2 build here too (every path: decode rows, prompt
    tiles with remainders, padding rows, a sliding window)."""
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "FLAGS", tuple("-march=haswell" if f == "-march=native" else f
                                                  for f in cpu_build.FLAGS))
    lib = ctypes.CDLL(str(cpu_build._build("ragged_paged_attention", cpu_build._compiler())))
    target = f"jaxpaged_ragged_paged_attention_avx2_test_{tmp_path.name}"  # (a name per run: XLA keeps them)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxpagedRaggedPagedAttention), platform="cpu")
    monkeypatch.setattr(cpu_attention, "TARGET", target)
    for i, (case, group, window) in enumerate([("mixed", 1, None), ("mixed", 3, 13), ("long prefill", 3, None),
                                                ("long prefill", 8, None), ("edges", 4, None)]):
        x = make_step(np.random.default_rng(i), CASES[case], group=group, kh=2, d=64)
        got, ref = run_both(x, window)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_the_build_is_cached_and_written_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path))
    first = cpu_build._build("ragged_paged_attention", cpu_build._compiler())
    mtime = first.stat().st_mtime_ns
    again = cpu_build._build("ragged_paged_attention", cpu_build._compiler())
    assert again == first and again.stat().st_mtime_ns == mtime  # not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left behind


def test_without_a_compiler_auto_falls_back_and_cpu_says_why(monkeypatch, caplog):
    monkeypatch.setattr(cpu_build, "_compiler", lambda: None)
    assert cpu_build.load.__wrapped__("ragged_paged_attention") is None
    assert "no C++ compiler" in caplog.text
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    assert resolve_attention_backend("auto") == "reference"
    with pytest.raises(ValueError, match="C\\+\\+ compiler"):
        resolve_attention_backend("cpu")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        resolve_attention_backend("flash")


@needs_kernel  # a compiler to fail with
def test_a_failed_build_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "FLAGS", cpu_build.FLAGS + ("-include", "no_such_header.h"))
    assert cpu_build.load.__wrapped__("ragged_paged_attention") is None
    assert "could not build" in caplog.text and "no_such_header" in caplog.text
    assert not any(tmp_path.rglob("*.so"))  # nothing half-built left for the next process


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("JAXPAGED_CPU_KERNELS", "0")
    assert cpu_build.load.__wrapped__("ragged_paged_attention") is None


@needs_kernel
def test_auto_picks_the_kernel_on_cpu():
    assert jax.default_backend() == "cpu" and os.environ.get("JAXPAGED_CPU_KERNELS", "1") != "0"
    assert resolve_attention_backend("auto") == "cpu"
