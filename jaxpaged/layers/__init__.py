"""The device-side layers: pure functions of arrays under `jit` (attention, the sampler and logits processors,
dense and rotary layers), dispatching between the kernels in `pallas_kernels/` and their plain-JAX references.
The only room that reaches the kernels (`backends.py` says which a step uses)."""
