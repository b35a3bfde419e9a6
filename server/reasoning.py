"""Reasoning parsers by vLLM's names (`--reasoning-parser`): a reasoning model's thinking, `<think>...</think>`,
split from its answer as the text is generated, into `reasoning_content` and `content`.

deepseek_r1: the DeepSeek-R1 template opens the thinking in the prompt, so the reply starts inside it (a `<think>`
the model writes anyway is dropped); a reply that never closes it is all reasoning. qwen3: the reply thinks only
when it starts with `<think>`, or when the prompt ends with one (Qwen3's thinking-only models). With either, a
prompt that ends with the thinking closed (`enable_thinking: false`: the template writes `<think></think>`) has a
reply that is all content."""

from __future__ import annotations

from dataclasses import dataclass

from server.tool_parsers.base import held_back

START, END = "<think>", "</think>"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    def __init__(self, start: str = "maybe") -> None:
        """start: "inside" (the reply begins inside the thinking), "closed" (the prompt has closed it: all
        content) or "maybe" (the reply thinks if it begins with <think>)."""
        self.inside = start == "inside"
        self._mode = "content" if start == "closed" else "start"  # start -> reasoning -> content, or -> content
        self._buf = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ReasoningDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(START):
                self._buf, self._mode = head[len(START):], "reasoning"
            elif not final and START.startswith(head):  # (nothing yet, or the tag's beginning)
                return out
            else:
                self._mode = "reasoning" if self.inside else "content"
        if self._mode == "reasoning":
            k = self._buf.find(END)
            if k < 0:
                keep = 0 if final else held_back(self._buf, END)
                out.reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return out
            out.reasoning, self._buf, self._mode = self._buf[:k], self._buf[k + len(END):], "content"
        out.content, self._buf = self._buf, ""
        return out

    @property
    def in_answer(self) -> bool:
        """The thinking is over (what follows is the answer)."""
        return self._mode == "content"


def reply_start(name: str, prompt_text: str) -> str:
    """Where parser `name`'s reply to this prompt begins: "inside" the thinking, after it ("closed"), or "maybe"."""
    tail = prompt_text.rstrip()
    if tail.endswith(END):
        return "closed"
    return "inside" if name == "deepseek_r1" or tail.endswith(START) else "maybe"


REASONING_PARSERS = ("deepseek_r1", "qwen3")
