"""Compiles after warmup are bugs (`CompileGuard`), and compiled code outlives the process (the persistent
cache)."""

from __future__ import annotations

import contextlib
import os
import threading

import jax

_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")


class CompileGuard:
    """Counts JAX traces and compiles; `watch()` raises if any happened inside it, on its thread (the step cache's
    background loads, on their own threads, do not count)."""

    _installed: list[CompileGuard] = []

    def __init__(self):
        self.count = 0
        self._thread: int | None = None  # the watching thread
        if not CompileGuard._installed:
            jax.monitoring.register_event_duration_secs_listener(CompileGuard._on_event)
        CompileGuard._installed.append(self)

    @staticmethod
    def _on_event(event: str, duration: float, **kwargs) -> None:
        if event in _COMPILE_EVENTS:
            for g in CompileGuard._installed:
                if g._thread == threading.get_ident():
                    g.count += 1

    @contextlib.contextmanager
    def watch(self):
        before, self._thread = self.count, threading.get_ident()
        try:
            yield
        finally:
            self._thread = None
        if self.count != before:
            raise RuntimeError(
                f"the step compiled {self.count - before} time(s) after warmup: a shape or dtype escaped the buckets"
            )


def enable_persistent_compilation_cache() -> None:
    """Keep compiled steps on disk so a second start skips XLA compilation."""
    cache_dir = os.environ.get("JAXPAGED_COMPILATION_CACHE", os.path.expanduser("~/.cache/jaxpaged/xla"))
    if cache_dir in ("", "0", "off"):
        return
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
