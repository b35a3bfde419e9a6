"""Serving benchmark: streaming load against any OpenAI-compatible /v1/completions endpoint.

    jaxpaged serve &                      # in another shell
    jaxpaged bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4

Workloads: the seeded random-token one of `bench throughput` (sent as token ids), or --dataset FILE
(one prompt per line, or JSONL with a "prompt" field). Arrivals are Poisson at --request-rate
(inf: all at once; a comma list sweeps the rates and prints one table), optionally capped by
--max-concurrency. Prints the table `vllm bench serve` prints (percentiles from --metric-percentiles)
and goodput under --goodput SLOs, and writes JSON. Works against any OpenAI-compatible server, so the
same client measures jaxpaged and its peers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

from jaxpaged.bench.workload import parse_range, random_token_workload


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    sent: float = 0.0  # perf_counter when the request was sent

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def send_one(session, url: str, model: str, prompt, max_tokens: int, api_key: str | None,
                   ignore_eos: bool) -> RequestResult:
    """Stream one completion; time the first token and every later chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else 0)
    start = last = res.sent = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                payload = json.loads(line[6:])
                now = time.perf_counter()
                if payload.get("usage"):
                    res.output_tokens = payload["usage"]["completion_tokens"]
                    res.prompt_len = payload["usage"]["prompt_tokens"]
                if payload.get("choices") and payload["choices"][0].get("text"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
        res.latency = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        res.error = repr(e)
    return res


FIRST_ID = 20  # random prompts use token ids from here up (below: specials in most vocabularies)


def load_prompts(ns, variant: int = 0) -> list[tuple[object, int]]:
    """(prompt, max_tokens) pairs: a file of real prompts, or the random-token workload. `variant` > 0 shifts the
    random prompts' token ids (same lengths, other tokens), so each rate of a sweep misses the prefix cache."""
    out_lo, out_hi = parse_range(ns.output_len)
    rng = np.random.default_rng(ns.seed)
    if ns.dataset:
        with open(ns.dataset) as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        prompts = [json.loads(ln)["prompt"] if ln.startswith("{") else ln for ln in lines][: ns.num_prompts]
        return [(p, int(rng.integers(out_lo, out_hi + 1))) for p in prompts]
    vocab = ns.vocab_size
    reqs = random_token_workload(ns.num_prompts, parse_range(ns.input_len), (out_lo, out_hi), vocab, ns.seed,
                                 set(range(0, FIRST_ID)))
    if getattr(ns, "long_prompts", None):  # K requests, evenly spread through the run, get a long prompt instead
        k, length = parse_long_prompts(ns.long_prompts)
        long_reqs = random_token_workload(k, (length, length), (out_lo, out_hi), vocab, ns.seed + 2,
                                          set(range(0, FIRST_ID)))
        for j, r in enumerate(long_reqs[: len(reqs)]):
            reqs[int((j + 0.5) * len(reqs) / min(k, len(reqs)))] = r
    shift = variant * 7919
    return [([FIRST_ID + (t - FIRST_ID + shift) % (vocab - FIRST_ID) for t in r.prompt_token_ids], r.output_len)
            for r in reqs]


def parse_long_prompts(text: str) -> tuple[int, int]:
    """`K:LEN` -> (K, LEN): K of the requests get prompts of LEN tokens."""
    k, _, length = str(text).partition(":")
    try:
        out = int(k), int(length)
    except ValueError:
        out = (0, 0)
    if out[0] <= 0 or out[1] <= 0:
        raise SystemExit(f"--long-prompts: {text!r} is not K:LEN with positive K and LEN")
    return out


async def run(ns, request_rate: float, variant: int = 0) -> dict:
    import aiohttp

    work = load_prompts(ns, variant)
    url = ns.base_url.rstrip("/") + "/v1/completions"
    rng = np.random.default_rng(ns.seed + 1)
    sem = asyncio.Semaphore(ns.max_concurrency or len(work) or 1)
    timeout = aiohttp.ClientTimeout(total=ns.timeout)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def limited(p, n):
            async with sem:
                return await send_one(session, url, ns.model, p, n, ns.api_key, not ns.no_ignore_eos)

        tasks = []
        start = time.perf_counter()
        for p, n in work:
            tasks.append(asyncio.create_task(limited(p, n)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, ns, request_rate)


def parse_percentiles(text: str) -> list[float]:
    return [float(p) for p in text.split(",")]


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`ttft:500 itl:100` -> {"ttft": 0.5, "itl": 0.1} (seconds). Keys: ttft, tpot, itl (every inter-token gap
    of the request), e2el."""
    slos = {}
    for item in items or []:
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot", "itl", "e2el") or not ms:
            raise SystemExit(f"--goodput: {item!r} is not KEY:MS with KEY in ttft, tpot, itl, e2el")
        slos[key] = float(ms) / 1000
    return slos


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a request met every SLO."""
    checks = {"ttft": lambda: r.ttft, "tpot": lambda: r.tpot or 0.0, "itl": lambda: max(r.itl, default=0.0),
              "e2el": lambda: r.latency}
    return all(checks[k]() <= v for k, v in slos.items())


def _stats(name: str, xs: list[float], percentiles: list[float]) -> dict:
    a = np.asarray(xs or [0.0]) * 1000
    out = {f"mean_{name}_ms": float(a.mean()), f"median_{name}_ms": float(np.median(a))}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(a, p))
    return out


def summarize(results: list[RequestResult], duration: float, ns, request_rate: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [r.tpot for r in ok if r.tpot is not None]
    pct = parse_percentiles(ns.metric_percentiles)
    slos = parse_goodput(ns.goodput)
    summary = {
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in ok), "total_generated_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
        **_stats("ttft", [r.ttft for r in ok], pct), **_stats("tpot", tpot, pct),
        **_stats("itl", [x for r in ok for x in r.itl], pct), **_stats("e2el", [r.latency for r in ok], pct),
        "goodput_slos_ms": {k: v * 1000 for k, v in slos.items()},
        "request_goodput": (sum(meets(r, slos) for r in ok) / duration) if slos else None,
        "percent_meeting_slos": (100 * sum(meets(r, slos) for r in ok) / max(len(results), 1)) if slos else None,
        "request_rate": request_rate, "max_concurrency": ns.max_concurrency, "num_prompts": ns.num_prompts,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    if getattr(ns, "save_detailed", False):  # per request, in the workload's order (vLLM's --save-detailed)
        first = min((r.sent for r in results), default=0.0)
        summary.update(start_times=[r.sent - first for r in results], input_lens=[r.prompt_len for r in results],
                       output_lens=[r.output_tokens for r in results],
                       ttfts=[r.ttft if r.ok else None for r in results], itls=[r.itl for r in results],
                       request_errors=[r.error for r in results])
    return summary


def print_table(s: dict) -> None:
    rows = [("Successful requests", s["successful_requests"], "{}"), ("Failed requests", s["failed_requests"], "{}"),
            ("Benchmark duration (s)", s["duration_s"], "{:.2f}"),
            ("Total input tokens", s["total_input_tokens"], "{}"),
            ("Total generated tokens", s["total_generated_tokens"], "{}"),
            ("Request throughput (req/s)", s["request_throughput"], "{:.2f}"),
            ("Output token throughput (tok/s)", s["output_token_throughput"], "{:.2f}"),
            ("Total token throughput (tok/s)", s["total_token_throughput"], "{:.2f}")]
    if s["request_goodput"] is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in s["goodput_slos_ms"].items())
        rows += [(f"Request goodput (req/s) [{slos}]", s["request_goodput"], "{:.2f}"),
                 ("Requests meeting the SLOs (%)", s["percent_meeting_slos"], "{:.1f}")]
    pcts = [k.split("_")[0] for k in s if k.startswith("p") and k.endswith("_ttft_ms")]
    stats = ["mean"] + ([] if "p50" in pcts else ["median"]) + pcts
    for title, key in (("Time to First Token", "ttft"), ("Time per Output Token (excl. 1st token)", "tpot"),
                       ("Inter-token Latency", "itl"), ("End-to-end Latency", "e2el")):
        rows.append((f"---{title}---", None, ""))
        for stat in stats:
            rows.append((f"{stat.capitalize()} {key.upper()} (ms)", s[f"{stat}_{key}_ms"], "{:.2f}"))
    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    for title, value, fmt in rows:
        if value is None:
            print("{s:{c}^50}".format(s=title, c="-"))
        else:
            print(f"{title:<40}{fmt.format(value):>10}")
    print("=" * 50)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", default=None, help="file of prompts (text lines or JSONL with 'prompt')")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", default="16:512")
    p.add_argument("--output-len", default="16:256")
    p.add_argument("--vocab-size", type=int, default=49152, help="token id range of the random workload")
    p.add_argument("--request-rate", default="inf",
                   help="requests per second, Poisson arrivals (inf: all at once); a comma list sweeps the rates, "
                        "e.g. 0.5,1,1.5,2,3,inf")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--no-ignore-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--metric-percentiles", default="50,90,99", help="percentiles reported for each latency")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs a request must meet to count toward goodput: ttft, tpot, itl (every gap), e2el in ms")
    p.add_argument("--long-prompts", default=None, metavar="K:LEN",
                   help="K of the random requests, spread through the run, get prompts of LEN tokens (long prefills "
                        "arriving while others decode)")
    p.add_argument("--disagg", action="store_true",
                   help="start the servers here and compare one engine on every core with a prefill/decode split "
                        "(half the cores each, behind serve-disagg); see jaxpaged/bench/disagg.py")
    p.add_argument("--serve-model", default=None, help="with --disagg: the model the servers load (default: the "
                                                       "default model)")
    p.add_argument("--serve-args", default="", help="with --disagg: more `jaxpaged serve` flags for every instance")
    p.add_argument("--save-detailed", action="store_true",
                   help="also write each request's send time, prompt and output length, TTFT, inter-token "
                        "latencies and error to the JSON")
    p.add_argument("--label", default=None, help="the server's name in the JSON and the sweep table")
    p.add_argument("--output-json", default="bench_results/serve.json")


