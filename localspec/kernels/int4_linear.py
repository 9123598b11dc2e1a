"""nn.Linear with group-wise int4 weights (the format of `int4_format.py`) on every device.

Decoding reads every weight once per pass, so a pass costs about the bytes of the weights over
the memory bandwidth: 4-bit weights are a quarter of bf16's. The module stores the portable
format (that is what the on-disk cache holds) and runs it with the fastest kernel the device has:
- CPU: torch's packed int4 matmul (`_weight_int4pack_mm_for_cpu`, bf16 activations), whose
  weight layout is derived from the portable one when the module first runs;
- CUDA: the Triton small-M kernel of `triton_int4.py` (verify passes are 1 to 16 rows);
- elsewhere: the plain torch reference (de-quantize, then an ordinary linear).
"""

from __future__ import annotations

import torch

from localspec.kernels.int4_format import check_group_layout, dequantize_int4, int4_matmul_reference, quantize_int4
from localspec.kernels.triton_int4 import int4_matmul
from localspec.kernels.triton_support import triton_available

GROUP_SIZE = 32
"""Elements per scale/min. 32 matches the sub-blocks of GGUF's Q4_K, so a Q4_K_M model re-packed
here keeps (nearly) the weights it was published with; larger groups measured no faster on CPU."""


def cpu_int4_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


class Int4Linear(torch.nn.Module):
    """Weight-only int4 linear; activations stay in the model's compute dtype (bf16 on CPU)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int = GROUP_SIZE,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None) -> None:
        super().__init__()
        check_group_layout(in_features, group_size)
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("scales", torch.zeros(out_features, groups, dtype=torch.float32, device=device))
        self.register_buffer("mins", torch.zeros(out_features, groups, dtype=torch.float32, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        self._cpu_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # torch's CPU layout, built on first use

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int = GROUP_SIZE, dtype: torch.dtype = torch.bfloat16) -> "Int4Linear":
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size, dtype, linear.weight.device)
        packed, scales, mins = quantize_int4(linear.weight, group_size)
        module.packed.copy_(packed)
        module.scales.copy_(scales)
        module.mins.copy_(mins)
        if linear.bias is not None:
            module.bias.data.copy_(linear.bias.detach().to(dtype))
        return module

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group_size}"

    def _cpu_layout(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's CPU kernel computes w = (q - 8) * scale + zero: zero = min + 8 * scale. Deriving
        its layout takes ~0.1 s per 10M weights, so loaders cache it (`cpu_layout` / `adopt_cpu_layout`)."""
        if self._cpu_weight is None or self._cpu_weight[1].dtype != dtype:
            codes = torch.stack((self.packed & 0x0F, self.packed >> 4), dim=-1).reshape(self.out_features, -1)  # (N, K)
            scales, zeros = self.scales, self.mins + 8 * self.scales  # (N, groups)
            pad = -self.out_features % 16  # the kernel works on 16 output rows at a time
            if pad:
                codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))  # (N + pad, K)
                scales, zeros = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (scales, zeros))
            weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            scale_zeros = torch.stack((scales.t(), zeros.t()), dim=-1).to(dtype).contiguous()  # (groups, N + pad, 2)
            self._cpu_weight = (weight, scale_zeros)
        return self._cpu_weight

    def cpu_layout(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        weight, scale_zeros = self._cpu_layout(dtype)
        return {"weight": weight, "scale_zeros": scale_zeros}

    def adopt_cpu_layout(self, tensors: dict[str, torch.Tensor]) -> None:
        # the CPU kernel reads with aligned vector loads: tensors at odd offsets inside a file's
        # buffer get their own (aligned) memory
        weight, scale_zeros = (t if t.data_ptr() % 64 == 0 else t.clone() for t in (tensors["weight"], tensors["scale_zeros"]))
        self._cpu_weight = (weight, scale_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        rows = x.reshape(-1, self.in_features).contiguous()  # (M, in): the CPU kernels need contiguous rows
        if rows.device.type == "cpu" and cpu_int4_supported() and rows.dtype in (torch.bfloat16, torch.float16):
            weight, scale_zeros = self._cpu_layout(rows.dtype)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, weight, self.group_size, scale_zeros)  # (M, N + pad)
            out = out[:, : self.out_features]
        elif rows.device.type == "cuda" and triton_available():  # without Triton: the reference, slowly
            out = int4_matmul(rows, self.packed, self.scales, self.mins, self.group_size)
        else:
            out = int4_matmul_reference(rows, self.packed, self.scales, self.mins, self.group_size)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    def dense_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight the stored codes stand for (int4_format's reference)."""
        return dequantize_int4(self.packed, self.scales, self.mins, self.group_size)


def int4_shape_ok(linear: torch.nn.Linear, group_size: int = GROUP_SIZE) -> bool:
    return linear.in_features % group_size == 0
