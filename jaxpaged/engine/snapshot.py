"""Engine snapshots: every unfinished request saved with orbax, then continued by another engine.

A snapshot holds each user request (prompt, sampling params, priority, how it wants its outputs) and each of
its samples (seed, the tokens generated so far and their logprobs, or how it finished). Restoring queues each
unfinished sample as a request preempted by recompute: its prefill recomputes prompt + generated tokens, the
penalties count the same tokens, a grammar matcher replays them, and a sample's draws depend only on its seed
and the index of the output token drawn (the sampler's fold_in(seed, index)). So a restored engine continues
greedy and seeded requests with the tokens an uninterrupted one would draw, up to float rounding: the KV
blocks are not saved but recomputed (a prefill step computes thousands of tokens a second, reading blocks back
would save little), and a prefill's arithmetic is not bit for bit the decodes' it replaces, so a draw that
falls within rounding of a boundary (a near-tie) may come out the other way, rarely (likely the one CI failure
of the server's snapshot test, which compared 15,000 draws from a random model's near-uniform distribution).

On disk, orbax's CheckpointManager: a save is written to a temporary folder and renamed when complete (a save
cut short never looks like a snapshot), the two newest are kept, and the metadata carries a checksum of the
requests, which catches a snapshot damaged later; loading takes the newest intact one. A snapshot names the
model (a fingerprint of its config and weight files), its dtype and the snapshot format, and is refused by an
engine that differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from jaxpaged.engine.output_processor import RequestOutputKind
from jaxpaged.engine.processor_rows import processor_rows
from jaxpaged.kv_offload.identity import model_identity
from jaxpaged.lora_request import LoRARequest
from jaxpaged.request import Request, RequestStatus
from jaxpaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxpaged.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_KEEP = 2  # snapshots kept in a folder: the newest, and the one before in case the newest is damaged


class SnapshotError(ValueError):
    """A snapshot that this engine must not restore (another model, dtype or version), or none intact."""


def _jaxpaged_version() -> str:
    from jaxpaged.version import __version__

    return __version__


def engine_fingerprint(engine: LLMEngine) -> dict:
    """What a snapshot must match to be restored: the snapshot format, jaxpaged's version, the model's dtype and
    a fingerprint of its config and weights (the KV cache's layout does not matter: blocks are recomputed)."""
    mc = engine.config.model_config
    return {"format_version": FORMAT_VERSION, "jaxpaged_version": _jaxpaged_version(), "dtype": mc.dtype,
            "model": mc.model, "model_identity": model_identity(mc, load_format=engine.config.load_format,
                                                                  kv_dtype="-", block_size=0)}


def check_fingerprint(saved: dict, ours: dict, where: str) -> None:
    """Raise SnapshotError naming what differs between a snapshot and this engine."""
    for key, what in (("format_version", "snapshot format"), ("jaxpaged_version", "jaxpaged version"),
                      ("dtype", "model dtype"), ("model_identity", "model (config and weights)")):
        if saved.get(key) != ours[key]:
            raise SnapshotError(f"snapshot {where}: taken with {what} {saved.get(key)!r} (model "
                                f"{saved.get('model')!r}), this engine has {ours[key]!r} (model {ours['model']!r}); "
                                "restore it with the engine that took it")


# -- capture and restore: requests <-> JSON-able dicts -----------------------------------------------------------
def _params_to_json(p: SamplingParams) -> dict:
    d = asdict(p)
    if d["logit_bias"] is not None:
        d["logit_bias"] = {str(k): v for k, v in d["logit_bias"].items()}
    if d["structured_outputs"] is not None:
        d["structured_outputs"] = {k: v for k, v in d["structured_outputs"].items() if v is not None}
    return d


def _plain(x):
    """numpy scalars and arrays inside logprob rows -> JSON numbers and lists."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def capture_requests(engine: LLMEngine) -> list[dict]:
    """Every unfinished user request of `engine`, as JSON-able dicts (in the order they were added)."""
    held = [r.request_id for r in engine.scheduler.requests.values() if r.hold_output and not r.finished]
    if held:
        raise ValueError(f"save_state: a beam search is in progress (requests {held[:3]}); it cannot be saved")
    live = engine.scheduler.requests  # (the engine thread's: it is stopped, or this is it)
    out = []
    for parent in engine.output.parents.values():
        samples, lora = [], None
        first = live.get(parent.samples[0].request_id)  # (the first sample is never a pending fork)
        pending = {r.request_id: r for r in first.pending_forks} if first is not None else {}
        for s in parent.samples:
            req = live.get(s.request_id) or pending.get(s.request_id)
            if req is not None and req.lora is not None:  # (its adapter, by the folder it came from)
                lora = [req.lora.name, req.lora.lora_id, req.lora.path]
            samples.append({
                "request_id": s.request_id, "seed": s.seed,
                "output_token_ids": list(s.token_ids),
                "output_logprobs": _plain(s.token_logprobs),
                "prompt_logprob_rows": _plain(req.prompt_logprob_rows if req is not None
                                              else parent.prompt_logprob_rows or []),
                "num_preemptions": req.num_preemptions if req is not None else 0,
                "num_cached_tokens": req.num_cached_tokens if req is not None else parent.num_cached_tokens,
                "pending_fork": s.request_id in pending,
                "finish_reason": s.finish_reason, "stop_reason": s.stop_reason,
                "final_text": s.final_text if s.finished else None,
            })
        out.append({"request_id": parent.request_id, "prompt": parent.prompt,
                    "prompt_token_ids": list(parent.prompt_token_ids), "kind": parent.kind.name,
                    "priority": parent.priority, "tenant": parent.tenant, "cache_salt": parent.cache_salt,
                    "params": _params_to_json(parent.samples[0].params), "samples": samples, "lora": lora})
    return out


_FINISHED = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
             "abort": RequestStatus.FINISHED_ABORTED}


def restore_requests(engine: LLMEngine, saved: list[dict], *, kind: RequestOutputKind | None = None,
                     queue=None, on_invalid=None) -> list[str]:
    """Queue the saved requests in `engine` (the inverse of `capture_requests`); returns their ids. Every request is
    checked first (ids free; prompt, length and tenant valid here: this engine's pool or tenants may differ), so a
    refusal queues none; or, with `on_invalid(saved request, error)`, the others are queued.

    kind: how they hand out outputs from now on (default: as saved). queue: takes each request's core requests
    to run (default: the scheduler's add_requests; `AsyncLLM` passes them to its engine thread)."""
    plans = []
    for d in saved:
        rid = d["request_id"]
        try:
            if engine.output.has(rid) or any(s["request_id"] in engine.scheduler.requests for s in d["samples"]):
                raise ValueError(f"load_state: request_id {rid!r} is already in use in this engine")
            params = SamplingParams(**d["params"])
            engine.validate_prompt(d["prompt_token_ids"], params, d.get("tenant"))
            rows = processor_rows(params, engine.config.model_config, engine.tokenizer)
            grammar = engine.structured.grammar(params.structured_outputs) if params.structured_outputs else None
            lora = _saved_lora(engine, d.get("lora"))
        except ValueError as e:
            if on_invalid is None:
                raise
            on_invalid(d, e)
            continue
        plans.append((d, params, rows, grammar, lora))
    return [_restore_one(engine, *plan, kind, queue or engine.scheduler.add_requests) for plan in plans]


def _saved_lora(engine: LLMEngine, saved: list | None):
    """A saved request's adapter, by its name and folder (under the id this engine knows it by, or a new one:
    ids are the saving engine's)."""
    if not saved:
        return None
    name, _, path = saved
    if engine.loras is None:
        raise ValueError(f"load_state: a request ran with LoRA adapter {name!r}; this engine has no enable_lora")
    return engine.resolve_lora(LoRARequest(name, engine.loras.id_for(name, path), path))


def _restore_one(engine: LLMEngine, d: dict, params: SamplingParams, rows, grammar: str | None, lora,
                 kind: RequestOutputKind | None, queue) -> str:
    prompt_ids = list(d["prompt_token_ids"])
    structured = engine.structured
    now = time.monotonic()
    requests, pending = [], []
    for s in d["samples"]:
        outputs = list(s["output_token_ids"])
        req = Request(s["request_id"], prompt_ids, params, seed=s["seed"], prompt=d["prompt"],
                      priority=d["priority"], tenant=d.get("tenant"), cache_salt=d.get("cache_salt"),
                      eos_token_ids=engine.config.model_config.eos_token_ids, processor_rows=rows, lora=lora,
                      output_token_ids=outputs, arrival_time=now,
                      output_logprobs=[tuple(x) for x in s["output_logprobs"]],
                      prompt_logprob_rows=[tuple(x) for x in s["prompt_logprob_rows"]],
                      num_preemptions=s["num_preemptions"], num_cached_tokens=s.get("num_cached_tokens", -1))
        if outputs:  # continued like a request preempted by recompute; its first token's latency is history
            req.status, req.first_scheduled_time = RequestStatus.PREEMPTED, now
        if grammar is not None:
            req.grammar_matcher = structured.matcher(grammar)
            for t in outputs:
                req.grammar_matcher.consume_token(t)
        if s["finish_reason"] is not None:
            req.status, req.stop_reason = _FINISHED[s["finish_reason"]], s["stop_reason"]
        elif s["pending_fork"]:
            pending.append(req)
        requests.append(req)
    engine.output.add(d["request_id"], d["prompt"], prompt_ids, requests, kind or RequestOutputKind[d["kind"]])
    engine.output.restore_samples(d["request_id"], d["samples"])
    live = [r for r in requests if not r.finished and r not in pending]
    if pending and live and engine.config.share_forked_blocks and not params.needs_penalties:
        live[0].pending_forks = pending  # (the first sample is never a pending fork: it is the one they fork from)
    else:
        live += pending
    queue(live)
    return d["request_id"]


# -- on disk ----------------------------------------------------------------------------------------------------------
def _checksum(requests: list[dict]) -> str:
    return hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest()


def _manager(path: str):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=_KEEP, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(path), options=options)


def save_snapshot(engine: LLMEngine, path: str) -> int:
    """Write every unfinished request of `engine` as a new snapshot in folder `path`; returns how many."""
    import orbax.checkpoint as ocp

    start = time.perf_counter()
    requests = capture_requests(engine)
    meta = {**engine_fingerprint(engine), "created": time.time(), "num_requests": len(requests),
            "checksum": _checksum(requests)}
    with _manager(path) as mngr:
        step = (mngr.latest_step() or 0) + 1
        mngr.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta),
                                                requests=ocp.args.JsonSave({"requests": requests})))
        mngr.wait_until_finished()
    logger.info("Saved a snapshot of %d unfinished requests to %s (#%d) in %.2f s", len(requests), path, step,
                time.perf_counter() - start)
    return len(requests)


