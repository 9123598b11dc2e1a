"""RMSNorm and rotary position embedding for the few rows of a decode or verify pass on a CPU.

Why: in torch each is a handful of small ops (transformers' RMSNorm six, its rotary ten, behind a
hub-kernel wrapper), and the ops' dispatch is what costs, not the arithmetic: on the 2-core AVX2 VM
the 1.5B model's 57 norms took 3.7 ms and its 28 rotaries 2.8 ms of a ~75 ms one-token pass. One
ctypes call each does the same work in a few microseconds.

- `rms_norm`: w * (x / sqrt(mean(x^2) + eps)) per row; the sum of squares runs in order, so a row
  alone gives what it gives among others (exactness), within float rounding of the torch reference
  (whose reduction order differs). A model's norms are swapped for it as modules (`fast_norms`),
  so every pass of that model, transformers' own included, computes the same numbers.
- `rotary_`: x * cos + rotate_half(x) * sin in place, each product and sum rounded as torch's
  separate ops round them: the bits of transformers' `apply_rotary_pos_emb` (a test compares).
"""

from __future__ import annotations

import ctypes
import functools
import types
from pathlib import Path

import torch

from localspec.kernels.cpu_build import KernelUnavailable, build

SOURCE = Path(__file__).with_name("cpu_rows.cpp")
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
"""The norm classes whose forward is exactly `rms_norm_reference` (Gemma's 1 + weight is not)."""


@functools.cache
def load(cache_dir: Path) -> "RowsKernel":
    """The compiled functions; raises KernelUnavailable (one line) when they cannot be built."""
    return RowsKernel(build(SOURCE, cache_dir, "row kernel"))


class RowsKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._norm = library.rows_rms_norm
        self._norm.restype = None
        self._norm.argtypes = [ptr, i64, i64, ptr, ctypes.c_float, ptr]
        self._rotary = library.rows_rotary
        self._rotary.restype = None
        self._rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (..., D) float32 contiguous, weight (D,) float32 contiguous -> (..., D) float32."""
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], weight.data_ptr(), eps, out.data_ptr())
        return out

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (1, H, T, D) float32 whose heads lie side by side in each row (a projection's output
        viewed as heads: strides (., D, row, 1)), cos/sin (1, T, D) float32 contiguous; rotated in place."""
        _, heads, t, d = x.shape
        self._rotary(x.data_ptr(), t, heads, d, x.stride(2), cos.data_ptr(), sin.data_ptr())
        return x


def takes_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether `rotary_` reads x and cos as laid out (else the model's own function runs)."""
    _, heads, t, d = x.shape
    return (x.dtype == cos.dtype == torch.float32 and x.device.type == "cpu" and d % 2 == 0
            and x.stride(3) == 1 and x.stride(1) == d and cos.shape == (1, t, d) and cos.is_contiguous())


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm for float32 rows."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary for one tensor: x (1, H, T, D), cos/sin (1, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def fast_norms(model: torch.nn.Module, kernel: RowsKernel) -> int:
    """Every norm of `model` of a class in NORMS computes float32 rows through `kernel` (other
    inputs, and anything autograd is to differentiate, through its own forward); its hooks fire as
    before. Returns how many were swapped."""
    swapped = 0
    for module in model.modules():
        if type(module).__name__ not in NORMS or "forward" in module.__dict__:
            continue
        own = module.forward

        def forward(self, x: torch.Tensor, own=own) -> torch.Tensor:
            weight = self.weight
            differentiated = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
            if (not differentiated and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
                    and x.is_contiguous() and weight.is_contiguous() and x.shape[-1] == weight.shape[0]):
                return kernel.rms_norm(x, weight, self.variance_epsilon)
            return own(x)

        module.forward = types.MethodType(forward, module)
        swapped += 1
    return swapped


def cpu_rows(cache_dir: Path) -> RowsKernel | None:
    """The kernel, or None where it cannot be built (torch's ops then compute the same rows)."""
    try:
        return load(cache_dir)
    except KernelUnavailable:
        return None
