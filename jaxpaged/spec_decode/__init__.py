"""Speculative decoding: a proposer guesses the next k tokens of a request on the host (n-gram prompt lookup),
the step verifies them in one forward pass (k + 1 query tokens per sequence through the ragged attention) and
rejection sampling keeps the target distribution exactly; rejected tokens' KV is rolled back."""

from jaxpaged.config.speculative import SpeculativeConfig
from jaxpaged.spec_decode.ngram import propose_ngram

__all__ = ["SpeculativeConfig", "propose_ngram"]
