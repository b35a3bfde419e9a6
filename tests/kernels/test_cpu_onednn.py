"""The oneDNN bf16 dense call equals a bf16 x bf16 -> float32 matmul (rows around its rounding to 8, padding rows
zero), and a bf16 model on CPU packs its layers for it and computes the same step as with XLA's dot."""

import os
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpaged.config import ModelConfig
from jaxpaged.models import llama, registry
from pallas_kernels import cpu_build, cpu_onednn


@pytest.fixture(scope="module")
def onednn():
    if jax.default_backend() != "cpu" or os.environ.get(cpu_onednn.ENV) == "0":
        pytest.skip("the oneDNN call is for JAX on CPU (and not turned off)")
    if cpu_onednn.build_arguments() is None or cpu_build._compiler() is None:
        pytest.skip("oneDNN's wheels (a dependency on x86-64 Linux) or a C++ compiler are missing here")
    if not registry.cpu_has_bf16_dot():
        pytest.skip("this CPU has no bf16 dot instructions: bf16 weights keep XLA's dot")
    assert cpu_onednn.available(), "the oneDNN dense call did not build or load (see the log)"
    assert cpu_onednn.layout(np.ones((576, 960), np.float32)) is not None, "no brgemm kernel on a bf16 CPU"


def bf16_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    def rounded(a):
        return np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)
    return (rounded(x) @ rounded(w)).astype(np.float32)


@pytest.mark.parametrize("m,k,n", [(1, 64, 64), (7, 576, 960), (9, 576, 3072), (33, 1536, 576), (130, 128, 256)])
def test_onednn_dense_equals_the_bf16_matmul(onednn, m, k, n):
    rng = np.random.default_rng(m)
    x, w = rng.normal(size=(m, k)).astype(np.float32), rng.normal(size=(k, n)).astype(np.float32)
    packed = cpu_onednn.layout(w)
    assert packed is not None and packed.shape == (1, k, n) and packed.dtype == jnp.bfloat16
    assert not np.array_equal(np.asarray(packed[0]), w.astype(ml_dtypes.bfloat16))  # (reordered: not the weight)
    want = bf16_matmul(x, w)
    scale = np.abs(want).max()
    full = np.asarray(jax.jit(cpu_onednn.onednn_dense)(x, packed))
    np.testing.assert_allclose(full / scale, want / scale, atol=2e-6)
    x[m // 2 + 1:] = np.nan  # padding rows may hold anything: never read, their outputs zero
    part = np.asarray(jax.jit(cpu_onednn.onednn_dense)(x, packed, jnp.int32(m // 2 + 1)))
    np.testing.assert_allclose(part[:m // 2 + 1] / scale, want[:m // 2 + 1] / scale, atol=2e-6)
    assert not part[m // 2 + 1:].any()


@pytest.mark.parametrize("rows", [0, 8, 16, 40])
def test_row_counts_at_the_edges(onednn, rows):
    """No rows (all zeros), multiples of the rounding to 8, and more rows than x has (clamped to all)."""
    rng = np.random.default_rng(rows)
    x, w = rng.normal(size=(16, 64)).astype(np.float32), rng.normal(size=(64, 64)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_onednn.onednn_dense)(x, cpu_onednn.layout(w), jnp.int32(rows)))
    want = bf16_matmul(x, w)
    want[min(rows, 16):] = 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_calls_on_two_threads_at_once(onednn):
    """XLA may run the call from several threads: one shape's primitive run concurrently, each with its own
    inputs, gives each its own product (a primitive sharing its scratchpad did not)."""
    rng = np.random.default_rng(1)
    w = cpu_onednn.layout(rng.normal(size=(576, 960)).astype(np.float32))
    xs = [rng.normal(size=(16, 576)).astype(np.float32) for _ in range(2)]
    wants = [np.asarray(jax.jit(cpu_onednn.onednn_dense)(x, w)) for x in xs]
    call = jax.jit(cpu_onednn.onednn_dense)
    wrong = []

    def run(i):
        for _ in range(300):
            if not np.array_equal(np.asarray(call(xs[i], w)), wants[i]):
                wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_shapes_the_layout_would_pad_keep_xlas_dot(onednn):
    assert cpu_onednn.layout(np.ones((64, 48), np.float32)) is None


def test_a_bf16_model_packs_its_layers_and_computes_the_same_step(onednn):
    from tests.kernels.attention_inputs import make_step

    cfg = ModelConfig(model="tiny", architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                      intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
                      tie_word_embeddings=True, qkv_bias=False, o_bias=False, sliding_window=None,
                      eos_token_ids=(0,), dtype="bfloat16", activation_dtype="float32")
    rng = np.random.default_rng(0)
    weights = {k: rng.normal(size=s).astype(np.float32) * 0.1 for k, s in llama.param_shapes(cfg).items()}
    plain = llama.model_params(cfg, weights, per_layer=True)
    packed = llama.model_params(cfg, weights, per_layer=True, packed=True)
    layer = packed["layers"][0]
    assert {k: (layer[k].shape, layer[k].dtype) for k in ("wqkv", "wo", "w_gate_up", "w_down")} == {
        "wqkv": ((1, 64, 128), jnp.bfloat16), "wo": ((1, 64, 64), jnp.bfloat16),
        "w_gate_up": ((1, 64, 256), jnp.bfloat16), "w_down": ((1, 128, 64), jnp.bfloat16)}
    assert "lm_head" not in packed  # (the tied bf16 head keeps XLA's dot: as fast there)
    assert not llama.LlamaForCausalLM(cfg, weights, attention_backend="cpu").pays_for_padding
    x = make_step(rng, [(5, 1), (20, 3), (0, 4)], group=2, kh=2, d=16, layers=2)
    meta = llama.AttentionMetadata(positions=x["positions"], slot_mapping=x["slots"], token_seq=x["token_seq"],
                                   decode_context_lens=x["decode_ctx"], seq_context_lens=x["seq_ctx"],
                                   continuation_rows=x["cont_rows"], block_tables=x["tables"])
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, x["q"].shape[0]), jnp.int32)
    pool = x["pool"].astype(jnp.bfloat16)

    def logits(params):
        hidden = llama.forward(cfg, params, ids, pool, meta, attention_backend="cpu")[0]
        return llama.compute_logits(params, hidden)

    got, want = np.asarray(jax.jit(logits)(packed)), np.asarray(jax.jit(logits)(plain))
    n = x["real"]
    assert np.isfinite(got[:n]).all()
    np.testing.assert_allclose(got[:n], want[:n], rtol=2e-2, atol=2e-2)  # (bf16 roundings of the same sums)
    assert np.abs(got[:n] - want[:n]).max() < 0.05 * np.abs(want[:n]).max()


def test_a_step_with_the_call_exports_for_the_step_cache(onednn):
    """The step cache keeps steps as `jax.export` modules, which refuse custom calls not named as allowed: the
    call is among the CPU targets the runner names (without it every bf16 start traced its steps again)."""
    from jaxpaged.layers.backends import CPU_CUSTOM_CALL_TARGETS

    w = cpu_onednn.layout(np.ones((64, 64), np.float32))
    checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in CPU_CUSTOM_CALL_TARGETS]
    exported = jax.export.export(jax.jit(cpu_onednn.onednn_dense), disabled_checks=checks)(jnp.ones((8, 64)), w)
    back = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(np.asarray(back.call(jnp.ones((8, 64)), w)), 64.0)
