"""`jaxpaged` command line: generate, serve, convert, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger(__name__)


def _generate(ns: argparse.Namespace) -> None:
    """Validate everything cheap first (flags, sampling values, prompt lengths), then load and generate."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.engine.arg_utils import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine, check_prompt_length, prepare_model

    args = EngineArgs.from_cli_args(ns)
    if args.process_id > 0:
        return follow_process_zero(args)
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens,
                            seed=ns.sampling_seed)
    setup = prepare_model(args)
    prompts = ns.prompt or ["Tell me a short story about a robot who learns to paint."]
    tok = setup.tokenizer
    if ns.raw:
        ids = [tok.encode(p, add_special_tokens=True) for p in prompts]
    else:
        ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]) for p in prompts]
    for x in ids:
        check_prompt_length(len(x), setup.scheduler_config.max_model_len)
    llm = LLM.from_engine(LLMEngine.from_engine_args(args, setup))
    outs = llm.generate(ids, params)
    for prompt, out in zip(prompts, outs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text}\n[{len(out.outputs[0].token_ids)} tokens, "
              f"finish_reason={out.outputs[0].finish_reason}]")


def _convert(ns: argparse.Namespace) -> None:
    from jaxpaged.models.convert import convert
    from jaxpaged.models.registry import default_model_path

    print(convert(ns.model or default_model_path(), ns.out, dtype=ns.dtype, load_format=ns.load_format))


def follow_process_zero(args) -> None:
    """Processes other than 0 (`--process-id N`): build the engine as process 0 does, then run its steps until
    it stops."""
    import jax

    from jaxpaged.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(args)
    logger.info("Process %d of %d: running process 0's steps", jax.process_index(), jax.process_count())
    engine.core.runner.channel.follow()
    logger.info("Process %d: process 0 stopped; exiting", jax.process_index())


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")  # (server/tool_parsers: a test keeps them equal)
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def _serve(ns: argparse.Namespace) -> None:
    from jaxpaged.engine.arg_utils import EngineArgs
    from server.serve import main as serve_main

    if ns.process_id > 0:
        return follow_process_zero(EngineArgs.from_cli_args(ns))
    serve_main(ns)


def _serve_disagg(ns: argparse.Namespace) -> None:
    from server.disagg_proxy import main as proxy_main

    proxy_main(ns)


