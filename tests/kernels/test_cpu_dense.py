"""The CPU dense call on packed weights equals x @ w (row counts around its register blocks and work items, K
around its cache blocks, this machine's build and the AVX2 one), and the model packs exactly the float32 weights
it can and computes the same step with them."""

import ctypes
import dataclasses
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_build, cpu_dense
from tests.kernels.test_cpu_attention import _host_has


@pytest.fixture(scope="module")
def kernel_built():
    if cpu_build._compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    assert cpu_dense.panel() in (16, 32), "the CPU dense kernel did not build (see the log)"


def dense_via(target: str, panel: int, x: np.ndarray, w: np.ndarray, rows: int | None = None) -> np.ndarray:
    wp = cpu_dense.pack(w, panel)
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
    m = np.int32(x.shape[0] if rows is None else rows)
    return np.asarray(jax.jit(lambda a, b, r: jax.ffi.ffi_call(target, out)(a, b, r))(x, wp, m))


SHAPES = [(1, 64, 64), (5, 576, 96), (12, 300, 128), (13, 64, 32), (97, 520, 64), (200, 130, 160), (24, 1536, 64),
          (3, 4500, 32)]  # (K beyond one pass: accumulated)


def check(target: str, panel: int) -> None:
    """Every shape at all its rows, then at fewer rows than x has (a padded step): those rows' products, bit
    for bit the same as with all rows, and zeros after them (also where x's padding holds NaNs)."""
    rng = np.random.default_rng(0)
    for m, k, n in SHAPES:
        n = -(-n // panel) * panel
        x = rng.standard_normal((m, k), np.float32)
        w = rng.standard_normal((k, n), np.float32) / np.sqrt(k)
        full = dense_via(target, panel, x, w)
        np.testing.assert_allclose(full, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4, err_msg=f"M {m}, K {k}, N {n}")
        for rows in sorted({0, 1, m // 2, m - 1}):
            padded = x.copy()
            padded[rows:] = np.nan
            got = dense_via(target, panel, padded, w, rows)
            np.testing.assert_array_equal(got[:rows], full[:rows], err_msg=f"M {m} at {rows} rows")
            np.testing.assert_array_equal(got[rows:], 0.0, err_msg=f"M {m} at {rows} rows: the padding's outputs")
    x = rng.standard_normal((9, 64), np.float32)  # counts out of range are clamped to [0, M]
    w = rng.standard_normal((64, panel), np.float32)
    np.testing.assert_array_equal(dense_via(target, panel, x, w, 100), dense_via(target, panel, x, w))
    np.testing.assert_array_equal(dense_via(target, panel, x, w, -3), 0.0)


@pytest.mark.usefixtures("kernel_built")
def test_packed_dense_equals_the_matmul():
    check(cpu_dense.TARGET, cpu_dense.panel())
    w = np.random.default_rng(1).standard_normal((48, 4 * cpu_dense.panel()), np.float32)
    np.testing.assert_array_equal(cpu_dense.unpack(cpu_dense.pack(w)), w)
    x = jnp.ones((2, 3, 48), jnp.float32)  # leading axes are flattened and restored
    np.testing.assert_allclose(np.asarray(cpu_dense.packed_dense(x, jnp.asarray(cpu_dense.pack(w)))),
                               np.asarray(x) @ w, rtol=1e-5, atol=1e-4)
    wp = jnp.asarray(cpu_dense.pack(w))
    full = np.asarray(cpu_dense.packed_dense(x, wp))
    got = np.asarray(jax.jit(cpu_dense.packed_dense)(x, wp, jnp.int32(4)))  # rows of the flattened [6, 48]
    np.testing.assert_array_equal(got[0], full[0])
    np.testing.assert_array_equal(got[1, 0], full[1, 0])
    np.testing.assert_array_equal(got[1, 1:], 0.0)
    with pytest.raises(ValueError, match="do not match"):
        cpu_dense.packed_dense(jnp.ones((2, 47)), jnp.asarray(cpu_dense.pack(w)))


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not _host_has("avx2", "fma"),
                    reason="runs an AVX2 build: needs an x86 CPU with AVX2")
@pytest.mark.skipif(cpu_build._compiler() is None, reason="no C++ compiler on this machine")
def test_the_avx2_build_equals_the_matmul(tmp_path, monkeypatch):
    """An AVX-512 machine builds 32-column panels for itself; the AVX2 build's 16-column panels are checked too."""
    monkeypatch.setenv("JAXPAGED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "FLAGS", tuple("-march=haswell" if f == "-march=native" else f
                                                  for f in cpu_build.FLAGS))
    lib = ctypes.CDLL(str(cpu_build._build("packed_dense", cpu_build._compiler())))
    assert lib.JaxpagedPackedDensePanel() == 16
    target = f"jaxpaged_packed_dense_avx2_test_{tmp_path.name}"  # (a name per run: XLA keeps them)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(lib.JaxpagedPackedDense), platform="cpu")
    check(target, 16)


@pytest.mark.usefixtures("kernel_built")
def test_the_model_packs_its_float32_weights_and_computes_the_same_step():
    from jaxpaged.config import ModelConfig
    from jaxpaged.models import llama
    from tests.kernels.attention_inputs import make_step

    p = cpu_dense.panel()
    cfg = ModelConfig(model="tiny", architecture="LlamaForCausalLM", vocab_size=4 * p, hidden_size=32,
                      intermediate_size=p + 4, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
                      tie_word_embeddings=False, qkv_bias=False, o_bias=False, sliding_window=None,
                      eos_token_ids=(0,), dtype="float32")
    rng = np.random.default_rng(0)
    weights = {k: rng.normal(size=s).astype(np.float32) * 0.1 for k, s in llama.param_shapes(cfg).items()}
    plain = llama.model_params(cfg, weights, per_layer=True)
    packed = llama.model_params(cfg, weights, per_layer=True, packed=True)
    layer = packed["layers"][0]
    # wqkv (128 columns), wo and w_down (32) and the LM head pack; gate/up's 2p + 8 columns are no whole panels
    assert [layer[k].ndim for k in ("wqkv", "wo", "w_down", "w_gate_up")] == [3, 3, 3, 2]
    assert packed["lm_head"].shape == (4, 32, p)
    np.testing.assert_array_equal(cpu_dense.unpack(np.asarray(layer["wqkv"])), np.asarray(plain["layers"][0]["wqkv"]))
    stacked = llama.model_params(cfg, weights, per_layer=False, packed=True)  # (scanned layers: not packed)
    assert stacked["layers"]["wqkv"].shape == (2, 32, 128) and stacked["lm_head"].ndim == 2
    tied = dataclasses.replace(cfg, tie_word_embeddings=True)  # the [E, V] copy of the embedding, packed
    tied_params = llama.model_params(tied, {k: v for k, v in weights.items() if k != "lm_head"}, per_layer=True,
                                     packed=True)
    np.testing.assert_array_equal(cpu_dense.unpack(np.asarray(tied_params["lm_head"])), weights["embed"].T)
    for backend, ndim in (("cpu", 3), ("reference", 2)):  # by default, packed with the other CPU kernels
        assert llama.LlamaForCausalLM(cfg, weights, attention_backend=backend).params()["layers"][0]["wqkv"].ndim \
            == ndim
    # only packed layers skip a step's padding rows (stacked [L, K, N] weights are 3-D too, and pay for it)
    assert [llama.LlamaForCausalLM(cfg, weights, attention_backend=backend, per_layer=per_layer).pays_for_padding
            for backend, per_layer in (("cpu", True), ("cpu", False), ("reference", True))] == [False, True, True]
    x = make_step(rng, [(5, 1), (20, 3), (0, 4)], group=2, kh=2, d=16, layers=2)
    meta = llama.AttentionMetadata(positions=x["positions"], slot_mapping=x["slots"], token_seq=x["token_seq"],
                                   decode_context_lens=x["decode_ctx"], seq_context_lens=x["seq_ctx"],
                                   continuation_rows=x["cont_rows"], block_tables=x["tables"])
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, x["q"].shape[0]), jnp.int32)

    def logits(params):
        hidden = llama.forward(cfg, params, ids, x["pool"], meta, attention_backend="cpu")[0]
        return llama.compute_logits(params, hidden)

    got, want = jax.jit(logits)(packed), jax.jit(logits)(plain)
    n = x["real"]
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(want)[:n], rtol=1e-4, atol=1e-4)
    # with the step's real token count, its tokens' logits are the same bit for bit, and the padding skips every
    # dense layer: each layer adds zeros to its rows, which end as the final norm of their embeddings
    counted = dataclasses.replace(meta, num_real_tokens=jnp.int32(n))
    hidden = jax.jit(lambda p: llama.forward(cfg, p, ids, x["pool"], counted, attention_backend="cpu")[0])(packed)
    np.testing.assert_array_equal(np.asarray(llama.compute_logits(packed, hidden))[:n], np.asarray(got)[:n])
    embedded = llama.rms_norm(packed["embed"][ids[n:]], packed["final_norm"], cfg.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(hidden)[n:], np.asarray(embedded), rtol=1e-6)
    assert np.abs(np.asarray(got)[n:] - np.asarray(llama.compute_logits(packed, embedded))).max() > 1e-3
