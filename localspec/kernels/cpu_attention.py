"""Row-exact attention on x86 CPUs: every query row of a pass in one call, each computed alone.

Why: speculation needs a verify pass to give, row for row, the bits one-token decoding gives
(`localspec/attention.py` says why batched attention kernels do not). In torch that means a
loop over rows with the one-token step's shapes: ~8 small ops per row per layer, which for a
16-token pass of a 28-layer model is ~3,500 launches, and the grouped heads' keys and values
copied out for every layer. Here one call per layer computes every row, each by one thread with
the same sequence of operations whatever else is in the call (so rows stay exact by
construction), reading keys and values in place from the cache buffers.

Which slots a row sees: [0, prefix) (the past, and for a chain the new tokens up to itself) plus
a list of extra slots (a tree node's ancestors and itself, in cache order). Scores and the
weighted sum are float32; exp is a vectorized polynomial within 2 ulp of expf, so results agree
with the torch reference to float rounding, not bit for bit. AVX-512F CPUs take 16 lanes, AVX2
ones 8 (on a 2-core AVX2 VM the torch loop cost the 1.5B's one-token pass about 17 of its 108 ms);
a row's bits are the same on one machine whatever the pass, which is what exactness needs.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from localspec.kernels.cpu_build import KernelUnavailable, build

SOURCE = Path(__file__).with_name("cpu_attention.cpp")


@functools.cache
def load(cache_dir: Path) -> "AttentionKernel":
    """The compiled kernel; raises KernelUnavailable (one line) when it cannot be built or this
    CPU has neither AVX-512F nor AVX2 with FMA."""
    return AttentionKernel(build(SOURCE, cache_dir, "attention kernel"))


class AttentionKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        if not library.attention_supported():
            raise KernelUnavailable("this CPU has neither AVX-512F nor AVX2 with FMA for the attention kernel")
        self._run = library.row_attention
        self._run.restype = None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._run.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64,
                              ctypes.c_float, ptr]

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: "VisibleRows",
                 scale: float) -> torch.Tensor:
        """query (1, H, T, D), key/value (1, Hkv, S, D) float32 with contiguous D-rows (views of a
        cache buffer are fine) -> (1, T, H, D) float32."""
        _, heads, t, d = query.shape
        kv_heads = key.shape[1]
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if tensor.dtype != torch.float32 or tensor.stride(-1) != 1:
                raise ValueError(f"{name} must be float32 with contiguous features")
        if key.stride(2) != d or value.stride(2) != d:
            raise ValueError("key/value slots must be contiguous rows of D features")
        out = torch.empty(1, t, heads, d, dtype=torch.float32)  # (1, T, H, D)
        self._run(query.data_ptr(), t, heads, d, query.stride(2), query.stride(1),
                  key.data_ptr(), value.data_ptr(), kv_heads, key.stride(1), value.stride(1),
                  rows.prefix.data_ptr(), rows.extra.data_ptr(), rows.offset.data_ptr(), rows.count.data_ptr(),
                  rows.most_visible, scale, out.data_ptr())
        return out


class VisibleRows:
    """Per query row: the slots [0, prefix) and `count` extra slots from `extra[offset:]`, as int64
    tensors the kernel reads on the host."""

    def __init__(self, prefix: list[int], extras: list[list[int]]) -> None:
        offsets, flat = [], []
        for seen in extras:
            offsets.append(len(flat))
            flat.extend(seen)
        self.prefix = torch.tensor(prefix, dtype=torch.long)  # (T,)
        self.extra = torch.tensor(flat or [0], dtype=torch.long)  # (sum of counts,)
        self.offset = torch.tensor(offsets, dtype=torch.long)  # (T,)
        self.count = torch.tensor([len(seen) for seen in extras], dtype=torch.long)  # (T,)
        self.most_visible = max(p + len(e) for p, e in zip(prefix, extras))
        self._rows = (prefix, extras)

    @classmethod
    def causal(cls, t: int, s: int) -> "VisibleRows":
        """Row i of t new tokens at the end of s slots sees everything up to itself."""
        return cls([s - t + i + 1 for i in range(t)], [[] for _ in range(t)])

    def slots(self, i: int) -> list[int]:
        prefix, extras = self._rows
        return list(range(prefix[i])) + list(extras[i])


def row_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: VisibleRows,
                            scale: float) -> torch.Tensor:
    """The plain torch meaning: each row attends over its visible slots, in float32."""
    _, heads, t, d = query.shape
    group = heads // key.shape[1]
    out = torch.empty(1, t, heads, d, dtype=torch.float32)
    for i in range(t):
        slots = torch.tensor(rows.slots(i), dtype=torch.long)
        k = key[0].float().index_select(1, slots).repeat_interleave(group, dim=0)  # (H, S_i, D)
        v = value[0].float().index_select(1, slots).repeat_interleave(group, dim=0)
        scores = (query[0, :, i : i + 1].float() @ k.transpose(-1, -2)) * scale  # (H, 1, S_i)
        out[0, i] = (scores.softmax(dim=-1) @ v)[:, 0]  # (H, D)
    return out
