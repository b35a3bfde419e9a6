"""The installed `jaxpaged` command: it runs, checks cheap things before loading a model, and documents its flags."""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys

import pytest

from jaxpaged.cli import build_parser

NO_TORCH_DIR = os.path.join(os.path.dirname(__file__), "no_torch")


def jaxpaged_command() -> str:
    """The console script pip installed next to this interpreter."""
    path = os.path.join(os.path.dirname(sys.executable), "jaxpaged")
    if not os.path.exists(path):
        path = shutil.which("jaxpaged") or ""
    if not path:
        pytest.fail("the `jaxpaged` entry point is not installed (pip install -e .)")
    return path


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`jaxpaged ARGS` with torch hidden (a base install has none), on the run's compilation cache."""
    env = {**os.environ, "PYTHONPATH": NO_TORCH_DIR + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([jaxpaged_command(), *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def config_only_model(tiny_model_dir, tmp_path_factory):
    """The tiny model's config and tokenizer without its weights: loading it fails, so any error that names
    something else was found before the load."""
    src, dst = tiny_model_dir("llama"), tmp_path_factory.mktemp("config-only")
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    return str(dst)


def test_entry_point_generates_without_torch(tiny_model_dir):
    got = run("generate", "--model", tiny_model_dir("llama"), "--raw", "--prompt", "w5 w6 w7", "--max-tokens", "4",
              "--num-kv-blocks", "32", "--max-model-len", "64", "--max-num-batched-tokens", "16")
    assert got.returncode == 0, got.stderr[-3000:]
    assert ">>> w5 w6 w7" in got.stdout and "[4 tokens, finish_reason=length]" in got.stdout


def test_loading_a_model_without_weights_fails_cleanly(config_only_model):
    got = run("generate", "--model", config_only_model, "--prompt", "w5")
    assert got.returncode == 2
    assert got.stderr.strip().splitlines()[-1].startswith("error: no *.safetensors files")


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "error: temperature must be"),
    (["--max-tokens", "0"], "error: max_tokens must be"),
    (["--top-p", "0"], "error: top_p must be"),
    (["--block-size", "12"], "error: block_size must be"),
    (["--kv-offload-host-gb", "-2"], "error: kv_offload_host_gb must be"),
    (["--kv-offload-dir", "/tmp/kv", "--no-enable-prefix-caching"], "error: kv_offload_host_gb / kv_offload_dir need"),
    (["--max-model-len", "8", "--prompt", "w5 w6 w7 w8 w9 w10 w11 w12 w13"], "error: prompt: 9 tokens"),
    (["--kv-cache-memory", "1GiB", "--max-model-len", "8", "--prompt", "w5 " * 9], "error: prompt: 9 tokens"),
    (["--tensor-parallel-size", "16"], "error: tensor_parallel_size=16 x data_parallel_size=1 exceeds the"),
    (["--data-parallel-size", "0"], "error: data_parallel_size must be a positive integer"),
    (["--num-processes", "2"], "error: coordinator_address (HOST:PORT of process 0) is needed"),
])
def test_bad_values_fail_before_the_model_loads(config_only_model, flags, message):
    got = run("generate", "--model", config_only_model, "--raw", *flags)
    assert got.returncode == 2
    assert got.stderr.strip() == got.stderr.strip().splitlines()[0], "one line, no traceback"
    assert got.stderr.startswith(message), got.stderr


def test_serve_on_a_busy_port_is_one_line_before_loading(config_only_model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        got = run("serve", "--model", config_only_model, "--port", str(port))
    assert got.returncode == 2
    assert got.stderr.strip() == f"error: --port: cannot listen on 127.0.0.1:{port}: address already in use"


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_refuses_a_port_out_of_range(port):
    """99999 would wrap to port 34463 in the socket layer and the server would listen there."""
    got = run("serve", "--port", port, timeout=60)
    assert got.returncode == 2 and "argument --port:" in got.stderr and "not a port number" in got.stderr


def test_serve_refuses_a_bad_tenants_file_before_loading(config_only_model, tmp_path):
    (tmp_path / "t.toml").write_text('[tenants.a]\napi_key = "k"\nkv_share = { min = 2 }\n')
    got = run("serve", "--model", config_only_model, "--tenants", str(tmp_path / "t.toml"))
    assert got.returncode == 2
    assert got.stderr.strip() == "error: tenants.a.kv_share.min must be a fraction of the pool in [0, 1], got 2"
    got = run("serve", "--model", config_only_model, "--tenants", str(tmp_path / "none.toml"))
    assert got.stderr.strip().startswith("error: --tenants: no such file")


def test_every_flag_has_help_default_and_choices():
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "serve"):
        sub = subparsers.choices[name]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and "default" in action.help, f"{name} {action.option_strings} lacks help/default"
        by_flag = {a.option_strings[0]: a for a in sub._actions if a.option_strings}
        assert set(by_flag["--dtype"].choices) == {"auto", "float32", "bfloat16", "float16"}
        assert set(by_flag["--scheduling-policy"].choices) >= {"fcfs", "priority"}
        assert set(by_flag["--logprobs-mode"].choices) == {"raw_logprobs", "processed_logprobs"}
        assert "SmolLM2" in by_flag["--model"].help


def all_parsers(parser: argparse.ArgumentParser, path: str = "jaxpaged"):
    """Every parser under PARSER with its command path, depth first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_parsers(sub, f"{path} {name}")


def test_every_command_prints_its_help():
    """`--help` formats each help string with %-expansion: a bare % in one is a traceback for the user."""
    for path, parser in all_parsers(build_parser()):
        assert parser.format_help(), path
