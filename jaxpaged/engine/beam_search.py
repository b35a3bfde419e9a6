"""Beam search on the paged engine: beams are requests that fork (share blocks) and die (free them).

The search is HF transformers' (`generate(num_beams=W, early_stopping=True)`): each step takes the
top 2W (W x (1 + number of EOS ids) with several EOS ids) continuations of all live beams by
cumulative logprob; those that end (EOS, or max_tokens reached) among the first W become finished
hypotheses scored cum_logprob / length ** length_penalty, and the best W that go on become the next
beams. A prompt is done when it has W finished hypotheses (HF's early_stopping=True), or at max_tokens.

Each live beam is one engine request held after every step (its sampled token is not appended);
the search appends the chosen token. A beam chosen by several continuations forks: the children
share all its blocks, and copy-on-write gives each its own copy of the last, partly filled block
when it writes there. Beams not chosen are aborted, which frees their references.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from jaxpaged.request import Logprob, Request, check_cache_salt
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters (validated on construction)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature != 0.0:
            raise ValueError(f"temperature: beam search here is deterministic (0.0), got {self.temperature}")


@dataclass
class BeamSearchSequence:
    """One returned hypothesis. `tokens` include the prompt (as in vLLM); `text` is the generated text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    score: float = 0.0  # cum_logprob / generated_length ** length_penalty (what the beams are ranked by)


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    request: Request
    tokens: list[int]  # generated so far
    cum_logprob: float
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


@dataclass
class _Search:
    """One prompt's search state."""

    prompt_ids: list[int]
    beams: list[_Beam]
    finished: list[BeamSearchSequence] = field(default_factory=list)  # best score first, at most W
    done: bool = False


def num_candidates(params: BeamSearchParams, eos_token_ids) -> int:
    """Continuations kept per step: HF's max(2, 1 + number of EOS ids) x beam_width."""
    n_eos = 0 if params.ignore_eos else len(eos_token_ids)
    return max(2, 1 + n_eos) * params.beam_width


