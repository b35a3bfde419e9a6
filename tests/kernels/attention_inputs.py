"""Random paged-attention steps laid out as the model runner lays them out."""

import jax.numpy as jnp
import numpy as np


def make_step(rng, seqs, *, block_size=16, kh=2, group=3, d=16, table_width=16, num_blocks=120, layers=2,
              dtype=jnp.float32, runner_order=True):
    """seqs: list of (context_len, new_tokens), laid out as the runner does (decodes first, longest first),
    or in the given order (runner_order=False)."""
    if runner_order:
        seqs = sorted(seqs, key=lambda s: (2 if s[0] == 0 else (0 if s[1] == 1 else 1), -s[0]))
    h = kh * group
    pool = jnp.asarray(rng.normal(size=(layers, 2, num_blocks, block_size, kh, d)), dtype)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seqs), table_width), np.int32)
    token_seq, positions, decode_ctx, slots = [], [], [], []
    seq_ctx = np.zeros(len(seqs), np.int32)
    cont_rows = np.full(len(seqs), -1, np.int32)
    used = 0
    for i, (ctx, n) in enumerate(seqs):
        nb = -(-(ctx + n) // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        pos = np.arange(ctx, ctx + n)
        token_seq += [i] * n
        positions += pos.tolist()
        decode_ctx += [ctx if n == 1 else 0] * n
        seq_ctx[i] = ctx
        if ctx and n > 1:
            cont_rows[np.argmax(cont_rows < 0)] = i
        slots += (tables[i, pos // block_size] * block_size + pos % block_size).tolist()
    t = len(token_seq) + 3  # three padding tokens
    pad = num_blocks * block_size
    arr = lambda x, fill: jnp.asarray(np.array(x + [fill] * 3, np.int32))  # noqa: E731
    q = jnp.asarray(rng.normal(size=(t, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(t, kh, d)), dtype)
    v = jnp.asarray(rng.normal(size=(t, kh, d)), dtype)
    return dict(q=q, k=k, v=v, pool=pool, tables=jnp.asarray(tables), token_seq=arr(token_seq, -1),
                positions=arr(positions, 0), decode_ctx=arr(decode_ctx, 0), seq_ctx=jnp.asarray(seq_ctx),
                cont_rows=jnp.asarray(cont_rows), slots=arr(slots, pad),
                real=len(token_seq))
