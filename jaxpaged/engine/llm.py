"""`LLM`: offline batched generation, vLLM's Python API."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.beam_search import BeamSearcher, BeamSearchOutput, BeamSearchParams
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.output_processor import RequestOutputKind
from jaxpaged.lora_request import LoRARequest
from jaxpaged.request import RequestOutput
from jaxpaged.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]


def _split_prompts(prompts) -> tuple[list[str | list[int]], list[str | None]]:
    """str | list[int] | dict | a list of those -> (str or token-id lists, each one's `cache_salt` or None).
    A dict prompt is vLLM's TextPrompt / TokensPrompt: 'prompt' or 'prompt_token_ids', optional 'cache_salt'."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        prompts = [list(prompts)]
    out: list[str | list[int]] = []
    salts: list[str | None] = []
    for p in prompts:
        salts.append(p.get("cache_salt") if isinstance(p, dict) else None)
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append(list(p["prompt_token_ids"]))
            elif "prompt" in p:
                out.append(p["prompt"])
            else:
                raise ValueError("prompts: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(p, str) or (isinstance(p, Sequence) and all(isinstance(t, int) for t in p)):
            out.append(p if isinstance(p, str) else list(p))
        else:
            raise ValueError(f"prompts: expected str or list of token ids, got {type(p).__name__}")
    return out, salts


def _per_prompt(lora_request, n: int) -> list:
    """One LoRARequest (or None) per prompt, from one for all or a list of them."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request: got {len(loras)} for {n} prompts")
    return loras


class LLM:
    """An engine for offline generation: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    Keyword arguments are the engine flags (`block_size`, `max_num_seqs`, `max_num_batched_tokens`,
    `num_kv_blocks`, `kv_cache_memory`, `dtype`, `seed`, ...). With no model, the default SmolLM2.
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        unknown = set(engine_args) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {sorted(unknown)}")
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_args))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An `LLM` over an engine built elsewhere (e.g. `LLMEngine.from_engine_args(args, setup)`)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one finished `RequestOutput` per prompt, in order.

        priority: one int per prompt (lower runs first) for the priority and hybrid scheduling policies.
        lora_request: the LoRA adapter for every prompt, or one per prompt (None: the base model); the engine
        needs enable_lora."""
        prompts, salts = _split_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts) or not all(isinstance(x, int) and not isinstance(x, bool) for x in priority):
            raise ValueError(f"priority: need one int per prompt ({len(prompts)}), got {priority!r}")
        loras = _per_prompt(lora_request, len(prompts))
        ids = []
        try:
            for p, sp, prio, salt, lora in zip(prompts, params, priority, salts, loras):
                ids.append(self.engine.add_request(None, p, sp, priority=prio, cache_salt=salt, lora_request=lora,
                                                   output_kind=RequestOutputKind.FINAL_ONLY))
        except Exception:
            self.engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt (HF's algorithm, early stopping); one `BeamSearchOutput` per prompt, in
        order, whose `.sequences` are the beam_width best, best first. Beams share KV blocks. lora_request: as
        `generate`'s."""
        prompts, salts = _split_prompts(prompts)
        loras = _per_prompt(lora_request, len(prompts))
        ids = [self.engine.tokenize(p) if isinstance(p, str) else list(p) for p in prompts]
        bar = tqdm(total=len(ids), desc="Beam search", unit="prompt", disable=not use_tqdm, dynamic_ncols=True)
        try:
            return BeamSearcher(self.engine, params).run(ids, progress=bar, cache_salts=salts, lora_requests=loras)
        finally:
            bar.close()

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate
        (lora_request: as `generate`'s)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            list(self.engine.tokenizer.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=True,
                return_dict=True)["input_ids"])
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # -- snapshots ----------------------------------------------------------------------------
    def save_state(self, path: str) -> int:
        """Save every unfinished request (prompt, tokens so far, sampling params and seeds) as a snapshot in
        folder `path`, atomically; the engine goes on unchanged. Returns how many requests were saved."""
        return self.engine.save_state(path)

    def load_state(self, path: str) -> list[str]:
        """Queue the requests of the newest intact snapshot in `path` (from an engine with the same model and
        dtype); returns their ids. `run_until_finished(ids)` then gives their outputs, the same an uninterrupted
        run gives for greedy and seeded requests."""
        return self.engine.load_state(path, kind=RequestOutputKind.FINAL_ONLY)  # (a server's were streams)

    def run_until_finished(self, request_ids: Sequence[str] | None = None, *, use_tqdm: bool = True
                           ) -> list[RequestOutput]:
        """Step until every unfinished request ends; the final outputs of `request_ids` (default: all of
        them), in order."""
        ids = list(self.engine.output.parents) if request_ids is None else list(request_ids)
        unknown = [i for i in ids if not self.engine.output.has(i)]
        if unknown:
            raise ValueError(f"request_ids: {unknown[:5]} are not unfinished requests of this engine")
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        generated += sum(len(o.token_ids) for o in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {generated / (time.perf_counter() - start):.1f} tok/s")
        finally:
            bar.close()
            self.engine.abort_request([i for i in ids if i not in results])
        return [results[i] for i in ids]
