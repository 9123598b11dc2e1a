"""Whether Triton is installed, and its decorator where it is: every Triton kernel and its callers ask here.

A CPU install has no Triton: the kernels' modules still import (their kernels are then plain functions
that are never launched) and each caller takes its torch path.
"""

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


def triton_available() -> bool:
    return triton is not None


def triton_jit(fn):
    """triton.jit where triton is installed; elsewhere the plain function, which is never launched."""
    return fn if triton is None else triton.jit(fn)
