"""Weight-only int8 linear layers for a draft model on the CPU.

A draft step reads every weight once for one token, so its time is the bytes of its weights over
the memory bandwidth: int8 weights with one scale per output channel halve them against bf16 and
quarter them against fp32. torch's `_weight_int8pack_mm` de-quantizes inside the matmul.
Quantizing the draft changes only its guesses, never the output: the target still decides every
token (its acceptance is what the benchmark reports).
"""

from __future__ import annotations

import torch


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> int8 weight (out, in) and float scales (out,), symmetric."""
    scales = weight.float().abs().amax(dim=1).clamp_min(1e-8) / 127.0  # (out,)
    q = torch.round(weight.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_per_channel(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 (out, in) and scales (out,) -> the (out, in) float32 weight they stand for."""
    return q.float() * scales.float()[:, None]


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain torch meaning of Int8Linear: de-quantize, then an ordinary linear."""
    weight = dequantize_per_channel(q, scales).to(x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def int8_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(torch.nn.Module):
    """nn.Linear with int8 weights; activations stay in the model's (bf16) dtype."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))  # (out, in)
        self.register_buffer("scales", torch.zeros(out_features, dtype=dtype, device=device))  # (out,)
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, dtype: torch.dtype | None = None) -> "Int8Linear":
        dtype = dtype or linear.weight.dtype
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, dtype, linear.weight.device)
        q, scales = quantize_per_channel(linear.weight.detach())
        module.qweight.copy_(q)
        module.scales.copy_(scales.to(dtype))
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach().to(dtype))
        return module

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"

    def dense_weight(self) -> torch.Tensor:
        return dequantize_per_channel(self.qweight, self.scales)

    def align(self) -> None:
        """The CPU kernel reads with aligned vector loads (it crashes on a weight at an odd offset,
        as tensors read from one file buffer can be): give such a weight its own memory."""
        if self.qweight.data_ptr() % 64:
            self.qweight = self.qweight.clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (M, in): the CPU kernel needs contiguous rows
        out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales.to(rows.dtype))  # (M, out)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def int8_shape_ok(linear: torch.nn.Linear) -> bool:
    # torch 2.13's CPU kernel crashes (segfault) for more than one row when in_features is not a
    # multiple of 16; real models' widths are multiples of 64, odd layers stay in float.
    return linear.in_features % 16 == 0
