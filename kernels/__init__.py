"""Paged-attention kernels: the torch reference (CPU path and test oracle) and Triton kernels.

Nothing here queries CUDA at import time.
"""
