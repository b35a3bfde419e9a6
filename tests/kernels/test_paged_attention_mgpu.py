"""The Mosaic GPU decode kernel lowers for CUDA at both model shapes (its numbers are checked on an H200 by
`jaxpaged bench kernels --tune`: the Pallas interpreter cannot run its TMA copies), and rejects what it can't do."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.paged_attention_mgpu import decode_paged_attention_mgpu
from tests.kernels.cuda_lowering import lower_for_cuda


def _args(h: int, kh: int, d: int, dtype=jnp.bfloat16, bs: int = 16):
    spec = jax.ShapeDtypeStruct
    return (spec((8, h, d), dtype), spec((2, 2, 64, bs, kh, d), dtype), spec((), jnp.int32), spec((8, 6), jnp.int32),
            spec((8,), jnp.int32))


@pytest.mark.parametrize("h,kh,d", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("stages", [2, 4])
def test_lowers_for_cuda(h, kh, d, stages):
    text = lower_for_cuda(lambda *a: decode_paged_attention_mgpu(*a, sm_scale=d ** -0.5, stages=stages),
                          *_args(h, kh, d))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("h,kh,d,dtype,bs,match", [
    (9, 3, 64, jnp.float32, 16, "bf16/f16"),
    (8, 8, 32, jnp.bfloat16, 16, "head_dim"),
    (9, 2, 64, jnp.bfloat16, 16, "multiple of KV heads"),
    (8, 8, 64, jnp.bfloat16, 48, "block_size"),
    (8, 8, 64, jnp.bfloat16, 4, "multiple of 8"),
    (8, 8, 512, jnp.bfloat16, 16, "up to 256"),
    (8, 8, 256, jnp.bfloat16, 16, "shared memory"),  # at 4 stages
])
def test_rejects_what_it_cannot_do(h, kh, d, dtype, bs, match):
    args = [jnp.zeros(a.shape, a.dtype) for a in _args(h, kh, d, dtype, bs)]
    with pytest.raises(ValueError, match=match):
        decode_paged_attention_mgpu(*args, sm_scale=0.1, stages=4)
