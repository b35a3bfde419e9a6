"""Fault injection, off by default: named points in the engine raise `InjectedFault` when armed, so tests (and a
server started with JAXPAGED_FAULTS) can prove what a failure there does to the requests around it.

Points: "step" (EngineCore.step, before the device runs), "output" (AsyncLLM's output thread), "tokenizer"
(tokenizing a prompt), "detokenizer" (one sample's new token turned into text), "grammar" (a structured-output matcher taking a token), "disk_write" (the KV disk tier,
after the temporary file is written and before it is renamed into place: an OSError, as a full disk raises).
JAXPAGED_FAULTS="grammar:3,step:50" fails the 3rd grammar advance and the 50th step, once each."""

from __future__ import annotations

import contextlib
import os
import threading

POINTS = ("step", "output", "tokenizer", "detokenizer", "grammar", "disk_write")


class InjectedFault(RuntimeError):
    """Raised at an armed point (an OSError subclass at "disk_write")."""


class InjectedIOFault(InjectedFault, OSError):
    pass


_lock = threading.Lock()
_countdown: dict[str, int] = {}  # point -> calls left before it fails (1: the next one)


def arm(point: str, nth: int = 1) -> None:
    """Make the `nth` call of `point` from now raise (once)."""
    if point not in POINTS:
        raise ValueError(f"fault point: {point!r} is not one of {POINTS}")
    if nth < 1:
        raise ValueError(f"fault point {point}: nth must be >= 1, got {nth}")
    with _lock:
        _countdown[point] = nth


def disarm(point: str | None = None) -> None:
    with _lock:
        if point is None:
            _countdown.clear()
        else:
            _countdown.pop(point, None)


@contextlib.contextmanager
def armed(point: str, nth: int = 1):
    arm(point, nth)
    try:
        yield
    finally:
        disarm(point)


def check(point: str) -> None:
    """Raise at `point` if it is armed and its turn has come. (One dict lookup when nothing is armed.)"""
    if not _countdown:
        return
    with _lock:
        left = _countdown.get(point)
        if left is None:
            return
        if left > 1:
            _countdown[point] = left - 1
            return
        del _countdown[point]
    raise (InjectedIOFault if point == "disk_write" else InjectedFault)(f"injected fault at {point!r}")


def arm_from_env(spec: str | None = None) -> None:
    """Arm the points JAXPAGED_FAULTS names ("point:nth,..."); a malformed spec is a ValueError naming it."""
    spec = os.environ.get("JAXPAGED_FAULTS", "") if spec is None else spec
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, _, nth = item.partition(":")
        try:
            arm(point, int(nth or 1))
        except ValueError as e:
            raise ValueError(f"JAXPAGED_FAULTS={spec!r}: {e}") from None


arm_from_env()
