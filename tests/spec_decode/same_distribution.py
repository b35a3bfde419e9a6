"""Chi-square check that two samplers' tokens at each output position come from the same distribution."""

import numpy as np
from scipy import stats


def assert_same_distribution(a: np.ndarray, b: np.ndarray, positions) -> None:
    """a, b [n, tokens]: per position, a contingency table of token counts (tokens seen < 10 times pooled);
    the chi-square p-value must exceed 1e-3."""
    for pos in positions:
        values = np.union1d(a[:, pos], b[:, pos])
        table = np.array([[np.sum(x[:, pos] == v) for v in values] for x in (a, b)])
        common = table.sum(0) >= 10
        table = np.concatenate([table[:, common], table[:, ~common].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
        assert stats.chi2_contingency(table).pvalue > 1e-3, (pos, table)
