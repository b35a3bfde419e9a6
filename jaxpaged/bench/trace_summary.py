"""Where a JAX profiler trace's time went: total time per op or function on each device and on the host.

    python -m jaxpaged.bench.trace_summary DIR [--top 25] [--output-json FILE]

DIR is what `jax.profiler.trace(DIR)` wrote (`jaxpaged bench throughput --profile-dir DIR`); the newest
`*.trace.json.gz` under it is read. A trace of a few seconds of serving is tens of megabytes: this prints (and
writes as JSON) the few lines a decision needs, small enough to come back from a machine that keeps nothing.
Device lanes (`/device:...`) give kernels and XLA ops by total time and count; the host lane gives Python
functions (`$file:line name`, inclusive time) and the runtime's own events.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def newest_trace(profile_dir: str) -> str:
    paths = glob.glob(os.path.join(profile_dir, "**", "*.trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no *.trace.json.gz under {profile_dir}")
    return max(paths, key=os.path.getmtime)


def summarize(path: str, top: int = 25) -> dict:
    """{"trace": path, "lanes": {process name: {"busy_us", "span_us", "events", "top": [[name, total_us,
    count], ...]}}}: busy is the sum of the lane's top-level events (nested ones not counted twice)."""
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    totals: dict = collections.defaultdict(collections.Counter)
    counts: dict = collections.defaultdict(collections.Counter)
    spans: dict = {}
    by_thread: dict = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        lane = procs.get(e["pid"], str(e["pid"]))
        start, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        totals[lane][e["name"]] += dur
        counts[lane][e["name"]] += 1
        lo, hi = spans.get(lane, (start, start + dur))
        spans[lane] = (min(lo, start), max(hi, start + dur))
        by_thread[(lane, e["pid"], e.get("tid"))].append((start, start + dur))
    busy: collections.Counter = collections.Counter()
    for (lane, _, _), intervals in by_thread.items():  # top-level time per thread: merge nested intervals
        end = float("-inf")
        for s, f in sorted(intervals):
            if s >= end:
                busy[lane] += f - s
                end = f
            elif f > end:
                busy[lane] += f - end
                end = f
    lanes = {}
    for lane in sorted(totals):
        lanes[lane] = {"busy_us": round(busy[lane], 1), "span_us": round(spans[lane][1] - spans[lane][0], 1),
                       "events": sum(counts[lane].values()),
                       "top": [[name, round(t, 1), counts[lane][name]] for name, t in totals[lane].most_common(top)]}
    return {"trace": path, "lanes": lanes}


def print_summary(summary: dict) -> None:
    print(f"trace: {summary['trace']}")
    for lane, s in summary["lanes"].items():
        print(f"\n{lane}: {s['events']:,} events, busy {s['busy_us'] / 1e3:,.1f} ms of {s['span_us'] / 1e3:,.1f} ms "
              f"(summed over its threads or streams)")
        for name, total, count in s["top"]:
            print(f"  {total / 1e3:>10.2f} ms {count:>8,}x  {name[:110]}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile_dir")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--output-json", default=None)
    ns = p.parse_args(argv)
    summary = summarize(newest_trace(ns.profile_dir), ns.top)
    print_summary(summary)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
