"""Thin wrappers over the compiled core and the Triton kernels: validate, allocate, dispatch."""
