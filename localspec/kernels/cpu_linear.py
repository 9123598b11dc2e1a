"""Wide verify passes on a CPU: a oneDNN-prepacked copy of each weight for inputs of many rows.

PyTorch's default CPU matmul is tuned for one row (plain decoding); for 4-16 rows its time grows
almost linearly on some CPUs, which is exactly the shape of a speculative verify pass. oneDNN with
a weight reordered once into its blocked layout keeps 4-16 rows close to the cost of one. We keep
both: `F.linear` (the reference, and the faster path for narrow inputs) and the packed copy for
inputs of `wide_from` rows or more. It costs a second copy of the weights, so the caller enables
it only when memory allows and a measurement says it pays.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def packing_supported() -> bool:
    mkldnn_ops = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn_ops, "_reorder_linear_weight")
        and hasattr(mkldnn_ops, "_linear_pointwise")
    )


@functools.cache
def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders weights of this dtype on this CPU: its bf16 path needs AVX-512 (BW,
    VL, DQ) or AVX-NE-CONVERT and raises elsewhere, so an AVX2-only CPU keeps bf16 linears plain."""
    if not packing_supported():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


class PackedLinear(torch.nn.Module):
    """Drop-in for an nn.Linear on the CPU, with a prepacked weight for wide inputs."""

    def __init__(self, linear: torch.nn.Linear, wide_from: int) -> None:
        super().__init__()
        self.linear = linear
        self.wide_from = wide_from
        weight = linear.weight.detach()  # (out, in)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)  # oneDNN blocked layout

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def dense_weight(self) -> torch.Tensor:
        return self.linear.weight.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        rows = x.numel() // x.shape[-1]
        if rows < self.wide_from:
            return F.linear(x, self.linear.weight, self.linear.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.linear.bias, "none", [], "")


def pack_linears(model: torch.nn.Module, wide_from: int) -> int:
    """Replace every nn.Linear under `model` whose dtype oneDNN packs here by a PackedLinear;
    returns the bytes added."""
    added = 0
    for name, child in list(model.named_children()):
        if isinstance(child, torch.nn.Linear) and packs(child.weight.dtype):
            setattr(model, name, PackedLinear(child, wide_from))
            added += child.weight.numel() * child.weight.element_size()
        elif not isinstance(child, PackedLinear):
            added += pack_linears(child, wide_from)
    return added


def unpack_linears(model: torch.nn.Module) -> None:
    """Undo pack_linears (frees the packed copies)."""
    for name, child in list(model.named_children()):
        if isinstance(child, PackedLinear):
            setattr(model, name, child.linear)
        else:
            unpack_linears(child)


def set_wide_from(model: torch.nn.Module, wide_from: int) -> None:
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.wide_from = wide_from


def linear_bytes(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))
