"""A Triton matmul for a few rows of activations against group-wise 4-bit weights (GPU).

The verify pass of speculative decoding multiplies 1-16 tokens by every weight of the target, so it
is bound by the bytes of the weights, not by arithmetic: 4-bit weights (the format of
`int4_format.py`) read a quarter of bf16's bytes, and this kernel reads each byte once and unpacks
it in registers. `int4_format.int4_matmul_reference` is its meaning; tests/test_triton_kernels.py
compares the two under TRITON_INTERPRET=1, so machines without a GPU check it too.

Layout of the work: one program per block of BLOCK_N output columns and BLOCK_M (16) rows, so a
verify pass of up to 16 rows reads each weight byte exactly once. The program walks K one quant
group at a time: the group's bytes split into the codes of the even and of the odd columns of K
(low and high nibbles), so no interleaving is needed, and per group

    x_g @ (q_g * scale_g + min_g).T = scale_g * (x_g @ q_g.T) + min_g * sum(x_g)

puts the integer codes straight into the dot and applies the scale and the minimum once per group.
"""

from __future__ import annotations

import torch

from .int4_format import check_group_layout

from .triton_support import tl, triton, triton_jit

BLOCK_M = 16
"""Rows per program: a whole verify pass (tl.dot needs at least 16; fewer rows are masked)."""

BLOCK_N = 32
"""Output columns per program: small, so that even a 1536-wide layer spreads over 48 programs."""


@triton_jit
def _int4_matmul_kernel(
    x_ptr, packed_ptr, scales_ptr, mins_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_pn, stride_sn, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    HALF: tl.constexpr = GROUP // 2  # bytes per group and row of the weight
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    pairs = tl.arange(0, HALF)  # (HALF,) byte j of a group holds K columns 2j and 2j + 1
    row_ok = rows < M
    col_ok = cols < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP):
        even_ptrs = x_ptr + rows[:, None] * stride_xm + (g * GROUP + 2 * pairs)[None, :] * stride_xk
        x_even = tl.load(even_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)  # (BLOCK_M, HALF)
        x_odd = tl.load(even_ptrs + stride_xk, mask=row_ok[:, None], other=0.0).to(tl.float32)  # (BLOCK_M, HALF)

        byte_ptrs = packed_ptr + cols[:, None] * stride_pn + (g * HALF + pairs)[None, :]
        byte = tl.load(byte_ptrs, mask=col_ok[:, None], other=0)  # (BLOCK_N, HALF) uint8
        q_even = (byte & 0xF).to(tl.float32)  # (BLOCK_N, HALF)
        q_odd = (byte >> 4).to(tl.float32)  # (BLOCK_N, HALF)

        # fp16/bf16 activations and the codes 0..15 are exact in tf32, so the tensor cores' tf32
        # products are exact; fp32 activations would be truncated and take the "ieee" path
        codes = tl.dot(x_even, tl.trans(q_even), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        codes = tl.dot(x_odd, tl.trans(q_odd), acc=codes, input_precision=DOT_PRECISION)

        scale = tl.load(scales_ptr + cols * stride_sn + g, mask=col_ok, other=0.0)  # (BLOCK_N,)
        low = tl.load(mins_ptr + cols * stride_sn + g, mask=col_ok, other=0.0)  # (BLOCK_N,)
        x_sum = tl.sum(x_even + x_odd, axis=1)  # (BLOCK_M,)
        acc += codes * scale[None, :] + x_sum[:, None] * low[None, :]

    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x (M, K) fp16/bf16/fp32 @ W.T -> (M, N) in x.dtype; W in the int4_format layout.

    Meant for the few rows of a verify pass (M <= 16 is one program per column block); more rows
    work, in blocks of 16. Tensors on a CUDA device, or on the CPU under TRITON_INTERPRET=1.
    """
    if triton is None:
        raise RuntimeError("int4_matmul needs triton (pip install 'triton>=3.0')")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    m, k = x.shape
    n = packed.shape[0]
    check_group_layout(k, group_size)
    # tl.arange needs a power of two, and tl.dot at least 16 along K (half a group per dot)
    if group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"the Triton kernel needs group_size a power of two >= 32, got {group_size}")
    groups = k // group_size
    if packed.shape != (n, k // 2) or scales.shape != (n, groups) or mins.shape != (n, groups):
        raise ValueError(
            f"for x (M, {k}) expected packed ({n}, {k // 2}), scales and mins ({n}, {groups}); got "
            f"{tuple(packed.shape)}, {tuple(scales.shape)}, {tuple(mins.shape)}"
        )
    packed = packed.contiguous()  # (N, K // 2) uint8
    scales = scales.float().contiguous()  # (N, G)
    mins = mins.float().contiguous()  # (N, G), same strides as scales
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)  # (M, N)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
    _int4_matmul_kernel[grid](
        x, packed, scales, mins, out,
        m, n, k,
        x.stride(0), x.stride(1), packed.stride(0), scales.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return out
