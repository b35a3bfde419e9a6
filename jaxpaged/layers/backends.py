"""Which kernels a step uses, decided once at engine start: the attention and sampler backends by platform and
what this machine can build, and the facts about the kernels that the runner's compile guard and the step cache
key need. The rest of the engine reaches the kernels only through this room (`jaxpaged.layers`)."""

from __future__ import annotations

import jax

from jaxpaged.config import ATTENTION_BACKENDS, platform_is_gpu
from pallas_kernels import cpu_attention, cpu_dense, cpu_onednn, cpu_rope
from pallas_kernels.cpu_build import cpu_identity
from pallas_kernels.paged_attention import VARIANT_ENV

# XLA custom-call targets of the C++ CPU kernels: the compile guard allows them in a CPU step's HLO
CPU_CUSTOM_CALL_TARGETS = (cpu_attention.TARGET, cpu_rope.TARGET, cpu_dense.TARGET, cpu_onednn.TARGET,
                           cpu_onednn.TARGET_S8)
# the environment variable that picks the Pallas attention's variant (read at trace time: part of a step's key)
ATTENTION_VARIANT_ENV = VARIANT_ENV


def resolve_kernel_backend(name: str) -> str:
    """auto: the Pallas kernel on GPU, the plain-JAX path elsewhere; pallas off GPU runs the interpreter."""
    if name == "auto":
        name = "pallas" if platform_is_gpu() else "reference"
    if name == "pallas" and not platform_is_gpu():
        return "pallas-interpret"
    return name


def resolve_attention_backend(name: str) -> str:
    """auto: the Pallas kernel on GPU; on CPU the C++ kernels (`pallas_kernels.cpu_attention`, and
    `pallas_kernels.cpu_rope` for the rotary tables) where this machine can build them, else the plain-JAX path.
    "cpu" asks for the C++ kernels and fails if they cannot be had. (Resolving registers them with XLA, which a
    step loaded from the step cache needs before it compiles.)"""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    if (name in ("auto", "cpu") and jax.default_backend() == "cpu" and cpu_attention.available()
            and cpu_rope.available()):
        return "cpu"
    if name == "cpu":
        raise ValueError("attention_backend='cpu' needs JAX on CPU and a C++ compiler to build the CPU kernels "
                         "(attention and rotary tables; see the log); use 'auto' or 'reference'")
    return resolve_kernel_backend(name)


def kernel_build_identity() -> str:
    """This CPU's identity as the C++ kernels are built for it (a compiled step that calls them is only valid
    on the same kind of CPU)."""
    return cpu_identity()
