"""Triton kernels for the GPU path. Nothing on the CPU path imports this package."""
