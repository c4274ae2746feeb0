"""Triton kernels of verl_fast, shipped in the wheel as ``verl_fast.kernels``: one op per module."""
