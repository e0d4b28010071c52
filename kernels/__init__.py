"""Compute kernels for the model runner: Triton kernels, each beside its torch reference, and a
dispatch (``kernels.ops``) that runs Triton on CUDA and torch on the CPU. Imports torch and
triton only."""
