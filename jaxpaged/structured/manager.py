"""`StructuredOutputManager`: the engine's side of structured output.

At admission it compiles a request's constraint (cached by its text) and gives each of the request's samples
its own llguidance matcher; after each step the matcher takes the drawn token; before each step
`fill_bitmask` writes the allowed-token bits of every constrained row ([rows, ceil(V / 32)] int32, bit v % 32
of word v // 32 set when token v may come next) on llguidance's thread pool. The llguidance tokenizer is
built from the HF tokenizer on the first constrained request (~0.3 s).
"""

from __future__ import annotations

import functools
import json
import logging
import time

import numpy as np

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.width = (vocab_size + 31) // 32  # int32 words per bitmask row
        self.mask_seconds = 0.0  # host time spent computing masks, and rows computed (for benchmarks)
        self.mask_rows = 0
        self._grammars: dict[str, str] = {}  # compiled grammars by their constraint's JSON

    @functools.cached_property
    def tokenizer(self):
        from jaxpaged.structured.grammar import _llguidance

        _llguidance()  # (a ValueError naming the field where llguidance is missing)
        import llguidance.hf

        try:
            return llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                eos_token=list(self.eos_token_ids) or None)
        except Exception as e:  # (ValueError for a decoder it cannot read; AttributeError for a slow tokenizer)
            raise ValueError(f"structured_outputs: this model's tokenizer cannot be read by the grammar engine "
                             f"(llguidance needs a fast byte-level BPE or SentencePiece tokenizer): {e}") from None

    @functools.cached_property
    def executor(self):
        import llguidance

        return llguidance.LLExecutor()

    def grammar(self, params) -> str:
        """The validated grammar for a StructuredOutputsParams (cached by its fields); ValueError naming the
        field if unusable."""
        from jaxpaged.structured.grammar import compile_grammar

        # (no sort_keys: a schema's property order is its output order)
        key = json.dumps({k: v for k, v in vars(params).items() if v not in (None, False)})
        if key not in self._grammars:
            if len(self._grammars) >= 256:
                self._grammars.pop(next(iter(self._grammars)))  # the oldest
            self._grammars[key] = compile_grammar(params, self.tokenizer)
        return self._grammars[key]

    def matcher(self, grammar: str):
        from llguidance import LLMatcher

        m = LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return m

    def fill_bitmask(self, bitmask: np.ndarray, rows: list[tuple[object, int]]) -> None:
        """Write the allowed tokens of each (matcher, row) into bitmask[row]; a matcher in an error state (it
        took a token its grammar forbids, which the mask prevents) allows only EOS, so the request ends."""
        from llguidance.numpy import fill_next_token_bitmask_par

        start = time.perf_counter()
        fill_next_token_bitmask_par(self.executor, rows, bitmask)
        for m, row in rows:
            if m.is_error():
                logger.warning("structured output matcher in error (%s): allowing only EOS", m.get_error())
                words = bitmask.view(np.uint32)
                words[row] = 0
                for eos in self.eos_token_ids:
                    words[row, eos // 32] |= np.uint32(1 << (eos % 32))
        self.mask_seconds += time.perf_counter() - start
        self.mask_rows += len(rows)
