"""Traced steps kept on disk, so a warm start does not trace the model.

JAX's persistent compilation cache skips XLA's compile, but it is keyed by the lowered module: every start still
traces the whole model once per token bucket (~0.5 s a bucket for SmolLM2 on 2 cores, most of a warm start).
This cache keeps each bucket's traced step (`jax.export`), keyed by what a trace depends on: the engine config
and model structure, the step's argument shapes, dtypes and devices, the jax and jaxlib versions, the backend
and this CPU, a few numerics flags and environment variables, and the source of jaxpaged and pallas_kernels (so
any code change misses).
An entry is one bucket's serialized module with a checksum, written under a temporary name and then renamed; a
damaged or unusable entry is logged and traced again (and replaced). A warm start deserializes and compiles the
module, which XLA's persistent cache answers. (Compiled executables are not kept here: jaxlib 0.10's CPU
executables, deserialized without the compile options that cache passes, fail when run.) The newest `KEEP` keys
are kept.

`JAXPAGED_STEP_CACHE=DIR` puts it elsewhere, `off` turns it off; by default it lives beside the XLA cache
(`~/.cache/jaxpaged/steps`, or `$JAXPAGED_COMPILATION_CACHE-steps`) and is off when that cache is. Pruning
touches only its own key folders (32 hex digits), so a shared folder is safe; a read-only one is read and
not written. Entries are pickles checked against damage, not authenticated: like XLA's cache, the folder must
not be writable by anyone the engine does not trust.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import shutil
import tempfile
from pathlib import Path

import jax

logger = logging.getLogger(__name__)

FORMAT = 1
KEEP = 8  # newest keys kept (one per engine configuration and code version)
_KEY = re.compile(r"[0-9a-f]{32}")  # a key folder's name (nothing else under the root is pruned)
_PACKAGES = ("jaxpaged", "pallas_kernels")
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion", "jax_default_prng_impl",
          "jax_threefry_partitionable")


def step_cache_dir() -> Path | None:
    """Where compiled steps are kept, or None (off)."""
    off = ("", "0", "off")
    explicit = os.environ.get("JAXPAGED_STEP_CACHE")
    if explicit is not None:
        return None if explicit in off else Path(explicit)
    xla = os.environ.get("JAXPAGED_COMPILATION_CACHE")
    if xla is not None:
        return None if xla in off else Path(xla + "-steps")
    return Path(os.path.expanduser("~/.cache/jaxpaged/steps"))


@functools.cache
def source_digest() -> str:
    """sha256 of every source file of jaxpaged and pallas_kernels (any edit changes it)."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if path.suffix in _SOURCE_SUFFIXES and path.is_file():
                h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.cache
def _environment() -> str:
    """The jax/jaxlib versions, backend, devices, this CPU and the numerics flags."""
    import flax
    import jaxlib
    import ml_dtypes

    from jaxpaged.layers.backends import kernel_build_identity

    flags = {name: str(getattr(jax.config, name, None)) for name in _FLAGS}
    devices = [(d.platform, d.device_kind, d.id) for d in jax.devices()]
    versions = (jax.__version__, jaxlib.__version__, flax.__version__, ml_dtypes.__version__)
    return repr((versions, jax.default_backend(), devices, kernel_build_identity(), flags))


def _trace_environment() -> str:
    """The environment variables a trace reads, as they are now: XLA_FLAGS and the Pallas attention's variant."""
    from jaxpaged.layers.backends import ATTENTION_VARIANT_ENV

    return repr([os.environ.get(name, "") for name in ("XLA_FLAGS", ATTENTION_VARIANT_ENV)])


def _describe(args) -> str:
    """Shapes, dtypes and placements of a call's arguments, with their tree structure."""
    leaves, tree = jax.tree.flatten(args)
    return repr((str(tree), [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]))


