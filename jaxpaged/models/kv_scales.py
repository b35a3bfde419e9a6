"""fp8 KV scales: one K and one V scale per layer and KV head, calibrated at startup.

An fp8 pool holds K / k_scale and V / v_scale. The attention never needs the scales inside: scores are
q . (k_scale * k_stored) = (k_scale * q) . k_stored, and the output sum_j p_j (v_scale * v_stored) is v_scale
times the attention over the stored values; so `forward` multiplies q by k_scale and the attention's output
by v_scale (per KV head, each shared by its group of query heads), and every attention backend (Pallas, the C++
kernel, plain JAX) reads the pool as it is.

The scales come from the model itself: a fixed calibration text runs through the model with a float32 pool, and
each layer's and head's largest |K| and |V|, with `HEADROOM` to spare, map to the fp8 type's largest finite
value. Without scales (vLLM's default of 1.0), values past it saturate (e4m3: 448), and small ones lose
precision in its subnormals.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxpaged.config import ModelConfig

HEADROOM = 2.0  # calibrated amax * HEADROOM maps to the fp8 maximum (values past it saturate)
MIN_SCALE = 1e-6  # (a head whose K or V is all zeros)
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published four papers that changed "
    "physics: on the photoelectric effect, Brownian motion, special relativity, and mass-energy equivalence. "
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "Question: What is the capital of France? Answer: Paris is the capital and largest city of France. "
    "Les modèles de langage prédisent le mot suivant; 语言模型预测下一个词。 1 + 2 = 3, 3 * 4 = 12, 2^10 = 1024. "
    "<html><body><p>Hello, world!</p></body></html> {\"name\": \"Alice\", \"age\": 30, \"tags\": [\"a\", \"b\"]} "
    "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories every night."
)


def calibration_tokens(tokenizer) -> list[int]:
    """The calibration text as the model's token ids (with its special tokens)."""
    return tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=True)


def kv_amax(cfg: ModelConfig, params: dict, token_ids: list[int], block_size: int = 16, mesh=None) -> np.ndarray:
    """The largest |K| and |V| of each layer and KV head over `token_ids` run as one prompt: [L, 2, KH] (mesh:
    the params' tensor-parallel mesh)."""
    from jaxpaged.layers.attention import empty_kv_pool
    from jaxpaged.models.llama import AttentionMetadata, forward

    n = len(token_ids)
    blocks = -(-n // block_size)
    pool = empty_kv_pool(cfg.num_layers, 1 + blocks, block_size, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    meta = AttentionMetadata(
        positions=jnp.arange(n, dtype=jnp.int32), slot_mapping=block_size + jnp.arange(n, dtype=jnp.int32),
        token_seq=jnp.zeros(n, jnp.int32), decode_context_lens=jnp.zeros(n, jnp.int32),
        seq_context_lens=jnp.zeros(1, jnp.int32), continuation_rows=jnp.full(1, -1, jnp.int32),
        block_tables=1 + jnp.arange(blocks, dtype=jnp.int32)[None, :])
    params = {k: v for k, v in params.items() if k != "kv_scale"}  # (recalibrating: measure the raw values)
    _, pool = forward(cfg, params, jnp.asarray(token_ids, jnp.int32), pool, meta, attention_backend="reference",
                       mesh=mesh)
    written = pool[:, :, 1:].reshape(cfg.num_layers, 2, blocks * block_size, cfg.num_kv_heads, cfg.head_dim)[:, :, :n]
    return np.asarray(jnp.abs(written).max(axis=(2, 4)))


def fp8_kv_scales(amax: np.ndarray, kv_dtype) -> np.ndarray:
    """Scales [L, 2, KH] float32 that map `amax` * HEADROOM to `kv_dtype`'s largest finite value."""
    top = float(jnp.finfo(jnp.dtype(kv_dtype)).max)
    return np.maximum(amax * HEADROOM / top, MIN_SCALE).astype(np.float32)


def calibrated_kv_scales(cfg: ModelConfig, params: dict, tokenizer, kv_dtype, mesh=None
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(scales [L, 2, KH] for an fp8 pool of `kv_dtype`, the amax they came from) over the calibration text."""
    amax = kv_amax(cfg, params, calibration_tokens(tokenizer), mesh=mesh)
    return fp8_kv_scales(amax, kv_dtype), amax


def is_fp8(kv_dtype) -> bool:
    return jnp.dtype(kv_dtype).itemsize == 1
