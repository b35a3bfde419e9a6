"""Streaming from asyncio with `AsyncLLM` (the engine on its own thread), two samples per prompt.

    python examples/stream_async.py
"""

import asyncio

from jaxpaged import AsyncLLM, EngineArgs, SamplingParams


async def main() -> None:
    llm = AsyncLLM.from_engine_args(EngineArgs(max_model_len=2048))  # the default SmolLM2 GGUF
    params = SamplingParams(max_tokens=32, n=2, temperature=0.8, seed=0)
    async for out in llm.generate("The capital of France is", params, delta=True):
        for o in out.outputs:  # delta=True: only what is new, per sample; each finish_reason arrives once
            print(o.index, repr(o.text), o.finish_reason or "")
    llm.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
