"""The C++ rotary tables equal plain JAX's cos/sin of the same float32 angles, and the CPU step reads them from
one call instead of taking cos/sin inside every layer's rotation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers.rope import apply_rope, rope_angles, rope_inv_freq
from pallas_kernels import cpu_build, cpu_rope


@pytest.fixture(scope="module")
def kernel_built():
    if cpu_build._compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    assert cpu_rope.available(), "the CPU rope kernel did not build (see the log)"


@pytest.mark.usefixtures("kernel_built")
@pytest.mark.parametrize("d,theta,scaling", [(64, 10000.0, None), (128, 500000.0, {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192})])
def test_tables_equal_plain_jax(d, theta, scaling):
    inv_freq = jnp.asarray(rope_inv_freq(d, theta, scaling))
    positions = jnp.asarray(np.concatenate([np.arange(40), [0, 0], np.random.default_rng(0).integers(0, 130_000, 30)]),
                            jnp.int32)  # small, padding (0) and long-context positions
    got = jax.jit(lambda p: rope_angles(p, inv_freq, cpu_kernel=True))(positions)
    want = jax.jit(lambda p: rope_angles(p, inv_freq))(positions)
    for g, w in zip(got, want):
        assert g.shape == (positions.shape[0], d // 2) and g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6)
    x = jax.random.normal(jax.random.PRNGKey(0), (positions.shape[0], 3, d))
    np.testing.assert_allclose(np.asarray(apply_rope(x, got)), np.asarray(apply_rope(x, want)), rtol=0, atol=1e-5)


@pytest.mark.usefixtures("kernel_built")
def test_step_takes_cos_sin_from_the_call_not_per_layer():
    """With the CPU kernels the compiled forward holds no cos/sin (they are the call's); on the plain path XLA
    takes them in the step (the form it fused into every layer's rotations)."""
    from jaxpaged.config import ModelConfig
    from jaxpaged.models import llama
    from tests.kernels.attention_inputs import make_step

    cfg = ModelConfig(model="tiny", architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32,
                      intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                      rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True,
                      qkv_bias=False, o_bias=False, sliding_window=None, eos_token_ids=(0,), dtype="float32")
    rng = np.random.default_rng(0)
    params = llama.model_params(cfg, {k: rng.normal(size=s).astype(np.float32) * 0.1
                                      for k, s in llama.param_shapes(cfg).items()}, per_layer=True)
    x = make_step(rng, [(5, 1), (20, 3), (0, 4)], group=2, kh=2, d=16, layers=3)
    meta = llama.AttentionMetadata(positions=x["positions"], slot_mapping=x["slots"], token_seq=x["token_seq"],
                                   decode_context_lens=x["decode_ctx"], seq_context_lens=x["seq_ctx"],
                                   continuation_rows=x["cont_rows"], block_tables=x["tables"])
    ids = jnp.asarray(rng.integers(0, 64, x["q"].shape[0]), jnp.int32)

    def run(backend):
        f = jax.jit(lambda p, pool: llama.forward(cfg, p, ids, pool, meta, attention_backend=backend)[0])
        return f.lower(params, x["pool"]).compile().as_text(), np.asarray(f(params, x["pool"]))

    (with_kernels, got), (plain, want) = run("cpu"), run("reference")
    assert cpu_rope.TARGET in with_kernels and "cosine(" not in with_kernels and "sine(" not in with_kernels
    assert "cosine(" in plain and cpu_rope.TARGET not in plain
    n = x["real"]
    np.testing.assert_allclose(got[:n], want[:n], rtol=1e-4, atol=1e-4)
