"""Lower a function for CUDA on a machine without a GPU (what the kernel tests check)."""

import jax


def lower_for_cuda(f, *args, device_kind: str = "NVIDIA H200") -> str:
    """StableHLO text of jit(f) lowered for CUDA; Triton kernels in it are lowered for `device_kind`.

    Newer jax asks the default device for the GPU's compute capability; on a CPU-only machine an
    abstract mesh with an abstract GPU device names it instead.
    """
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind=device_kind, num_cores=None, platform="gpu"))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
