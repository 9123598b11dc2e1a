"""Group-wise 4-bit weights: the one portable format, and its plain torch meaning.

A 4-bit target reads a quarter of the bytes of a bf16 one, and the verify pass of speculative
decoding (a few tokens against every weight) is bound by those bytes. Every path that runs 4-bit
weights (the CPU path, the Triton kernel in `triton_int4.py`) reads this format, and the functions
here are the reference they are tested against.

Format, for a weight W of shape (N, K) (out, in), in groups of `group_size` consecutive elements
along K (asymmetric, min/scale per group, as in GPTQ/AWQ-style "q4" formats):
- scale_g = (max_g - min_g) / 15, min_g = the group's minimum; q = round((w - min_g) / scale_g)
  clamped to 0..15, so that w ~ q * scale_g + min_g with an error of at most scale_g / 2.
- `packed` uint8 (N, K // 2): byte j holds q[:, 2j] in its low nibble and q[:, 2j + 1] in its high
  nibble. `scales`, `mins` float32 (N, K // group_size).
"""

from __future__ import annotations

import torch

LEVELS = 15
"""The largest 4-bit code: codes run 0..15."""

MIN_SCALE = 1e-8
"""A constant group has max == min; any positive scale then encodes it exactly (q = 0, w = min)."""


def check_group_layout(k: int, group_size: int) -> None:
    """Raise ValueError unless K splits into whole groups of an even size."""
    if group_size <= 0 or group_size % 2:
        raise ValueError(f"group_size must be a positive even number (two codes per byte), got {group_size}")
    if k % group_size:
        raise ValueError(f"in_features K={k} must be a multiple of group_size={group_size}")


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float weight -> packed uint8 (N, K // 2), scales and mins float32 (N, K // group_size)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    n, k = weight.shape
    check_group_layout(k, group_size)
    groups = weight.detach().float().reshape(n, k // group_size, group_size)  # (N, G, group)
    mins = groups.amin(dim=-1)  # (N, G)
    scales = ((groups.amax(dim=-1) - mins) / LEVELS).clamp_min(MIN_SCALE)  # (N, G)
    q = torch.round((groups - mins[..., None]) / scales[..., None]).clamp(0, LEVELS)  # (N, G, group)
    q = q.to(torch.uint8).reshape(n, k)  # (N, K)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # (N, K // 2)
    return packed.contiguous(), scales.contiguous(), mins.contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """packed uint8 (N, K // 2) -> codes uint8 (N, K), in 0..15."""
    low = packed & 0x0F  # (N, K // 2): even columns
    high = packed >> 4  # (N, K // 2): odd columns
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)  # (N, K)


def dequantize_int4(
    packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The (N, K) weight the packed codes stand for: w = q * scale + min, computed in float32."""
    q = unpack_int4(packed)  # (N, K)
    n, k = q.shape
    check_group_layout(k, group_size)
    groups = q.float().reshape(n, k // group_size, group_size)  # (N, G, group)
    weight = groups * scales.float()[..., None] + mins.float()[..., None]  # (N, G, group)
    return weight.reshape(n, k).to(dtype)


def int4_matmul_reference(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (M, K) @ W.T -> (M, N) in x.dtype, with W de-quantized and the product taken in float32."""
    weight = dequantize_int4(packed, scales, mins, group_size)  # (N, K) float32
    return (x.float() @ weight.T).to(x.dtype)  # (M, N)
