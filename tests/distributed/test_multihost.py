"""Two processes x 2 CPU devices on localhost, one tensor-parallel mesh over the four (`jax.distributed`, gloo):
the same outputs as one device, and a process that dies ends the other with an error within seconds."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.distributed.workload import baseline

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(process_id: int, port: int, model: str, out: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "tests.distributed.multihost_worker", str(process_id), str(port),
                             model, out, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _finish(p: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"process did not end within {timeout} s:\n{out[-3000:]}")
    return p.returncode, out


def test_two_processes_equal_one_device(tiny_model_dir, tmp_path):
    path, out, port = tiny_model_dir("llama"), str(tmp_path / "out.json"), _port()
    procs = [_start(i, port, path, out) for i in (1, 0)]
    results = [_finish(p, 600) for p in procs]
    for rc, log in results:
        assert rc == 0, log[-3000:]
    with open(out) as f:
        got = json.load(f)
    want = baseline(path)
    assert got == [[list(x) for x in want[0]], [list(x) for x in want[1]]]


@pytest.mark.parametrize("victim", [1, 0], ids=["follower dies", "leader dies"])
def test_a_dead_process_ends_the_other(victim, tiny_model_dir, tmp_path):
    path, port = tiny_model_dir("llama"), _port()
    follower, leader = (_start(i, port, path, str(tmp_path / "x"), "--long") for i in (1, 0))
    deadline = time.monotonic() + 300
    line = ""
    while "generating" not in line:  # (the leader prints it once both are up and compiled)
        line = leader.stdout.readline()
        assert line or leader.poll() is None, "the leader ended before generating"
        assert time.monotonic() < deadline, "the processes did not start"
    time.sleep(1.0)
    dead, survivor = (follower, leader) if victim == 1 else (leader, follower)
    dead.send_signal(signal.SIGKILL)
    start = time.monotonic()
    rc, log = _finish(survivor, 60)
    assert rc != 0, f"the survivor ended cleanly although its peer died:\n{log[-2000:]}"
    assert time.monotonic() - start < 45, "the survivor took too long to notice"
    dead.communicate()