def read_snapshot(engine: LLMEngine, path: str) -> list[dict] | None:
    """The requests of the newest intact snapshot in `path` that this engine may restore; None when the folder
    holds none. A damaged snapshot is skipped with a warning; one from another model, dtype or version raises
    SnapshotError."""
    import orbax.checkpoint as ocp

    if not os.path.isdir(path):
        return None
    ours = engine_fingerprint(engine)
    with _manager(path) as mngr:
        for step in sorted(mngr.all_steps(), reverse=True):
            where = os.path.join(path, str(step))
            try:
                got = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(),
                                                                 requests=ocp.args.JsonRestore()))
                meta, requests = dict(got["meta"]), got["requests"]["requests"]
                intact = meta.get("checksum") == _checksum(requests)
            except Exception as e:  # (a truncated or missing file)
                logger.warning("snapshot %s is damaged (%s: %s); ignoring it", where, type(e).__name__, e)
                continue
            if not intact:
                logger.warning("snapshot %s is damaged (its requests do not match their checksum); ignoring it",
                               where)
                continue
            check_fingerprint(meta, ours, where)
            return requests
    return None


def load_snapshot(engine: LLMEngine, path: str, *, missing_ok: bool = False, **restore) -> list[str]:
    """Queue the requests of the newest intact snapshot in `path`; returns their ids. With none there,
    FileNotFoundError, or [] when missing_ok. `restore`: restore_requests' kind, queue and on_invalid."""
    requests = read_snapshot(engine, path)
    if requests is None:
        if missing_ok:
            return []
        raise FileNotFoundError(f"load_state: {path!r} holds no intact snapshot")
    ids = restore_requests(engine, requests, **restore)
    logger.info("Restored %d unfinished requests from %s", len(ids), path)
    return ids
