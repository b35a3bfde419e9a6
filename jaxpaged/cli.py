"""`jaxpaged` command line: generate, bench."""

from __future__ import annotations

import argparse
import logging
import sys


def _generate(ns: argparse.Namespace) -> None:
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.config import EngineArgs

    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, max_tokens=ns.max_tokens,
                            seed=ns.sampling_seed)
    prompts = ns.prompt or ["Tell me a short story about a robot who learns to paint."]
    if ns.raw:
        outs = llm.generate(prompts, params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    for prompt, out in zip(prompts, outs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text}\n[{len(out.outputs[0].token_ids)} tokens, "
              f"finish_reason={out.outputs[0].finish_reason}]")


def _serve(ns: argparse.Namespace) -> None:
    from server.serve import main as serve_main

    serve_main(ns)


def build_parser() -> argparse.ArgumentParser:
    from jaxpaged.bench import kernels as kernel_bench
    from jaxpaged.bench import serve as serve_bench
    from jaxpaged.bench import throughput
    from jaxpaged.config import EngineArgs

    parser = argparse.ArgumentParser(prog="jaxpaged", description="High-throughput LLM inference on JAX.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (chat template applied unless --raw)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    EngineArgs.add_cli_args(gen)
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--shutdown-timeout", type=float, default=30.0)
    EngineArgs.add_cli_args(srv)
    srv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput, optionally against HF transformers")
    throughput.add_args(tp)
    tp.set_defaults(func=throughput.main)
    sv = bench_sub.add_parser("serve", help="streaming load against an OpenAI-compatible server")
    serve_bench.add_args(sv)
    sv.set_defaults(func=serve_bench.main)
    kb = bench_sub.add_parser("kernels", help="Pallas kernels against their references (run it on a GPU)")
    kernel_bench.add_args(kb)
    kb.set_defaults(func=kernel_bench.main)
    return parser


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    try:
        ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
