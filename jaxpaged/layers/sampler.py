"""Token selection inside the jitted step: processors, temperature, min-p, top-k/top-p, seeds, logprobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32

from jaxpaged.layers.logits_processors import ProcessorInputs, RowState, apply_min_p, process_logits
from jaxpaged.layers.step_features import ON_DEVICE, StepFeatures, branch
from jaxpaged.sampling_params import MAX_LOGPROBS
from pallas_kernels.sampling import (
    categorical_from_uniform,
    first_argmax,
    reference_top_k_top_p_sampling,
    top_k_top_p_mask,
    top_k_top_p_sampling,
)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling settings for one step (rows = scheduled sequences, padded)."""

    temperature: Float[Array, "S"]  # 0 = greedy
    top_k: Int[Array, "S"]  # 0 = off
    top_p: Float[Array, "S"]  # 1 = off
    seeds: UInt32[Array, "S"]  # the request's seed
    steps: Int[Array, "S"]  # index of the output token being drawn
    num_logprobs: Int[Array, "S"]  # -1: no logprobs; k >= 0: the sampled token and the top k
    processors: ProcessorInputs

    def head(self, k: int) -> SamplingMetadata:
        """The first k rows' settings (every field but the processors' is per row)."""
        rows = {f.name: getattr(self, f.name)[:k] for f in dataclasses.fields(self) if f.name != "processors"}
        return SamplingMetadata(**rows, processors=self.processors.head(k))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplerOutput:
    """What the step returns per row: the token, and its logprob information."""

    token_ids: Int[Array, "S"]
    logprob: Float[Array, "S"]  # of the sampled token (0 where not asked)
    rank: Int[Array, "S"]  # 1 = most likely
    top_ids: Int[Array, "S K"]  # K = MAX_LOGPROBS
    top_logprobs: Float[Array, "S K"]


def request_keys(seeds: UInt32[Array, "S"], steps: Int[Array, "S"]):
    """Key per row from (seed, output index) only, so a seeded request draws the same tokens in any batch."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, steps)


def _draw(x: Float[Array, "S V"], meta: SamplingMetadata, backend: str, features: StepFeatures) -> Int[Array, "S"]:
    greedy = meta.temperature <= 0
    scaled = x / jnp.where(greedy, 1.0, meta.temperature)[:, None]
    min_p = meta.processors.min_p
    scaled = branch(features.min_p, lambda: jnp.any(min_p > 0), apply_min_p, lambda y, _: y, scaled, min_p)
    keys = request_keys(meta.seeds, meta.steps)
    temperature = jnp.where(greedy, 0.0, 1.0)  # already applied
    return filtered_draw(scaled, keys, temperature, meta.top_k, meta.top_p, backend, features.filter)


def filtered_draw(x: Float[Array, "S V"], keys, temperature: Float[Array, "S"], top_k: Int[Array, "S"],
                  top_p: Float[Array, "S"], backend: str, needs_filter: bool | None = None) -> Int[Array, "S"]:
    """A token per row drawn after top-k and top-p filtering (greedy where temperature is 0): the sort-free
    Pallas kernel ("pallas", "pallas-interpret") or the sorting reference (needs_filter: whether some row filters,
    known on the host; None: decided on the device)."""
    if backend in ("pallas", "pallas-interpret"):
        return top_k_top_p_sampling(x, keys, temperature, top_k, top_p, interpret=backend == "pallas-interpret")
    return reference_top_k_top_p_sampling(x, keys, temperature, top_k, top_p, needs_filter=needs_filter)


def token_logprobs(source: Float[Array, "N V"], tokens: Int[Array, "N"]):
    """Log-probability and rank of `tokens` under `source` logits, and the top MAX_LOGPROBS alternatives."""
    lsm = jax.nn.log_softmax(source.astype(jnp.float32), axis=-1)
    tok = jnp.take_along_axis(lsm, tokens[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lsm > tok[:, None], axis=-1).astype(jnp.int32) + 1
    top_lp, top_ids = jax.lax.top_k(lsm, MAX_LOGPROBS)
    return tok, rank, top_ids.astype(jnp.int32), top_lp


def sample(logits: Float[Array, "S V"], row_state: RowState, meta: SamplingMetadata, *,
           logprobs_mode: str = "raw_logprobs", backend: str = "reference",
           features: StepFeatures = ON_DEVICE) -> SamplerOutput:
    """Next token per row. All-greedy batches skip the random draw; batches without logprobs skip top-k.

    backend: "reference" (sorts rows), "pallas" (the sort-free kernel) or "pallas-interpret".
    """
    processed = process_logits(logits, row_state, meta.processors, features)
    tokens = branch(features.sampling, lambda: ~jnp.all(meta.temperature <= 0),
                    lambda x: _draw(x, meta, backend, features), first_argmax, processed)
    source = logits if logprobs_mode == "raw_logprobs" else processed
    s = logits.shape[0]
    none = (jnp.zeros(s, jnp.float32), jnp.zeros(s, jnp.int32), jnp.zeros((s, MAX_LOGPROBS), jnp.int32),
            jnp.zeros((s, MAX_LOGPROBS), jnp.float32))
    lp, rank, top_ids, top_lp = branch(features.logprobs, lambda: jnp.any(meta.num_logprobs >= 0), token_logprobs,
                                       lambda *_: none, source, tokens)
    return SamplerOutput(tokens, lp, rank, top_ids, top_lp)


# (with the kernels' pieces that speculative verification and the functional API also use)
__all__ = ["SamplerOutput", "SamplingMetadata", "categorical_from_uniform", "filtered_draw", "first_argmax",
           "request_keys", "sample", "token_logprobs", "top_k_top_p_mask"]
