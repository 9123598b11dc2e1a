"""Row-exact attention for every row of a pass in one Triton launch, with where each row stands
read from the device (GPU).

A row of a decode or verify pass must come out bit for bit as the same token's one-token step
would (localspec/attention.py says why). Here one program computes one (row, head): it attends to
the keys the row sees, in cache order (the `past` entries every row sees, then the pass's own rows
listed in `seen`, ascending), walking them in blocks of BLOCK_N with an online softmax in float32.
The blocks are cut along that sequence of visible keys, not along cache slots, so the arithmetic
depends only on the row's own keys: a tree node verified among 64 rows, with its ancestors at
scattered slots, does exactly what its one-token step does once the path is committed and
compacted (the same keys, at consecutive slots). Nothing depends on the other rows, the width of
the pass or the cache's capacity.

`past`, `count` and `seen` are device tensors and the loop runs to each row's own length, so the
launch has no host values but the shapes: a CUDA graph captured once replays it for any context
(localspec/graphs.py). `row_attention_reference` is its meaning in plain torch;
tests/test_triton_kernels.py compares the two under TRITON_INTERPRET=1 and checks that a row gives
the same bits alone and in a pass.
"""

from __future__ import annotations

import torch

from .triton_support import tl, triton, triton_available

BLOCK_N = 32
"""Visible keys per step of a program's loop."""


def _jit(fn):
    # stride_seen (the longest row of the pass) only addresses the `seen` table; not specialising
    # on it keeps one compiled kernel for a one-token step (where it is 1) and for a wide pass
    return fn if triton is None else triton.jit(fn, do_not_specialize=["stride_seen"])


@_jit
def _row_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,  # query (1, H, T, D), keys/values (1, Hkv, S, D), out (1, T, H, D)
    past_ptr, count_ptr, seen_ptr,  # (1,), (T,), (T, E) int64
    stride_seen, scale,
    stride_qh, stride_qt, stride_qd,
    stride_kh, stride_ks, stride_kd,
    stride_vh, stride_vs, stride_vd,
    stride_ot, stride_oh,
    D: tl.constexpr, GROUPS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUPS
    dims = tl.arange(0, BLOCK_D)  # (BLOCK_D,)
    dim_ok = dims < D
    q = tl.load(q_ptr + head * stride_qh + row * stride_qt + dims * stride_qd, mask=dim_ok, other=0.0).to(tl.float32)
    past = tl.load(past_ptr)
    length = past + tl.load(count_ptr + row)  # keys this row sees
    best = float("-inf")  # running maximum of the scores
    total = 0.0  # running sum of exp(score - best)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)  # running sum of exp(score - best) * value
    for start in range(0, length, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) indices into the row's visible keys
        ok = n < length
        own = n >= past  # one of the pass's rows: its slot comes from the table
        j = tl.load(seen_ptr + row * stride_seen + (n - past), mask=ok & own, other=0)
        slot = tl.where(own, past + j, n)  # (BLOCK_N,)
        tile = ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_head * stride_kh + slot[:, None] * stride_ks + dims[None, :] * stride_kd,
                    mask=tile, other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_D)
        scores = tl.where(ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))  # (BLOCK_N,)
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        weights = tl.exp(scores - new_best)  # (BLOCK_N,)
        rescale = tl.exp(best - new_best)
        v = tl.load(v_ptr + kv_head * stride_vh + slot[:, None] * stride_vs + dims[None, :] * stride_vd,
                    mask=tile, other=0.0).to(tl.float32)  # (BLOCK_N, BLOCK_D)
        total = total * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        best = new_best
    out = acc / total
    tl.store(out_ptr + row * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: torch.Tensor,
                  count: torch.Tensor, seen: torch.Tensor, scale: float) -> torch.Tensor:
    """query (1, H, T, D), key/value (1, Hkv, S, D) (any S: a whole cache buffer), past (1,),
    count (T,) and seen (T, E) int64 on the same device -> out (1, T, H, D) in query's dtype.

    Row i sees keys 0 .. past - 1 and past + seen[i, :count[i]] (ascending)."""
    if not triton_available():
        raise RuntimeError("row_attention needs triton (pip install triton)")
    _, heads, t, d = query.shape
    out = torch.empty(1, t, heads, d, dtype=query.dtype, device=query.device)
    _row_attention_kernel[(t, heads)](
        query, key, value, out, past, count, seen, seen.stride(0), scale,
        *query.stride()[1:], *key.stride()[1:], *value.stride()[1:], out.stride(1), out.stride(2),
        D=d, GROUPS=heads // key.shape[1], BLOCK_D=triton.next_power_of_2(d), BLOCK_N=BLOCK_N,
    )
    return out


def row_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, past: torch.Tensor,
                            count: torch.Tensor, seen: torch.Tensor, scale: float) -> torch.Tensor:
    """`row_attention`'s meaning: each row's visible keys gathered, softmax in float32."""
    groups = query.shape[1] // key.shape[1]
    first = int(past)
    rows = []
    for i in range(query.shape[2]):
        slots = torch.cat([torch.arange(first), first + seen[i, : int(count[i])].cpu()]).to(key.device)  # (L_i,)
        k = key[0][:, slots].float().repeat_interleave(groups, dim=0)  # (H, L_i, D)
        v = value[0][:, slots].float().repeat_interleave(groups, dim=0)
        weights = (query[0, :, i : i + 1].float() @ k.transpose(1, 2) * scale).softmax(dim=-1)  # (H, 1, L_i)
        rows.append(weights @ v)  # (H, 1, D)
    return torch.cat(rows, dim=1).transpose(0, 1)[None].to(query.dtype)  # (1, T, H, D)