def port_number(text: str) -> int:
    """A TCP port, 0-65535 (0: any free one); the socket layer would wrap a bigger number onto another port."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535)")
    return port


def _bench_serve(ns: argparse.Namespace) -> dict:
    """`bench serve`: a load against a live server, or with --disagg one engine against a prefill/decode split."""
    from jaxpaged.bench import disagg, serve

    return disagg.main(ns) if ns.disagg else serve.main(ns)


def build_parser() -> argparse.ArgumentParser:
    from jaxpaged.bench import functional as functional_bench
    from jaxpaged.bench import host as host_bench
    from jaxpaged.bench import kernels as kernel_bench
    from jaxpaged.bench import serve as serve_bench
    from jaxpaged.bench import soak, throughput
    from jaxpaged.bench.dummy_model import SHAPES, write_dummy_model
    from jaxpaged.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(prog="jaxpaged", description="High-throughput LLM inference on JAX.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (chat template applied unless --raw)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch; default: a story request)")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text (default: off)")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off (default: %(default)s)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely, 0 = off "
                                                          "(default: %(default)s)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of the sampled tokens (default: random)")
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    srv.add_argument("--port", type=port_number, default=8000, help="port to listen on (default: %(default)s)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes "
                                                     "(default: none)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model "
                                                               "file or folder name)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds running streams may take to "
                                                                          "finish after SIGTERM (default: %(default)s)")
    srv.add_argument("--tenants", default=None, metavar="FILE",
                     help="a TOML or JSON file of tenants: each one's API key, priority class, max concurrent "
                     "requests, tokens per minute and KV-pool share (see server/tenants.py); other keys get 401 "
                     "(default: none)")
    srv.add_argument("--snapshot-dir", default=None, help="on SIGTERM, save the requests still running after the "
                     "shutdown timeout to this folder; at start, restore and finish those saved there (their outputs "
                     "go to restored_outputs.jsonl in it) (default: none)")
    srv.add_argument("--kv-pull-from", default=None, metavar="URL[,URL]",
                     help="with --kv-role consumer: prefill instances on other hosts this server may pull KV blocks "
                     "from when a request names one in kv_transfer_params (serve-disagg does) (default: none)")
    srv.add_argument("--enable-prompt-tokens-details", action="store_true",
                     help="usage objects carry prompt_tokens_details.cached_tokens: the prompt tokens found in the "
                     "prefix cache (vLLM's flag; default: off)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help='tool_choice "auto": calls the model writes are parsed into tool_calls (needs '
                     "--tool-call-parser; \"required\" and named functions work without it; default: off)")
    srv.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                     help="how the model writes calls: hermes (Qwen2.5/Qwen3, Hermes), llama3_json, mistral, "
                     "pythonic (Llama 3.2/4) (vLLM's names; default: none)")
    srv.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                     help="split <think>...</think> into reasoning_content: deepseek_r1 or qwen3 (default: none)")
    srv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                     help="LoRA adapters (PEFT folders) served under their names, chosen by a request's model field "
                     "(needs --enable-lora; vLLM's JSON form {\"name\", \"path\", \"base_model_name\"} too; "
                     "default: none)")
    srv.add_argument("--allow-runtime-lora-updating", action="store_true",
                     help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter work (also "
                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; default: off)")
    EngineArgs.add_cli_args(srv)
    srv.set_defaults(func=_serve)

    dg = sub.add_parser("serve-disagg", help="one OpenAI endpoint in front of prefill and decode instances "
                                             "(prefill/decode disaggregation; see server/disagg_proxy.py)")
    dg.add_argument("--prefill", required=True, metavar="URL[,URL]",
                    help="base URLs of `jaxpaged serve --kv-role producer` instances")
    dg.add_argument("--decode", required=True, metavar="URL[,URL]",
                    help="base URLs of `jaxpaged serve --kv-role consumer` instances (sharing --kv-offload-dir)")
    dg.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    dg.add_argument("--port", type=port_number, default=8000, help="port to listen on (default: %(default)s)")
    dg.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take upstream "
                                                                 "(default: %(default)s)")
    dg.set_defaults(func=_serve_disagg)

    cv = sub.add_parser("convert", help="save a model as the engine's parameter tree (orbax) for fast starts; "
                                        "--model OUT then loads it")
    cv.add_argument("--model", default=None, help="HF folder or GGUF file (default: the default model)")
    cv.add_argument("--out", required=True, help="the folder to write (must not exist or be empty)")
    cv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="weights' dtype in the checkpoint (default: %(default)s)")
    cv.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights from the config (default: %(default)s)")
    cv.set_defaults(func=_convert)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput, optionally against HF transformers")
    throughput.add_args(tp)
    tp.set_defaults(func=throughput.main)
    sv = bench_sub.add_parser("serve", help="streaming load against an OpenAI-compatible server")
    serve_bench.add_args(sv)
    sv.set_defaults(func=_bench_serve)
    sk = bench_sub.add_parser("soak", help="hours of mixed traffic against a server: fails on growth in memory, "
                                           "descriptors, KV usage or latency")
    soak.add_args(sk)
    sk.set_defaults(func=soak.main)
    dm = bench_sub.add_parser("dummy-model", help="write a weightless Llama-shaped model folder (load_format dummy)")
    dm.add_argument("output", help="the folder to write")
    dm.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="(default: %(default)s)")
    dm.set_defaults(func=lambda ns: print(write_dummy_model(ns.output, ns.shape)))
    hb = bench_sub.add_parser("host", help="host milliseconds per engine step, the device step stubbed out")
    host_bench.add_args(hb)
    hb.set_defaults(func=host_bench.main)
    fb = bench_sub.add_parser("functional", help="jaxpaged.functional.generate against LLM.generate, one batch")
    functional_bench.add_args(fb)
    fb.set_defaults(func=functional_bench.main)
    kb = bench_sub.add_parser("kernels", help="kernels against their references (GPU: the Pallas kernels; CPU: "
                                              "the C++ attention)")
    kernel_bench.add_args(kb)
    kb.set_defaults(func=kernel_bench.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    # jaxpaged never runs a PyTorch model: transformers' "PyTorch was not found" advice is noise on a base install.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)  # (orbax logs every step of a checkpoint read at INFO)
    try:
        ns.func(ns)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
