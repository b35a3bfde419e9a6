"""`StepLoader` (the step cache's background loads) and the compile guard's view of other threads."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.runner.compilation import CompileGuard
from jaxpaged.runner.step_loader import StepLoader


def test_loads_in_order_and_get_does_not_wait_behind_others():
    gate, ran = threading.Event(), []

    def job(t):
        def run():
            if t == 1:
                gate.wait(5)  # the one worker is held on bucket 1
            ran.append((t, threading.current_thread().name))
            return t * 10
        return run

    loader = StepLoader({t: job(t) for t in (1, 2, 3)}, workers=1)
    assert loader.get(3) == 30  # not started: loaded on this thread at once
    assert ran == [(3, threading.current_thread().name)]
    gate.set()
    assert loader.get(1) == 10 and loader.get(2) == 20
    assert [t for t, _ in ran] == [3, 1, 2]
    assert 4 not in loader and 2 in loader


def test_a_failed_load_raises_where_it_is_asked_for():
    def fail():
        raise ValueError("damaged")

    loader = StepLoader({1: fail, 2: lambda: 2}, workers=2)
    with pytest.raises(ValueError, match="damaged"):
        loader.get(1)
    assert loader.get(2) == 2


def test_close_drops_what_has_not_started():
    started, gate, ran = threading.Event(), threading.Event(), []

    def job(t):
        def run():
            if t == 1:
                started.set()
                gate.wait(5)
            ran.append(t)
            return t
        return run

    loader = StepLoader({t: job(t) for t in (1, 2, 3)}, workers=1)
    assert started.wait(5)
    threading.Timer(0.2, gate.set).start()
    loader.close()  # waits for bucket 1 (running), drops 2 and 3
    assert ran == [1]
    assert loader.get(3) == 3 and ran == [1, 3]  # (a dropped bucket still loads when asked for)


def test_an_interrupted_load_starts_again_when_asked_for():
    calls = []

    def job():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return "step"

    loader = StepLoader({1: job}, workers=0)
    with pytest.raises(KeyboardInterrupt):
        loader.get(1)
    assert loader.get(1) == "step" and len(calls) == 2


def test_compile_guard_counts_only_its_own_thread():
    guard = CompileGuard()

    def compile_elsewhere():
        jax.jit(lambda x: x * 3 + 1).lower(np.ones(7, np.float32)).compile()

    with guard.watch():  # another thread compiling meanwhile does not count
        thread = threading.Thread(target=compile_elsewhere)
        thread.start()
        thread.join()
    with pytest.raises(RuntimeError, match="compiled"), guard.watch():
        jax.jit(lambda x: x * 5 - 2)(jnp.ones(9))
