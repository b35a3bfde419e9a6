"""Seeded synthetic workloads: random-token prompts with prompt and output lengths drawn from ranges."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def parse_range(text: str) -> tuple[int, int]:
    """'128' -> (128, 128); '16:512' -> (16, 512), both ends included."""
    lo, _, hi = str(text).partition(":")
    lo_i, hi_i = int(lo), int(hi or lo)
    if lo_i < 1 or hi_i < lo_i:
        raise ValueError(f"bad length range {text!r}: expected N or LO:HI with 1 <= LO <= HI")
    return lo_i, hi_i


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_token_workload(num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int],
                          vocab_size: int, seed: int, avoid_ids: set[int] = frozenset()) -> list[BenchRequest]:
    """`num_prompts` requests of random token ids (avoiding special tokens), lengths uniform in the ranges."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(avoid_ids, int, len(avoid_ids)))
    out = []
    for _ in range(num_prompts):
        n_in = int(rng.integers(input_len[0], input_len[1] + 1))
        n_out = int(rng.integers(output_len[0], output_len[1] + 1))
        out.append(BenchRequest(rng.choice(allowed, size=n_in).tolist(), n_out))
    return out


def shared_prefix_workload(num_prompts: int, prefix_len: int, suffix_len: int, output_len: int, vocab_size: int,
                           seed: int, avoid_ids: set[int] = frozenset()) -> list[BenchRequest]:
    """`num_prompts` requests that share one random `prefix_len`-token prefix and differ in a random suffix."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(avoid_ids, int, len(avoid_ids)))
    prefix = rng.choice(allowed, size=prefix_len).tolist()
    return [BenchRequest(prefix + rng.choice(allowed, size=suffix_len).tolist(), output_len)
            for _ in range(num_prompts)]


def _passages(min_words: int = 40) -> list[str]:
    """English paragraphs shipped with the package (its modules' docstrings), for copy workloads."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    out = []
    for path in sorted(root.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        out += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.split()) >= min_words]
    return out


def copy_workload(num_prompts: int, tokenizer, seed: int, max_output_len: int = 256) -> list[BenchRequest]:
    """Chat prompts asking to repeat a paragraph word for word (what n-gram speculation is for); each request
    generates as many tokens as the paragraph has, capped at `max_output_len`."""
    rng = np.random.default_rng(seed)
    passages = _passages()
    out = []
    for i in rng.permutation(len(passages))[:num_prompts].tolist() * (num_prompts // len(passages) + 1):
        text = passages[i]
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat the following text word for word.\n\n{text}"}],
            add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        n_out = min(len(tokenizer.encode(text, add_special_tokens=False)), max_output_len)
        out.append(BenchRequest(list(ids), n_out))
    return out[:num_prompts]
