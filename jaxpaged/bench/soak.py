"""Soak: mixed traffic against a server for a long time, its memory, open descriptors, KV usage and latency
sampled every interval; it fails when any of them grows after the warm-up beyond noise, or a request fails.

    jaxpaged bench soak --model DIR --duration 3600 --json soak.json --plot soak.svg   # starts `jaxpaged serve`
    jaxpaged bench soak --base-url http://127.0.0.1:8000 --pid PID --duration 600      # a running server

The mix (seeded): plain and streamed completions, n > 1, stop strings, structured output (a choice and a JSON
schema), streams the client abandons after the first chunk (aborts) and requests it gives up on before any
answer (disconnects). Results: docs/benchmarks/reliability.md."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import subprocess
import sys
import time

import aiohttp
import numpy as np

from jaxpaged.bench.report import write_json

KINDS = ("plain", "stream", "n2", "stop", "choice", "json", "abort", "disconnect")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# After the warm-up, over the rest of the run: growth past these is a leak, not noise.
RSS_GROWTH = (0.05, 48.0)  # a fraction of the mean, or MB, whichever is larger
FD_GROWTH = 8
LATENCY_GROWTH = 1.5  # the last third's median p50 over the first third's


def body_of(kind: str, rng: random.Random, max_tokens: int) -> dict:
    words = " ".join(f"w{rng.randrange(100)}" for _ in range(rng.randrange(2, 30)))
    body = {"prompt": words, "max_tokens": rng.randrange(1, max_tokens + 1), "temperature": rng.choice([0, 0.8])}
    if kind in ("stream", "abort"):
        body["stream"] = True
    elif kind == "n2":
        body["n"] = 2
    elif kind == "stop":
        body["stop"] = [f"w{rng.randrange(100)}", "\n"]
    elif kind == "choice":
        body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]}
    elif kind == "json":
        body.update(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
                    max_tokens=max_tokens)
    return body


async def one_request(session: aiohttp.ClientSession, url: str, kind: str,
                      body: dict) -> tuple[bool, float, str, float | None]:
    """(kept the contract, seconds, what went wrong, seconds to the first event of a stream)."""
    start = time.perf_counter()
    try:
        if kind == "disconnect":  # (gives up before the answer: the server aborts it)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.02):
                    async with session.post(url, json=body) as r:
                        await r.read()
            return True, time.perf_counter() - start, "", None
        async with session.post(url, json=body) as r:
            if r.status != 200:
                return False, time.perf_counter() - start, f"HTTP {r.status}: {(await r.text())[:200]}", None
            if kind == "abort":
                await r.content.readline()  # the first event, then hang up
                return True, time.perf_counter() - start, "", None
            if body.get("stream"):
                first = await r.content.readline()
                ttft = time.perf_counter() - start
                raw = first + await r.read()
            else:
                raw = await r.read()
        if body.get("stream") and not raw.rstrip().endswith(b"data: [DONE]"):
            return False, time.perf_counter() - start, "a stream without [DONE]", None
        return True, time.perf_counter() - start, "", ttft if body.get("stream") else None
    except (aiohttp.ClientError, TimeoutError) as e:
        return False, time.perf_counter() - start, f"{type(e).__name__}: {e}", None


def process_sample(pid: int | None) -> dict:
    """The server process's resident memory (MB) and open descriptors, from /proc (None where unreadable)."""
    out = {"rss_mb": None, "fds": None}
    if pid is None:
        return out
    with contextlib.suppress(OSError, ValueError):
        with open(f"/proc/{pid}/status") as f:
            rss = next(line for line in f if line.startswith("VmRSS:"))
        out["rss_mb"] = int(rss.split()[1]) / 1024
        out["fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return out


_GAUGES = {"jaxpaged:kv_cache_usage_perc": "kv_usage", "jaxpaged:device_memory_used_bytes": "device_mb"}


async def server_gauges(session: aiohttp.ClientSession, base_url: str) -> dict:
    """KV usage (0-1) and device memory (MB) from the server's /metrics (None where unreadable)."""
    out = dict.fromkeys(_GAUGES.values())
    with contextlib.suppress(aiohttp.ClientError, ValueError):
        async with session.get(base_url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                name, _, value = line.partition(" ")
                if name in _GAUGES:
                    out[_GAUGES[name]] = float(value)
    if out["device_mb"] is not None:
        out["device_mb"] /= 2**20
    return out


async def kv_usage(session: aiohttp.ClientSession, base_url: str) -> float | None:
    return (await server_gauges(session, base_url))["kv_usage"]


async def drive(base_url: str, pid: int | None, duration: float, sample_every: float, concurrency: int,
                max_tokens: int, seed: int = 0, api_key: str | None = None, quiet: bool = False,
                kinds: tuple[str, ...] = KINDS, warmup: float = 0.0) -> dict:
    """Run the mix of `kinds` for `duration` s with `concurrency` clients; a sample every `sample_every` s; the
    latency percentiles of the requests that end after `warmup` s."""
    rng = random.Random(seed)
    url, start = base_url + "/v1/completions", time.perf_counter()
    deadline = start + duration
    window: list[float] = []
    latencies: dict[str, list[float]] = {"latency_s": [], "ttft_s": []}  # (after the warm-up)
    counts = {"requests": 0, "errors": 0}
    errors: list[str] = []
    samples = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def client(session):
        while time.perf_counter() < deadline:
            kind = rng.choice(kinds)
            ok, seconds, why, ttft = await one_request(session, url, kind, body_of(kind, rng, max_tokens))
            counts["requests"] += 1
            if not ok:
                counts["errors"] += 1
                errors.append(f"{kind}: {why}")
            elif kind not in ("abort", "disconnect"):
                window.append(seconds)
                if time.perf_counter() - start >= warmup:
                    latencies["latency_s"].append(seconds)
                    if ttft is not None:
                        latencies["ttft_s"].append(ttft)

    async def sample(session):
        lat = np.array(window) if window else np.array([np.nan])
        window.clear()
        row = {"t_s": round(time.perf_counter() - start, 1), **process_sample(pid),
               **await server_gauges(session, base_url), "requests": counts["requests"],
               "errors": counts["errors"], "p50_s": float(np.nanmedian(lat)), "p99_s": float(np.nanquantile(lat, 0.99))}
        samples.append(row)
        if not quiet:
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    async def sampler(session):
        while time.perf_counter() < deadline:
            await asyncio.sleep(min(sample_every, max(0.0, deadline - time.perf_counter())))
            await sample(session)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(sampler(session), *(client(session) for _ in range(concurrency)))
        for _ in range(100):  # traffic over: the blocks of the last (and the aborted) requests come back
            if (await kv_usage(session, base_url)) in (0.0, None):
                break
            await asyncio.sleep(0.1)
        await sample(session)
    percentiles = {key: {f"p{q}": float(np.quantile(v, q / 100)) for q in (50, 90, 99)} if v else None
                   for key, v in latencies.items()}
    return {"samples": samples, "errors": errors[:20], **counts, **percentiles}


def _slope_growth(ts: np.ndarray, ys: np.ndarray) -> float:
    """The growth a least-squares line predicts over the span of ts."""
    if len(ts) < 3 or np.ptp(ts) == 0:
        return 0.0
    return float(np.polyfit(ts, ys, 1)[0] * np.ptp(ts))


def verdict(samples: list[dict], warmup_s: float, errors: int) -> dict[str, str | None]:
    """None per check when it holds, else why it does not. The last sample is after the traffic."""
    during, last = samples[:-1], samples[-1]
    after = [s for s in during if s["t_s"] >= warmup_s]
    out: dict[str, str | None] = {"errors": f"{errors} requests failed" if errors else None}
    out["kv_after"] = (f"KV usage {last['kv_usage']} after the traffic"
                       if last["kv_usage"] not in (None, 0.0) else None)
    for key, limit in (("rss_mb", None), ("device_mb", None), ("fds", FD_GROWTH)):
        pts = [(s["t_s"], s[key]) for s in after if s.get(key) is not None]
        if not pts:
            out[key] = None
            continue
        ts, ys = np.array(pts, float).T
        allowed = limit if limit is not None else max(RSS_GROWTH[0] * ys.mean(), RSS_GROWTH[1])
        grew = _slope_growth(ts, ys)
        out[key] = f"{key} grew {grew:.1f} after the warm-up (allowed {allowed:.1f})" if grew > allowed else None
    p50 = [s["p50_s"] for s in after if not np.isnan(s["p50_s"])]
    third = len(p50) // 3
    if third:
        first, final = np.median(p50[:third]), np.median(p50[-third:])
        out["latency"] = (f"p50 latency {first:.3f} -> {final:.3f} s" if final > LATENCY_GROWTH * first
                          else None)
    return out


def svg_plot(samples: list[dict], path: str, warmup_s: float) -> None:
    """RSS and device memory (MB) and KV usage (%) against time, as a small SVG (no plotting library needed)."""
    w, h, pad = 640, 240, 40
    pts = [s for s in samples[:-1] if s["rss_mb"] is not None]
    if len(pts) < 2:
        return
    t_max = max(s["t_s"] for s in pts) or 1
    r_lo, r_hi = min(s["rss_mb"] for s in pts), max(s["rss_mb"] for s in pts)
    r_hi = r_hi if r_hi > r_lo else r_lo + 1

    def line(values, lo, hi, color):
        xy = " ".join(f"{pad + (w - 2 * pad) * t / t_max:.1f},{h - pad - (h - 2 * pad) * (v - lo) / (hi - lo):.1f}"
                      for t, v in values)
        return f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{xy}"/>'

    dev = [(s["t_s"], s["device_mb"]) for s in pts if s.get("device_mb") is not None]
    device_line = []
    if dev:
        d_lo, d_hi = min(v for _, v in dev), max(v for _, v in dev)
        device_line = [line(dev, d_lo, d_hi if d_hi > d_lo else d_lo + 1, "#2ca02c"),
                       f'<text x="{pad + 330}" y="15" fill="#2ca02c">device {d_lo:.0f}-{d_hi:.0f} MB</text>']
    wx = pad + (w - 2 * pad) * min(warmup_s, t_max) / t_max
    parts = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
              f'font-size="11"><rect width="{w}" height="{h}" fill="white"/>'),
             f'<line x1="{wx:.1f}" y1="{pad}" x2="{wx:.1f}" y2="{h - pad}" stroke="#bbb" stroke-dasharray="4"/>',
             line([(s["t_s"], s["rss_mb"]) for s in pts], r_lo, r_hi, "#1f77b4"),
             line([(s["t_s"], 100 * (s["kv_usage"] or 0)) for s in pts], 0, 100, "#d62728"),
             *device_line,
             f'<text x="{pad}" y="15" fill="#1f77b4">RSS {r_lo:.0f}-{r_hi:.0f} MB</text>',
             f'<text x="{pad + 180}" y="15" fill="#d62728">KV usage 0-100%</text>',
             f'<text x="{w - pad}" y="{h - 10}" text-anchor="end">{t_max:.0f} s (dashed: end of warm-up)</text>',
             "</svg>"]
    with open(path, "w") as f:
        f.write("\n".join(parts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="a running server; else one is started with --model")
    p.add_argument("--pid", type=int, default=None, help="the running server's process id (RSS, descriptors)")
    p.add_argument("--model", default=None, help="start `jaxpaged serve --model MODEL` for the soak")
    p.add_argument("--serve-args", default="", help="more flags for the server it starts")
    p.add_argument("--duration", type=float, default=3600.0, help="seconds of traffic (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=600.0, help="seconds before growth counts (default: %(default)s)")
    p.add_argument("--sample-every", type=float, default=60.0, help="(default: %(default)s s)")
    p.add_argument("--concurrency", type=int, default=16, help="clients at once (default: %(default)s)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="the request kinds mixed, comma-separated (default: all of them; `stream` alone with "
                   "--concurrency 256 is the saturation load)")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens a request asks for (default: %(default)s)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--json", default=None, help="write the samples and the verdict here")
    p.add_argument("--plot", default=None, help="write RSS and KV usage against time as an SVG here")


def main(ns: argparse.Namespace) -> dict:
    if (ns.base_url is None) == (ns.model is None):
        raise ValueError("give --base-url (a running server) or --model (one is started)")
    kinds = tuple(k for k in ns.kinds.split(",") if k)
    if not kinds or set(kinds) - set(KINDS):
        raise ValueError(f"--kinds: each of {', '.join(KINDS)}, got {ns.kinds!r}")
    if ns.warmup >= ns.duration:
        raise ValueError(f"--warmup ({ns.warmup:g} s) must be shorter than --duration ({ns.duration:g} s)")
    server = None
    base_url, pid = ns.base_url, ns.pid
    if ns.model is not None:
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "jaxpaged", "serve", "--model", ns.model, "--port",
                                   str(port), *ns.serve_args.split()])
        base_url, pid = f"http://127.0.0.1:{port}", server.pid
        _wait_healthy(base_url, server)
    try:
        run = asyncio.run(drive(base_url.rstrip("/"), pid, ns.duration, ns.sample_every, ns.concurrency,
                                ns.max_tokens, api_key=ns.api_key, kinds=kinds, warmup=ns.warmup))
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    checks = verdict(run["samples"], ns.warmup, run["errors"])
    result = {"duration_s": ns.duration, "warmup_s": ns.warmup, "concurrency": ns.concurrency, "kinds": kinds, **run,
              "checks": checks, "passed": not any(checks.values())}
    for key in ("latency_s", "ttft_s"):
        if run[key]:
            print(f"{key} after the warm-up: " + ", ".join(f"{q} {v:.3f}" for q, v in run[key].items()))
    print(f"{run['requests']} requests, {run['errors']} failed; " +
          ("; ".join(v for v in checks.values() if v) or "no growth after the warm-up: passed"))
    write_json(result, ns.json)
    if ns.plot:
        svg_plot(run["samples"], ns.plot, ns.warmup)
    if not result["passed"]:
        sys.exit(1)
    return result


def _wait_healthy(base_url: str, server: subprocess.Popen, timeout_s: float = 900.0) -> None:
    async def go():
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited with status {server.returncode} before it served")
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(base_url + "/health") as r:
                        if r.status == 200:
                            return
                await asyncio.sleep(1)
            raise RuntimeError(f"the server was not healthy within {timeout_s:.0f} s")
    asyncio.run(go())
