"""Incremental detokenization: text grows token by token without stray replacement characters."""

from __future__ import annotations

CONTEXT = 6  # prompt tokens decoded before the output, so its first token's leading space or merge comes out right


def decode_output(tokenizer, prompt_token_ids: list[int], output_token_ids: list[int], *,
                  skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
    """The text of `output_token_ids` after the prompt, as `IncrementalDetokenizer` gives it, in two decodes."""
    context = list(prompt_token_ids[-CONTEXT:])
    kw = dict(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
    prefix = tokenizer.decode(context, **kw)
    full = tokenizer.decode(context + list(output_token_ids), **kw)
    return full[len(prefix):] if len(full) > len(prefix) else ""


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short window before the new tokens, so byte-level BPE and SentencePiece merges
    (leading spaces, multi-byte UTF-8 split across tokens) come out as the full decode would.
    A delta that ends in an incomplete UTF-8 sequence is held back until the next token.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-CONTEXT:])  # context for the first output tokens
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> str:
        """Append tokens; returns the new text they complete (possibly empty)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a request: release text held back for an incomplete character."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += delta
        return delta