class StepCache:
    """One engine configuration's traced steps in `root/<key>/<bucket>.bin` (`jax.export` modules)."""

    def __init__(self, root: Path, what: str, shared_args, custom_calls: tuple[str, ...] = ()):
        """what: everything else the steps are built from (the engine config and model structure); shared_args:
        the arguments every bucket takes (their shapes go into the key); custom_calls: the FFI targets the steps
        may call (allowed in the exported modules)."""
        key = hashlib.sha256(repr((FORMAT, source_digest(), _environment(), _trace_environment(), what,
                                   _describe(shared_args))).encode())
        self.root = root
        self.dir = root / key.hexdigest()[:32]
        self.custom_calls = custom_calls

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}.bin"

    def has(self, name: str) -> bool:
        return self._path(name).exists()

    def compile(self, name: str, args, donate: tuple[int, ...]):
        """Read step `name` and compile it for `args` (XLA's persistent cache then answers the compile); returns
        a callable of the original arguments. Raises ValueError where the entry is damaged or made for other
        shapes (the caller traces the step again)."""
        path = self._path(name)
        blob = path.read_bytes()
        digest, payload = blob[:32], blob[32:]
        if hashlib.sha256(payload).digest() != digest:
            raise ValueError(f"{path}: checksum mismatch (a damaged file)")
        described, module, in_tree, out_tree = pickle.loads(payload)
        if described != _describe(args):
            raise ValueError(f"{path}: made for other argument shapes")
        step = FlatStep(jax.export.deserialize(bytearray(module)).call, in_tree, out_tree, donate, args)
        compiled = step.lower(*args).compile()
        try:
            os.utime(self.dir)  # (recently used: kept when older keys are pruned)
        except OSError:  # (a read-only cache)
            pass
        return compiled

    def export(self, name: str, fn, args, donate: tuple[int, ...]):
        """Trace `fn` on `args` and keep the traced module (where the folder can be written); returns it as a
        `FlatStep` to lower and compile, or None (logged) where it cannot be exported (the caller then compiles
        `fn` directly)."""
        leaves, in_tree = jax.tree.flatten(args)
        trees = []

        def flat(*xs):
            out_leaves, out_tree = jax.tree.flatten(fn(*jax.tree.unflatten(in_tree, xs)))
            trees.append(out_tree)
            return out_leaves

        try:
            checks = [jax.export.DisabledSafetyCheck.custom_call(c) for c in self.custom_calls]
            exported = jax.export.export(jax.jit(flat), disabled_checks=checks)(*leaves)
            payload = pickle.dumps((_describe(args), bytes(exported.serialize()), in_tree, trees[-1]))
        except Exception as e:  # noqa: BLE001 - not keeping a step only costs the next start its trace
            logger.warning("could not export the traced step %s (%s)", name, e)
            return None
        self._write(name, hashlib.sha256(payload).digest() + payload)
        return FlatStep(exported.call, in_tree, trees[-1], donate, args)

    def _write(self, name: str, blob: bytes) -> None:
        """Keep an entry (under a temporary name, then renamed); logged, not raised, where it cannot be."""
        tmp = None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=self.dir)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(name))
        except OSError as e:  # (a read-only or full disk: the next start traces this step again)
            logger.warning("could not keep the traced step %s in %s (%s)", name, self.dir, e)
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return
        self._prune()

    def _prune(self) -> None:
        """Remove all but the `KEEP` most recently used keys."""
        try:
            keys = sorted((p for p in self.root.iterdir() if _KEY.fullmatch(p.name) and p.is_dir()),
                          key=lambda p: p.stat().st_mtime)
        except OSError:
            return
        for old in keys[:-KEEP]:
            if old != self.dir:
                shutil.rmtree(old, ignore_errors=True)


class FlatStep:
    """An exported step behind the call signature of the original: `lower(*args).compile()` gives a callable
    taking the original (tree) arguments and returning the original (tree) results."""

    def __init__(self, call, in_tree, out_tree, donate: tuple[int, ...], args):
        spans, at = [], 0
        for arg in args:  # each argument's leaves in the flat list
            n = len(jax.tree.leaves(arg))
            spans.append(range(at, at + n))
            at += n
        self._jitted = jax.jit(call, donate_argnums=tuple(j for i in donate for j in spans[i]))
        self.in_tree, self.out_tree = in_tree, out_tree

    def lower(self, *args):
        lowered = self._jitted.lower(*jax.tree.leaves(args))
        return _Lowered(lowered, self.out_tree)


class _Lowered:
    def __init__(self, lowered, out_tree):
        self._lowered, self._out_tree = lowered, out_tree

    def compile(self):
        compiled, out_tree = self._lowered.compile(), self._out_tree

        def step(*args):
            return jax.tree.unflatten(out_tree, compiled(*jax.tree.leaves(args)))

        return step
