"""Verification of draft tokens inside the jitted step: rejection sampling that keeps the target distribution.

A draft token d proposed with certainty (n-gram drafts are deterministic, q = one-hot) is accepted with
probability min(1, p(d) / q(d)) = p(d) under the target distribution p (after temperature, min-p, top-k and
top-p, exactly as the sampler draws); on rejection the token is drawn from the residual max(0, p - q), which
is p without d, renormalized. So each emitted token is distributed as p, and greedy rows accept exactly when
the draft is the argmax. The first rejected position ends the row's tokens; when every draft is accepted the
step's ordinary draw at the last draft (the bonus token) follows them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.layers.logits_processors import apply_min_p
from jaxpaged.layers.sampler import SamplingMetadata, categorical_from_uniform, first_argmax, top_k_top_p_mask
from jaxpaged.layers.step_features import ON_DEVICE, StepFeatures, branch

_ACCEPT, _RESIDUAL = 1, 2  # fold_in tags: the acceptance uniform and the residual draw of one position


def target_logits(x: Float[Array, "N V"], temperature, top_k, top_p, min_p, features: StepFeatures = ON_DEVICE
                  ) -> Float[Array, "N V"]:
    """Tempered logits with everything the sampler would never draw set to -inf (the sampler's filters)."""
    v = x.shape[-1]
    greedy = temperature <= 0
    scaled = x.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)[:, None]
    scaled = branch(features.min_p, lambda: jnp.any(min_p > 0), apply_min_p, lambda y, _: y, scaled, min_p)
    return branch(features.filter, lambda: jnp.any(((top_k > 0) & (top_k < v)) | (top_p < 1.0)), top_k_top_p_mask,
                  lambda y, *_: y, scaled, top_k, top_p)


def verify_drafts(draft_logits: Float[Array, "D V"], draft_tokens: Int[Array, "D"], draft_seq: Int[Array, "D"],
                  draft_pos: Int[Array, "D"], bonus: Int[Array, "S"], meta: SamplingMetadata, k: int,
                  features: StepFeatures = ON_DEVICE) -> tuple[Int[Array, "S K1"], Int[Array, "S"]]:
    """The tokens each sequence emits: its accepted drafts, then the residual draw at the first rejection, or the
    bonus token when all were accepted. Returns (emitted [S, k + 1], -1 past the end; count [S] >= 1).

    Drafts come flat (D entries, -1 tokens for padding): draft j of sequence s, with the target's logits for its
    position (computed at the token before it). A sequence without drafts emits its bonus token only.
    """
    s = bonus.shape[0]
    p = meta.processors
    seq = jnp.minimum(draft_seq, s - 1)
    x = target_logits(draft_logits, meta.temperature[seq], meta.top_k[seq], meta.top_p[seq], p.min_p[seq],
                      features)  # [D, V]
    valid = draft_tokens >= 0
    rows = jnp.where(valid, draft_seq, s)  # padding scatters out of range (dropped)
    on_grid = lambda values, fill: jnp.full((s, k), fill, values.dtype).at[rows, draft_pos].set(  # noqa: E731
        values, mode="drop")  # [D] -> [S, k]
    tokens_sk = on_grid(draft_tokens, -1)
    num_drafts = jnp.sum(tokens_sk >= 0, axis=1)
    d = jnp.maximum(draft_tokens, 0)

    # each position's random key from the output index it draws (the bonus draws at `steps`)
    steps = meta.steps[seq] - num_drafts[seq] + draft_pos
    keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(meta.seeds[seq], steps)
    u_accept = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _ACCEPT)))(keys)  # [0, 1)
    u_draw = 1.0 - jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, _RESIDUAL)))(keys)  # (0, 1]

    v = x.shape[-1]
    logp = jax.nn.log_softmax(x, axis=-1)
    p_draft = jnp.exp(jnp.take_along_axis(logp, d[:, None], axis=-1)[:, 0])
    weights = jnp.exp(x - x.max(axis=-1, keepdims=True))
    residual = jnp.where(jnp.arange(v)[None, :] == d[:, None], 0.0, weights)  # p without the draft
    argmax = first_argmax(x)
    greedy = meta.temperature[seq] <= 0
    accept = on_grid(jnp.where(greedy, argmax == d, u_accept < p_draft) & valid, False)
    recovered = on_grid(jnp.where(greedy, argmax, categorical_from_uniform(residual, u_draw)).astype(jnp.int32), -1)

    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # leading accepts [S]
    last = jnp.where(num_accepted < num_drafts,
                     jnp.take_along_axis(recovered, jnp.minimum(num_accepted, k - 1)[:, None], axis=1)[:, 0],
                     bonus)
    col = jnp.arange(k + 1)[None, :]
    drafts = jnp.pad(tokens_sk, ((0, 0), (0, 1)), constant_values=-1)
    emitted = jnp.where(col < num_accepted[:, None], drafts, jnp.where(col == num_accepted[:, None], last[:, None],
                                                                       -1))
    return emitted.astype(jnp.int32), (num_accepted + 1).astype(jnp.int32)
