"""A process SIGKILLed while it writes (a KV disk-tier file, an engine snapshot) leaves nothing a restarted one
reads as whole when it is not: the next disk tier indexes and reads back only complete files, equal to what was
written, and the next engine loads the newest complete snapshot. The writer is a real process killed with
SIGKILL while its temporary file or folder exists (a write in progress), not a simulated truncation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

from jaxpaged import LLMEngine
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.kv_offload import DiskTier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = (4, 2, 16, 8, 64)  # [L, 2, block_size, KH, D]: 256 KB a block, so a write takes a while


def block(h: int) -> np.ndarray:
    return np.random.default_rng(h).standard_normal(SHAPE).astype(np.float32)


def start(code: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def kill_mid_write(proc: subprocess.Popen, folder: str, is_partial, *, ready, timeout_s: float = 120.0) -> bool:
    """SIGKILL `proc` once `ready()` holds and a partial write (a name `is_partial` accepts) is in `folder`;
    True if it was killed mid-write (else, at the deadline, wherever it was)."""
    deadline, caught = time.monotonic() + timeout_s, False
    while time.monotonic() < deadline and proc.poll() is None:
        names = os.listdir(folder) if os.path.isdir(folder) else []
        if ready() and any(is_partial(n) for n in names):
            caught = True
            break
        time.sleep(0.0005)
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return caught


def test_disk_tier_after_a_writer_killed_mid_write(tmp_path):
    proc = start(f"""
        import numpy as np
        from jaxpaged.kv_offload import DiskTier
        t = DiskTier({str(tmp_path)!r}, "m", 1 << 34, block_size=16, block_shape={SHAPE}, dtype=np.float32)
        h = 0
        while True:
            t.write(h, (h,), np.random.default_rng(h).standard_normal({SHAPE}).astype(np.float32))
            h += 1
            if h % 8 == 0:
                t.flush()
        """)
    folder = os.path.join(tmp_path, "m")
    done = lambda: os.path.isdir(folder) and len(os.listdir(folder)) > 8  # noqa: E731
    assert kill_mid_write(proc, folder, lambda n: n.endswith(".tmp"), ready=done)
    left = os.listdir(folder)  # (the temporary file may or may not outlive the kill: both must read back whole)
    again = DiskTier(str(tmp_path), "m", 1 << 34, block_size=16, block_shape=SHAPE, dtype=np.float32)
    assert len(again.index) == sum(n.endswith(".kvblock") for n in left) > 8
    for h in list(again.index):  # every indexed file whole and equal to what was written
        assert np.array_equal(again.read(h, (h,)), block(h)), h
    again.close()


def test_snapshot_after_a_writer_killed_mid_save(tiny_model_dir, tmp_path):
    model, folder = tiny_model_dir("llama-bytes"), str(tmp_path / "snaps")
    args = dict(model=model, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=8, seed=1)
    proc = start(f"""
        from jaxpaged import LLMEngine, SamplingParams
        from jaxpaged.engine.arg_utils import EngineArgs
        engine = LLMEngine.from_engine_args(EngineArgs(**{args!r}))
        for i in range(6):
            engine.add_request(f"r{{i}}", list(range(3, 40 + i)), SamplingParams(max_tokens=8, seed=i))
        while True:
            engine.save_state({folder!r})
        """)
    complete = lambda: os.path.isdir(folder) and sum(n.isdigit() for n in os.listdir(folder)) >= 2  # noqa: E731
    assert kill_mid_write(proc, folder, lambda n: "tmp" in n, ready=complete), "the writer was never seen mid-save"
    engine = LLMEngine.from_engine_args(EngineArgs(**args))
    ids = engine.load_state(folder)
    assert sorted(ids) == [f"r{i}" for i in range(6)]
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == set(ids)  # (the restored requests run to their end)