def main(ns: argparse.Namespace) -> dict:
    if getattr(ns, "disagg", False):  # (jaxpaged bench serve --disagg routes to jaxpaged.bench.disagg)
        raise SystemExit("--disagg: run `jaxpaged bench serve --disagg` (jaxpaged.bench.disagg.main)")
    if ns.model is None:
        import urllib.request

        req = urllib.request.Request(ns.base_url.rstrip("/") + "/v1/models",
                                     headers={"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {})
        with urllib.request.urlopen(req) as r:
            ns.model = json.load(r)["data"][0]["id"]
    rates = [float(r) for r in str(ns.request_rate).split(",")]
    parse_goodput(ns.goodput)  # (bad SLOs fail before any request is sent)
    runs = []
    for i, rate in enumerate(rates):
        summary = asyncio.run(run(ns, rate, variant=i))
        summary["label"] = ns.label
        print_table(summary)
        runs.append(summary)
    if len(runs) > 1:
        print_sweep(runs)
    if ns.output_json:
        os.makedirs(os.path.dirname(ns.output_json) or ".", exist_ok=True)
        with open(ns.output_json, "w") as f:
            args = {k: v for k, v in vars(ns).items() if k != "func"}
            json.dump({**runs[0], "args": args} if len(runs) == 1 else {"runs": runs, "args": args}, f, indent=2,
                      default=str)
        print(f"wrote {ns.output_json}")
    return runs[0] if len(runs) == 1 else {"runs": runs}


def print_sweep(runs: list[dict]) -> None:
    """One line per request rate: where the server saturates."""
    pcts = [k.split("_")[0] for k in runs[0] if k.startswith("p") and k.endswith("_ttft_ms")]
    lo, hi = ("median", pcts[-1]) if pcts else ("median", "mean")
    head = (f"{'rate':>6} {'done':>5} {'wall s':>7} {'out tok/s':>9} {'TTFT ' + lo + '/' + hi + ' ms':>22} "
            f"{'ITL ' + lo + '/' + hi + ' ms':>22} {'goodput':>8}")
    print(head)
    for s in runs:
        good = "-" if s["request_goodput"] is None else f"{s['request_goodput']:.2f}"
        print(f"{s['request_rate']:>6g} {s['successful_requests']:>5} {s['duration_s']:>7.1f} "
              f"{s['output_token_throughput']:>9.1f} {s[lo + '_ttft_ms']:>10.0f} /{s[hi + '_ttft_ms']:>10.0f} "
              f"{s[lo + '_itl_ms']:>10.0f} /{s[hi + '_itl_ms']:>10.0f} {good:>8}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    main(parser.parse_args())
