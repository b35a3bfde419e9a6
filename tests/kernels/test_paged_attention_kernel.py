"""The Pallas ragged paged-attention kernel equals the plain-JAX reference (interpreter) and lowers for CUDA."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers.attention import write_kv
from pallas_kernels.paged_attention import ragged_paged_attention, reference_ragged_paged_attention
from tests.kernels.attention_inputs import make_step
from tests.kernels.cuda_lowering import lower_for_cuda

LAYER = jnp.int32(1)

# (context_len, new_tokens) per sequence; make_step adds three padding tokens.
CASES = {
    "edges": [(0, 1), (15, 1), (16, 1), (255, 1)],  # length 1, ends on a block boundary, one past, full table
    "mixed": [(40, 1), (31, 1), (20, 12), (0, 9)],  # a prefill chunk that starts mid-block
    "long prefill": [(7, 40), (0, 33), (3, 1)],  # several query tiles per sequence
}


def run_both(x, window=None, **kw):
    pool = write_kv(x["pool"], LAYER, x["k"], x["v"], x["slots"])
    ref = reference_ragged_paged_attention(x["q"], pool, LAYER, x["tables"], jnp.maximum(x["token_seq"], 0),
                                           x["positions"], sm_scale=0.3, sliding_window=window, kv_chunk=32,
                                           softcap=kw.get("softcap"))
    got = ragged_paged_attention(x["q"], pool, LAYER, x["tables"], x["token_seq"], x["positions"], sm_scale=0.3,
                                 sliding_window=window, interpret=True, **kw)
    n = x["real"]
    assert got.dtype == x["q"].dtype
    np.testing.assert_array_equal(np.asarray(got[n:], np.float32), 0.0)  # padding rows
    return np.asarray(got[:n], np.float32), np.asarray(ref[:n], np.float32)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_kernel_matches_reference(case, group):
    x = make_step(np.random.default_rng(group), CASES[case], group=group, kh=2, d=16)
    got, ref = run_both(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kv_blocks,num_splits", [(4, 1), (32, 1), (1, 3), (2, 8)])
def test_wider_steps_and_split_contexts_match_reference(case, kv_blocks, num_splits):
    """kv_blocks blocks per step (32: wider than the 16-block table, padded) and the context split over
    programs then merged: the same attention. ("edges" has a sequence that fills its table and a 1-token one,
    which leaves most splits empty.)"""
    x = make_step(np.random.default_rng(kv_blocks + num_splits), CASES[case], group=3, kh=2, d=16)
    got, ref = run_both(x, kv_blocks=kv_blocks, num_splits=num_splits)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("fill", [1, 8, 64])
def test_splits_sized_per_tile_match_reference(case, fill):
    """fill_programs: each tile split only as far as ~fill programs need (each split >= 2 steps), so tiles of
    one step split differently and the merge skips the splits that never ran. The counts checked to vary."""
    from pallas_kernels.paged_attention import query_tiles, splits_per_tile

    x = make_step(np.random.default_rng(fill), CASES[case], group=3, kh=2, d=16)
    got, ref = run_both(x, kv_blocks=1, num_splits=4, fill_programs=fill, block_m=16)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    start, length = query_tiles(x["token_seq"], 16 // 4, 64)  # (16 rows: 4 tokens x 3 heads padded to 4)
    counts = np.asarray(splits_per_tile(start, length, x["positions"], 2, 16, 4, fill, None))[np.asarray(length) > 0]
    if fill == 1:
        assert (counts == 1).all()
    if fill == 64:
        assert counts.max() == (4 if case == "edges" else 2) and counts.min() == 1, counts


def test_splits_per_tile_rules():
    """Enough splits for ~fill programs over the busy tiles x KV heads, capped by num_splits and by 2 steps a
    split; empty tiles and a window counted right."""
    from pallas_kernels.paged_attention import splits_per_tile

    start = jnp.array([0, 1, 2, 3, 3], jnp.int32)  # three 1-token tiles, then 2 empty ones (start T=3, len 0)
    length = jnp.array([1, 1, 1, 0, 0], jnp.int32)
    pos = jnp.array([999, 15, 100], jnp.int32)  # 1,000 keys, 16, 101: 63, 1, 7 steps of 16
    split = lambda fill, window=None: np.asarray(splits_per_tile(start, length, pos, 2, 16, 8, fill, window))[:3]  # noqa: E731
    np.testing.assert_array_equal(split(6), [1, 1, 1])  # 3 tiles x 2 heads fill 6 already
    np.testing.assert_array_equal(split(24), [4, 1, 4])  # 4 wanted; the 16-key tile has 1 step
    np.testing.assert_array_equal(split(1000), [8, 1, 4])  # capped by num_splits and by 2 steps a split
    np.testing.assert_array_equal(split(1000, window=64), [3, 1, 3])  # 64 + 1 keys: 5 steps


@pytest.mark.parametrize("kv_blocks,num_splits", [(1, 1), (4, 2)])
def test_soft_capped_scores(kv_blocks, num_splits):
    """Gemma 2's cap * tanh(score / cap) before the softmax, in every step form; the cap changes these outputs
    (checked), so a kernel that skipped it would fail."""
    x = make_step(np.random.default_rng(5), CASES["mixed"], group=2, kh=2, d=16)
    got, ref = run_both(x, softcap=1.0, kv_blocks=kv_blocks, num_splits=num_splits)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    uncapped, _ = run_both(x, kv_blocks=kv_blocks, num_splits=num_splits)
    assert np.abs(uncapped - got).max() > 0.05


def test_wider_steps_and_splits_with_a_window_and_narrow_pool():
    from pallas_kernels.kv_storage import encode, storage_dtype

    x = make_step(np.random.default_rng(12), CASES["long prefill"], group=4, kh=1, d=32)
    x["pool"] = encode(x["pool"], storage_dtype(jnp.bfloat16))
    got, ref = run_both(x, 20, kv_blocks=2, num_splits=2)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_split_merge_weighs_each_split_by_its_softmax_mass():
    from pallas_kernels.paged_attention import combine_splits

    # two splits over one row: keys with scores (0, ln 3) and values (1, 5): softmax 1/4, 3/4 -> 4
    acc = jnp.array([1.0, 15.0])[:, None, None, None] * jnp.exp(-jnp.array([0.0, np.log(3)]))[:, None, None, None]
    m, l = jnp.array([0.0, np.log(3)])[:, None, None], jnp.ones((2, 1, 1))
    np.testing.assert_allclose(combine_splits(acc, m, l)[0, 0, 0], 4.0, rtol=1e-6)
    empty = combine_splits(jnp.stack([acc[0], jnp.zeros_like(acc[0])]), jnp.stack([m[0], jnp.full_like(m[0], -1e30)]),
                           jnp.stack([l[0], jnp.zeros_like(l[0])]))
    np.testing.assert_allclose(empty[0, 0, 0], 1.0, rtol=1e-6)  # an empty split (m -1e30, l 0) weighs nothing
    # a split whose program never ran (fill_programs) left garbage, NaN here: `written` drops it
    nan = jnp.full_like(acc[:1], jnp.nan)
    merged = combine_splits(jnp.concatenate([acc, nan]), jnp.concatenate([m, nan[..., 0]]),
                            jnp.concatenate([l, nan[..., 0]]), jnp.array([True, True, False])[:, None, None])
    np.testing.assert_allclose(merged[0, 0, 0], 4.0, rtol=1e-6)


@pytest.mark.parametrize("d,block_size,window", [(64, 16, None), (128, 32, None), (64, 32, 20)])
def test_kernel_head_dims_block_sizes_window(d, block_size, window):
    x = make_step(np.random.default_rng(d), CASES["mixed"], group=3, kh=1, d=d, block_size=block_size,
                  table_width=8, num_blocks=24)
    got, ref = run_both(x, window)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)


def test_kernel_bfloat16():
    x = make_step(np.random.default_rng(5), CASES["mixed"], group=4, kh=2, d=64, table_width=8, num_blocks=24,
                  dtype=jnp.bfloat16)
    got, ref = run_both(x)
    # bf16 keeps 8 significant bits (relative step 2^-8): the kernel accumulates in float32 and rounds P to bf16
    # before P.V and the output once, measured at 7.8e-3 at most here (half a step at |x| ~ 3). 8e-3 relative
    # + 8e-3 absolute is about two steps; leaving out any one key of a row moves its output by up to 4.5 here.
    np.testing.assert_allclose(got, ref, rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernel_reads_a_narrower_pool(kv_dtype):
    """bf16 or fp8 KV (integer storage) under float32 queries: the kernel reads the same rounded values the
    reference reads."""
    from pallas_kernels.kv_storage import encode, storage_dtype

    x = make_step(np.random.default_rng(11), CASES["mixed"], group=3, kh=2, d=16)
    x["pool"] = encode(x["pool"], storage_dtype(kv_dtype))  # stored as the engine stores it: integers
    got, ref = run_both(x)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_any_order_of_sequences_and_of_positions_within_one():
    x = make_step(np.random.default_rng(7), CASES["long prefill"], group=2, d=16)
    rng, seq = np.random.default_rng(8), np.asarray(x["token_seq"])
    runs = [rng.permutation(np.flatnonzero(seq == s)) for s in rng.permutation(seq.max() + 1)]
    perm = np.concatenate(runs + [np.arange(x["real"], x["q"].shape[0])])
    x.update(q=x["q"][perm], k=x["k"][perm], v=x["v"][perm], token_seq=x["token_seq"][perm],
             positions=x["positions"][perm], slots=x["slots"][perm])
    got, ref = run_both(x, block_m=32)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_problem():
    x = make_step(np.random.default_rng(0), [(3, 2)], group=2, d=16)
    args = (x["q"], x["pool"], LAYER, x["tables"], x["token_seq"], x["positions"])
    with pytest.raises(ValueError, match="multiple of KV heads"):
        ragged_paged_attention(x["q"][:, :3], *args[1:], sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_pool must be one of"):
        ragged_paged_attention(x["q"], x["pool"].astype(jnp.int32), *args[2:], sm_scale=1.0)
    with pytest.raises(ValueError, match="one contiguous run"):
        ragged_paged_attention(*args[:4], jnp.array([0, 1, 0, -1, -1], jnp.int32), x["positions"], sm_scale=1.0)
    with pytest.raises(ValueError, match="too short for position"):
        ragged_paged_attention(*args[:3], x["tables"][:, :1], x["token_seq"], x["positions"] + 20, sm_scale=1.0)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        q = jnp.zeros((4, 4, 24)); pool = jnp.zeros((1, 2, 4, 16, 2, 24))  # noqa: E702
        ragged_paged_attention(q, pool, LAYER, x["tables"][:, :2], jnp.zeros(4, jnp.int32),
                               jnp.zeros(4, jnp.int32), sm_scale=1.0)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (32, 8, 128)])  # SmolLM2-135M, Llama-3-8B
@pytest.mark.parametrize("dtype,kv_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32),
                                            (jnp.bfloat16, jnp.uint8), (jnp.float32, jnp.uint16)])  # fp8 / bf16 KV
def test_kernel_lowers_for_cuda(heads, kv_heads, d, dtype, kv_dtype):
    spec = jax.ShapeDtypeStruct
    t, s, table_width = 512, 64, 128
    args = (spec((t, heads, d), dtype), spec((2, 2, 1024, 16, kv_heads, d), kv_dtype), spec((), jnp.int32),
            spec((s, table_width), jnp.int32), spec((t,), jnp.int32), spec((t,), jnp.int32))
    for kv_blocks, num_splits, fill, block_m in ((1, 1, 0, 16), (8, 1, 0, 16), (4, 4, 0, 16), (4, 1, 0, 64),
                                                 (8, 8, 2048, 16)):
        f = lambda *a, kb=kv_blocks, ns=num_splits, fp=fill, bm=block_m: ragged_paged_attention(  # noqa: E731
            *a, sm_scale=d ** -0.5, kv_blocks=kb, num_splits=ns, fill_programs=fp, block_m=bm)
        text = lower_for_cuda(f, *args)
        assert "triton" in text.lower()
        name = f"ragged_paged_attention_m{block_m}" + (f"_kv{kv_blocks}" if kv_blocks > 1 else "") + (
            f"_split{num_splits}" if num_splits > 1 else "") + (f"_fill{fill}" if fill else "")
        assert re.search(re.escape(name) + r"(?!_)\b", text), name  # that variant was lowered


@pytest.mark.parametrize("block_m,kv_blocks,num_warps,num_stages", [(128, 8, 8, 3), (64, 8, 4, 3)])
def test_prefill_variants_lower_for_cuda(block_m, kv_blocks, num_warps, num_stages, monkeypatch):
    """Bigger tiles, more warps and stages (--tune's prefill variants), given or from the environment."""
    spec = jax.ShapeDtypeStruct
    args = (spec((512, 32, 128), jnp.bfloat16), spec((2, 2, 1024, 16, 8, 128), jnp.bfloat16), spec((), jnp.int32),
            spec((8, 128), jnp.int32), spec((512,), jnp.int32), spec((512,), jnp.int32))
    name = f"ragged_paged_attention_m{block_m}_kv{kv_blocks}"
    assert name in lower_for_cuda(lambda *a: ragged_paged_attention(
        *a, sm_scale=0.1, block_m=block_m, kv_blocks=kv_blocks, num_warps=num_warps, num_stages=num_stages), *args)
    monkeypatch.setenv("JAXPAGED_PALLAS_ATTENTION", f"block_m={block_m},kv_blocks={kv_blocks},"
                                                   f"num_warps={num_warps},num_stages={num_stages}")
    from pallas_kernels.paged_attention import kernel_variant

    assert kernel_variant(128, 16, 512, 8)["num_warps"] == num_warps
    assert name in lower_for_cuda(lambda *a: ragged_paged_attention(*a, sm_scale=0.1), *args)


def test_soft_capped_kernel_lowers_for_cuda():
    """Gemma 2 2B's heads (8 / 4, head_dim 256) with its attention cap of 50, a decode and a prefill shape."""
    spec = jax.ShapeDtypeStruct
    for t, s in ((64, 64), (512, 8)):
        args = (spec((t, 8, 256), jnp.bfloat16), spec((2, 2, 256, 16, 4, 256), jnp.bfloat16), spec((), jnp.int32),
                spec((s, 32), jnp.int32), spec((t,), jnp.int32), spec((t,), jnp.int32))
        text = lower_for_cuda(lambda *a: ragged_paged_attention(*a, sm_scale=0.0625, softcap=50.0,
                                                                sliding_window=4096), *args)
        assert "ragged_paged_attention_m" in text


def test_variant_from_the_environment(monkeypatch):
    """$JAXPAGED_PALLAS_ATTENTION picks the variant a call that names none gets (to time the engine with it)."""
    spec = jax.ShapeDtypeStruct
    args = (spec((64, 9, 64), jnp.bfloat16), spec((2, 2, 256, 16, 3, 64), jnp.bfloat16), spec((), jnp.int32),
            spec((8, 32), jnp.int32), spec((64,), jnp.int32), spec((64,), jnp.int32))
    lowered = lambda: lower_for_cuda(lambda *a: ragged_paged_attention(*a, sm_scale=0.125), *args)  # noqa: E731
    monkeypatch.setenv("JAXPAGED_PALLAS_ATTENTION", "kv_blocks=2, num_splits=2")  # (a new trace each time)
    assert "ragged_paged_attention_m64_kv2_split2" in lowered()  # (64 tokens of 8 sequences: prefill tiles)
    monkeypatch.setenv("JAXPAGED_PALLAS_ATTENTION", "kv_blocks=eight")
    with pytest.raises(ValueError, match="JAXPAGED_PALLAS_ATTENTION"):
        lowered()
    monkeypatch.delenv("JAXPAGED_PALLAS_ATTENTION")
    assert re.search(r"ragged_paged_attention_m64_kv8(?!_)\b", lowered())  # the tuned default at head_dim 64


@pytest.mark.parametrize("heads,kv_heads,d,name", [(9, 3, 64, "m16_kv8"), (32, 8, 128, "m16_kv4"),
                                                   (4, 2, 32, "m16_kv8"), (8, 8, 256, "m16_kv4")])
def test_default_variant_is_the_tuned_one_for_its_head_dim(heads, kv_heads, d, name, monkeypatch):
    """A call that names no variant gets the one timed fastest on an H200 for its head_dim (128 keys a step up
    to 64, 64 above, no split: 8 and 4 blocks of 16), which is what the engine's steps call."""
    from pallas_kernels.paged_attention import default_variant

    monkeypatch.delenv("JAXPAGED_PALLAS_ATTENTION", raising=False)
    assert default_variant(d) == {"kv_blocks": int(name[-1]), "num_splits": 1, "fill_programs": 0}
    assert default_variant(d, block_size=32)["kv_blocks"] == int(name[-1]) // 2  # the same keys a step
    assert default_variant(d, block_size=256)["kv_blocks"] == 1
    spec = jax.ShapeDtypeStruct
    args = (spec((64, heads, d), jnp.bfloat16), spec((2, 2, 256, 16, kv_heads, d), jnp.bfloat16),
            spec((), jnp.int32), spec((64, 32), jnp.int32), spec((64,), jnp.int32), spec((64,), jnp.int32))
    text = lower_for_cuda(lambda *a: ragged_paged_attention(*a, sm_scale=0.125), *args)  # (decode-shaped)
    assert re.search(rf"ragged_paged_attention_{name}(?!_)\b", text)


@pytest.mark.parametrize("tokens,seqs,rows", [(64, 64, 16), (64, 17, 16), (64, 16, 64), (512, 8, 64)])
def test_query_tile_follows_the_step_shape(tokens, seqs, rows, monkeypatch):
    """A call that names no block_m gets 64 query rows a tile where its shape holds at least 4 tokens per
    sequence slot (prefill: timed 1.4-1.6x faster on an H200) and 16 otherwise (decode); the environment's
    block_m wins over both."""
    from pallas_kernels.paged_attention import default_block_m

    monkeypatch.delenv("JAXPAGED_PALLAS_ATTENTION", raising=False)
    assert default_block_m(tokens, seqs) == rows
    spec = jax.ShapeDtypeStruct
    args = (spec((tokens, 32, 128), jnp.bfloat16), spec((2, 2, 256, 16, 8, 128), jnp.bfloat16),
            spec((), jnp.int32), spec((seqs, 32), jnp.int32), spec((tokens,), jnp.int32), spec((tokens,), jnp.int32))
    lowered = lambda: lower_for_cuda(lambda *a: ragged_paged_attention(*a, sm_scale=0.125), *args)  # noqa: E731
    assert re.search(rf"ragged_paged_attention_m{rows}_kv4(?!_)\b", lowered())
    monkeypatch.setenv("JAXPAGED_PALLAS_ATTENTION", "block_m=32")
    assert re.search(r"ragged_paged_attention_m32_kv4(?!_)\b", lowered())
