"""Pallas kernels for jaxpaged, each beside its plain-JAX reference. Arrays in, arrays out."""