class BeamSearcher:
    """Runs beam searches for a batch of prompts on an `LLMEngine` (which may serve other requests too)."""

    def __init__(self, engine, params: BeamSearchParams):
        self.engine, self.params = engine, params
        self.eos = set() if params.ignore_eos else set(engine.config.model_config.eos_token_ids)
        self.k = num_candidates(params, self.eos)
        if self.k > MAX_LOGPROBS:
            raise ValueError(f"beam_width: {params.beam_width} beams need {self.k} candidates per step, more than "
                             f"the {MAX_LOGPROBS} logprobs a step returns (beam_width <= {MAX_LOGPROBS // 2})")
        if params.beam_width > engine.config.scheduler_config.max_num_seqs:
            raise ValueError(f"beam_width: {params.beam_width} beams exceed max_num_seqs="
                             f"{engine.config.scheduler_config.max_num_seqs}")
        self.sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, logprobs=self.k,
                                       ignore_eos=True)
        self._ids = itertools.count()

    def run(self, prompts: list[list[int]], progress=None, cache_salts: list[str | None] | None = None,
            lora_requests: list | None = None) -> list[BeamSearchOutput]:
        """Search every prompt; as many at once as max_num_seqs has room for beam_width beams each. cache_salts:
        each prompt's `cache_salt` (`LLMEngine.make_requests`), or None; lora_requests: each prompt's LoRA adapter
        (a LoRARequest or None; its beams share it)."""
        max_len = self.engine.config.scheduler_config.max_model_len
        salts = list(cache_salts) if cache_salts is not None else [None] * len(prompts)
        loras = [self.engine.resolve_lora(r) for r in lora_requests] if lora_requests else [None] * len(prompts)
        for ids, salt in zip(prompts, salts):
            check_cache_salt(salt)
            self.engine.validate_prompt(ids, self.sampling)
            if len(ids) + self.params.max_tokens > max_len:
                raise ValueError(f"max_tokens: a prompt of {len(ids)} tokens + max_tokens={self.params.max_tokens} "
                                 f"exceeds max_model_len={max_len}")
        capacity = max(1, self.engine.config.scheduler_config.max_num_seqs // self.params.beam_width)
        searches: list[_Search] = []
        try:
            while len(searches) < len(prompts) or not all(s.done for s in searches):
                while len(searches) < len(prompts) and sum(not s.done for s in searches) < capacity:
                    searches.append(self._start(prompts[len(searches)], salts[len(searches)], loras[len(searches)]))
                steps = self.engine.stats.num_steps
                self.engine.step()
                expanded = False
                for s in searches:
                    if not s.done and all(b.request.num_computed_tokens == b.request.num_tokens
                                          and not b.request.num_output_placeholders for b in s.beams):
                        self._expand(s)
                        expanded = True
                        if s.done and progress is not None:
                            progress.update(1)
                if not expanded and self.engine.stats.num_steps == steps:
                    raise RuntimeError("beam search made no progress: the engine scheduled nothing")
        finally:
            for s in searches:
                for b in s.beams if not s.done else []:
                    self.engine.abort_held_request(b.request)
        return [self._output(s) for s in searches]

    def _start(self, ids: list[int], salt: str | None, lora=None) -> _Search:
        req = self.engine.add_held_request(f"beam-{next(self._ids)}", ids, self.sampling, cache_salt=salt, lora=lora)
        return _Search(ids, [_Beam(req, [], 0.0)])

    def _expand(self, s: _Search) -> None:
        p, w = self.params, self.params.beam_width
        decode = self.engine.tokenizer.convert_ids_to_tokens
        cands = []  # (cumulative logprob, beam index, token, its logprob entry)
        for bi, beam in enumerate(s.beams):
            _, _, top_ids, top_lps = beam.request.output_logprobs[-1]
            beam.request.output_logprobs.clear()  # (a recompute after preemption may have added one more)
            entry = {t: Logprob(v, r + 1, decode(t)) for r, (t, v) in enumerate(zip(top_ids, top_lps))}
            cands += [(beam.cum_logprob + lp, bi, tok, entry) for tok, lp in zip(top_ids[: self.k], top_lps[: self.k])]
        vocab = self.engine.config.model_config.vocab_size
        cands.sort(key=lambda c: (-c[0], c[1] * vocab + c[2]))  # torch.topk order over beam-major indices
        cands = cands[: self.k]
        gen_len = len(s.beams[0].tokens) + 1
        at_max = gen_len >= p.max_tokens
        ends = [at_max or c[2] in self.eos for c in cands]
        for (cum, bi, tok, entry), end in zip(cands[:w], ends[:w]):  # those in the top W that end: hypotheses
            if end:
                beam = s.beams[bi]
                s.finished.append(BeamSearchSequence(
                    s.prompt_ids + beam.tokens + [tok], beam.logprobs + [entry], cum,
                    finish_reason="stop" if tok in self.eos else "length", score=cum / gen_len ** p.length_penalty))
        s.finished = sorted(s.finished, key=lambda q: -q.score)[:w]  # stable: earlier hypotheses first on ties
        going = [c for c, end in zip(cands, ends) if not end][:w]
        s.done = len(s.finished) == w or at_max or not going  # early_stopping=True: done with W hypotheses
        self._advance(s, [] if s.done else going)

    def _advance(self, s: _Search, going) -> None:
        """Make the chosen continuations the next beams, in rank order: a parent chosen once goes on as
        itself, one chosen k times forks k-1 children first (sharing its blocks), one not chosen is freed."""
        eng = self.engine
        counts: dict[int, int] = {}
        for c in going:
            counts[c[1]] = counts.get(c[1], 0) + 1
        requests: dict[int, list[Request]] = {}
        for bi, beam in enumerate(s.beams):
            if bi not in counts:
                eng.abort_held_request(beam.request)
                continue
            forks = [eng.fork_held_request(beam.request, f"beam-{next(self._ids)}") for _ in range(counts[bi] - 1)]
            requests[bi] = [beam.request, *forks]
        next_beams = []
        for cum, bi, tok, entry in going:
            req = requests[bi].pop(0)
            req.output_token_ids.append(tok)
            parent = s.beams[bi]
            next_beams.append(_Beam(req, parent.tokens + [tok], cum, parent.logprobs + [entry]))
        s.beams = next_beams

    def _output(self, s: _Search) -> BeamSearchOutput:
        for seq in s.finished:
            gen = seq.tokens[len(s.prompt_ids):]
            if seq.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                gen = gen[:-1]
            seq.text = self.engine.tokenizer.decode(gen, skip_special_tokens=True)
        return BeamSearchOutput(s.finished)

