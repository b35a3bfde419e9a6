"""Timing each bucket's step before serving: the warm runs (no request pays a step's first run) and the
times the scheduler's step costs and the draft budget plan with."""

from __future__ import annotations

import dataclasses


def warm_steps(runner, timed_runs: int = 2) -> dict[int, float]:
    """Run each bucket's step on an empty batch, so that no request pays a step's first run: on CPU that run
    costs several times a later one (docs/benchmarks/design-choices.md), and a step
    still loading from the step cache is waited for here. Then, every step loaded, `timed_runs` more of
    each; returns each bucket's fastest of those (seconds; the first run's with timed_runs=0). The empty
    batch draws no token, so its LM head and sampler run on the fewest rows (`sample_rows`)."""
    inputs = {t: runner._template(t) for t in runner.buckets}
    first = {t: runner._run_empty(t, inp) for t, inp in inputs.items()}
    runner.wait_for_steps()  # (a load still running beside a timed run would slow it)
    return {t: min((runner._run_empty(t, inp) for _ in range(timed_runs)), default=first[t])
            for t, inp in inputs.items()}


def time_buckets(runner, up_to: int) -> dict[int, tuple[float, float]]:
    """Seconds a step of each token bucket up to `up_to` takes without and with drafts to verify (an empty
    step, `ModelRunner._run_empty`: the shapes are fixed, so it costs nearly what a full one does)."""
    runner.wait_for_steps()  # (a bucket's first run would otherwise time its load)
    times = {}
    for t in runner.buckets:
        template = runner._template(t)
        with_draft = dataclasses.replace(template, draft_tokens=template.draft_tokens.copy())
        with_draft.draft_tokens[:1] = 0  # one (padding) draft: the step takes its verifying branch
        pair = []
        for inp in (template, with_draft):
            first = runner._run_empty(t, inp)  # (a first run pays for warming up: time a second unless it is long)
            pair.append(runner._run_empty(t, inp) if first < 0.3 else first)
        times[t] = tuple(pair)
        if t >= up_to:
            break
    return times
