"""n-gram prompt lookup (vLLM's `ngram` method): drafts copied from earlier in the request's own tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to `k` draft tokens for `tokens` [L] (prompt + output so far): find the most recent earlier
    occurrence of its last n tokens, longest n in [min_n, max_n] first, and return the tokens that followed
    it. Empty when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at i cover tokens[i : i + n]; they end before the last token so one follows
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]
