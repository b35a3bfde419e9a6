"""jaxpaged: high-throughput LLM inference on JAX with a paged KV cache and continuous batching."""

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from jaxpaged.engine.llm import LLM
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.lora_request import LoRARequest
from jaxpaged.request import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "AsyncLLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "EngineArgs", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams", "StructuredOutputsParams"]
from jaxpaged.version import __version__  # noqa: F401
