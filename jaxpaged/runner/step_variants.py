"""The compiled variants of each bucket's step when the host decides its branches (`layers/step_features.py`).

Warmup compiles each bucket's variant for an empty step (the one the warm runs and timings use); a step whose
feature set is new compiles its variant once, on first use, and keeps it: the compile guard allows that one
compile per (bucket, feature set), since no step shape escaped its bucket."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax

from jaxpaged.layers.sample_rows import head_rows
from jaxpaged.layers.step_features import ON_DEVICE, StepFeatures, host_features

logger = logging.getLogger(__name__)


class StepVariants:
    """(bucket, features) -> compiled step; `jitted(t, features)` makes the jitted function to compile."""

    def __init__(self, enabled: bool, jitted: Callable[[int, StepFeatures], Callable], *, num_slots: int,
                 vocab_size: int, draft_model: bool):
        self.enabled = enabled
        self._jitted = jitted
        self._num_slots, self._vocab_size, self._draft_model = num_slots, vocab_size, draft_model
        self.warm: dict[int, StepFeatures] = {}  # bucket -> the variant warmup compiled
        self._compiled: dict[tuple[int, StepFeatures], jax.stages.Compiled] = {}

    def features(self, inp, *, constrained: bool) -> StepFeatures:
        """The step's feature set (`ON_DEVICE` when the device decides)."""
        if not self.enabled:
            return ON_DEVICE
        return host_features(inp, head_rows=head_rows(inp.draw_rows.shape[0]), num_slots=self._num_slots,
                             constrained=constrained, vocab_size=self._vocab_size, draft_model=self._draft_model)

    def is_warm(self, t: int, features: StepFeatures) -> bool:
        return not self.enabled or self.warm.get(t) == features

    def get(self, t: int, features: StepFeatures, args) -> jax.stages.Compiled:
        """Bucket t's step for `features`, compiled against `args` the first time it is asked for."""
        step = self._compiled.get((t, features))
        if step is None:
            start = time.perf_counter()
            step = self._compiled[t, features] = self._jitted(t, features).lower(*args).compile()
            logger.info("Compiled the %d-token step's variant %s in %.1f s (%d variants now)", t,
                        features.describe(), time.perf_counter() - start, len(self._compiled))
        return step

    def clear(self) -> None:
        self._compiled = {}
