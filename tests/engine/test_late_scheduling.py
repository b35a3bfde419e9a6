"""Late scheduling, served: a request arriving while a step runs joins the next step (as synchronously), not the
one after it, and the device keeps its steps back to back."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxpaged import SamplingParams
from jaxpaged.bench.dummy_model import write_dummy_model
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.engine.llm_engine import LLMEngine

STEP_S = 0.4  # each step's simulated device time


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory):
    return write_dummy_model(str(tmp_path_factory.mktemp("dummy")), "tiny")


def slow_device(runner) -> list[float]:
    """Make the stub runner's steps take STEP_S each on a simulated device that runs them one after another;
    returns the device's idle gaps between steps, as they come."""
    dispatch, fetch = runner.dispatch, runner.fetch
    ends: dict[int, float] = {}
    last_end: list[float] = []
    idle: list[float] = []

    def timed_dispatch(prep):
        handle, now = dispatch(prep), time.perf_counter()
        if last_end:
            idle.append(max(0.0, now - last_end[0]))
        ends[id(handle)] = end = max([now, *last_end]) + STEP_S
        last_end[:] = [end]
        return handle

    def timed_fetch(handle):
        time.sleep(max(0.0, ends[id(handle)] - time.perf_counter()))
        return fetch(handle)

    runner.dispatch, runner.fetch = timed_dispatch, timed_fetch
    runner.is_done = lambda handle: time.perf_counter() >= ends[id(handle)]
    return idle


@pytest.mark.parametrize("late", [True, False])
def test_a_request_arriving_during_a_step_joins_the_next(dummy_dir, late):
    engine = LLMEngine.from_engine_args(EngineArgs(model=dummy_dir, max_num_seqs=8, max_num_batched_tokens=32,
                                                   max_model_len=128, late_scheduling=late), stub=True)
    core = engine.core
    assert core.async_scheduling and (core.clock is not None) == late
    if late:
        core.clock.seed({t: STEP_S for t in engine.runner.buckets})
    idle = slow_device(core.runner)
    scheduled: list[set[str]] = []  # the requests of each step
    first_dispatched = threading.Event()
    schedule, dispatch = core.scheduler.schedule, core.runner.dispatch

    def recording_schedule():
        out = schedule()
        scheduled.append({r.request_id for r in out.requests})
        return out

    def signalling_dispatch(prep):
        handle = dispatch(prep)
        first_dispatched.set()
        return handle

    core.scheduler.schedule, core.runner.dispatch = recording_schedule, signalling_dispatch
    llm = AsyncLLM(engine, owns_engine=True)
    params = SamplingParams(max_tokens=3, ignore_eos=True)

    async def collect(request_id: str) -> list[int]:
        async for out in llm.generate([5, 6, 7, 8], params, request_id):
            tokens = out.outputs[0].token_ids
        return tokens

    async def run():
        a = asyncio.create_task(collect("a"))
        await asyncio.get_running_loop().run_in_executor(None, first_dispatched.wait)
        await asyncio.sleep(STEP_S / 4)  # a quarter into the first step
        return await asyncio.gather(a, collect("b"))

    try:
        assert asyncio.run(run()) == [[7] * 3] * 2
    finally:
        llm.shutdown()
    joined = next(i for i, ids in enumerate(scheduled) if "b" in ids)
    assert joined == (1 if late else 2), scheduled
    assert sum(idle) < STEP_S / 4, idle  # (late: each step was dispatched shortly before the one before ended)
