"""Attention that computes every query row exactly as a one-token decode step would.

Lossless speculation needs the verify pass over [root + draft] to give, row for row, the same
logits as decoding those tokens one at a time. The linear layers are row-independent, but
attention kernels are not: torch's SDPA takes another path for one query than for several (and
transformers packs grouped heads only for one), so in 16-bit arithmetic a verify pass and plain
decoding drift apart in the last bits, and sooner or later a near-tie flips the greedy token.

Here each query row attends to exactly the keys it may see, gathered in cache order (a tree node:
the past, then its ancestors, then itself; that is the same sequence of keys plain decoding has
after accepting that path), with the same operations and shapes as a single-token step, in
float32. Long passes (a prompt's prefill, the same in every mode) keep the fast kernel.

Why rows are not batched into one masked product: a row's float32 result depends on the shapes it
is computed in. Measured on this CPU (MKL, 1 and 2 threads), computing all rows of a pass in one
matmul with masked (-inf) scores differed in the last bits from the one-token step for every row
tried, and even products laid out so that rows are independent agree only when the key count is
the same, which a one-token step at an earlier position never has. So rows stay separate products
of the one-token step's shape; what they must not do is read anything back from the device: which
keys each row sees is planned on the host from the draft's shape (`RowPlan`), once per pass, and
the loop over rows only launches work. On an x86 CPU with AVX-512 a compiled kernel
(`localspec.kernels.cpu_attention`) computes every row of a pass in one call per layer, each row
alone and in the same way whatever the other rows are, reading keys and values in place; the
torch loop is its reference and the path elsewhere. On CUDA with Triton, one kernel
(`localspec.kernels.triton_row_attention`) computes every row of a pass per layer, reading where
each row stands from a `RowTable` on the device, so a CUDA graph can replay the pass
(localspec/graphs.py); each row is computed alone there too, the same way whatever the other rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from localspec.base.config import home_dir
from localspec.kernels.cpu_attention import AttentionKernel, VisibleRows, load as load_attention_kernel
from localspec.kernels.cpu_build import KernelUnavailable
from localspec.kernels.triton_row_attention import row_attention
from localspec.kernels.triton_support import triton_available

NAME = "localspec_exact"
ROW_BY_ROW_UP_TO = 128
"""Passes of at most this many new tokens (decode steps and verify passes) go row by row."""


@dataclass
class RowPlan:
    """Which cached keys each query row of a tree pass sees beyond the `past` entries all rows see.

    Worked out on the host from the draft's shape, so the attention reads nothing back from the
    device. Chains need no plan: row i sees a prefix, known from the shapes alone.
    """

    past: int
    slots: torch.Tensor | None
    """(sum of n_i,) the rows' visible slots >= past, row after row, on the model's device; None
    when every row sees a prefix."""
    spans: list[tuple[int, int, bool]]
    """Per row: (offset into slots, n_i, whether the slots are just past..past + n_i - 1)."""
    rows: list[list[int]]
    """Per row: the pass's rows it sees, ascending (the same plan for a `RowTable`)."""

    @classmethod
    def from_rows(cls, past: int, rows: list[list[int]], device: torch.device) -> RowPlan:
        """rows[i]: the slots row i sees beyond `past`, ascending, as offsets from `past`."""
        spans, flat = [], []
        for seen in rows:
            spans.append((len(flat), len(seen), seen == list(range(len(seen)))))
            flat.extend(past + s for s in seen)
        prefixes = all(prefix for _, _, prefix in spans)
        slots = None if prefixes else torch.tensor(flat, dtype=torch.long).to(device, non_blocking=True)
        return cls(past, slots, spans, rows)

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> RowPlan:
        """From a (T, S) mask (bool, True = may attend; or additive, 0 = may attend): one read of
        the mask per layer, for callers that pass a mask without a plan (not the engine)."""
        allowed = mask if mask.dtype == torch.bool else mask == 0
        rows = [[j for j, ok in enumerate(row) if ok] for row in allowed.tolist()]
        return cls.from_rows(0, rows, mask.device)

    @functools.cached_property
    def visible_rows(self) -> VisibleRows:
        """The same plan for the CPU kernel (host lists), made once per pass, not per layer."""
        flat = self.slots.tolist() if self.slots is not None else []
        prefixes = [self.past + n if prefix else self.past for _, n, prefix in self.spans]
        extras = [[] if prefix else flat[start : start + n] for start, n, prefix in self.spans]
        return VisibleRows(prefixes, extras)


class RowTable:
    """Where each row of a pass stands, as one int64 tensor on the model's device: the slot each row
    writes, and the keys it sees (the first `past` cache entries, then `seen[i, :count[i]]` after
    them). The Triton row attention and the cache writes read it there, so a captured CUDA graph
    replays a pass with new values copied in (localspec/graphs.py).
    Layout: [past | slots (T) | count (T) | seen (T x E)], E the longest row."""

    def __init__(self, packed: torch.Tensor, t: int) -> None:
        self.packed = packed
        self.past = packed[:1]  # (1,) cache entries every row sees
        self.slots = packed[1 : 1 + t]  # (T,) where row i's key and value go
        self.count = packed[1 + t : 1 + 2 * t]  # (T,) how many keys after `past` row i sees
        self.seen = packed[1 + 2 * t :].view(t, -1)  # (T, E) their offsets from past, ascending, zero-padded

    @staticmethod
    def pack(start: int, t: int, plan: RowPlan | None, width: int = 0) -> torch.Tensor:
        """The table on the host for a pass of `t` rows writing from slot `start`: a chain's (no
        plan: row i sees the cache and rows 0..i) or a tree's plan; `seen` padded to `width` if given."""
        past, rows = (start, _chain_rows(t)) if plan is None else (plan.past, plan.rows)
        width = width or max(map(len, rows))
        seen = [j for row in rows for j in row + [0] * (width - len(row))]
        return torch.tensor([past, *range(start, start + t), *map(len, rows), *seen], dtype=torch.long)

    @classmethod
    def build(cls, start: int, t: int, plan: RowPlan | None, device: torch.device) -> RowTable:
        return cls(cls.pack(start, t, plan).to(device, non_blocking=True), t)


@functools.lru_cache(maxsize=130)
def _chain_rows(t: int) -> list[list[int]]:
    return [list(range(i + 1)) for i in range(t)]


def rows_on_device(device: torch.device) -> bool:
    """Whether a pass's rows run as one Triton launch per layer reading a `RowTable` (CUDA with
    Triton); elsewhere the CPU kernel or the torch loop computes them."""
    return device.type == "cuda" and triton_available()


def table_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: RowTable,
                    scale: float) -> torch.Tensor:
    """query (1, H, T, D), key/value (1, Hkv, S, D) -> (1, T, H, D): the rows `table` describes."""
    return row_attention(query, key, value, table.past, table.count, table.seen, scale)


@functools.cache
def _cpu_kernel() -> AttentionKernel | None:
    """The compiled row attention (one call per layer for every row), or None where it cannot be
    built or run: the torch loop below computes the same rows then."""
    try:
        return load_attention_kernel(home_dir() / "kernels")
    except KernelUnavailable:
        return None


@functools.lru_cache(maxsize=4)
def _causal_rows(t: int, s: int) -> VisibleRows:
    return VisibleRows.causal(t, s)


def exact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, row_plan=None, **kwargs):
    """query (B, H, T, D), key/value (B, Hkv, S, D), attention_mask (B, 1, T, S) or None (causal),
    row_plan: the tree pass's `RowPlan` (else read from the mask) -> output (B, T, H, D), no weights."""
    b, heads, t, d = query.shape
    if t > ROW_BY_ROW_UP_TO or b != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    s = key.shape[2]
    if row_plan is None and attention_mask is not None:
        row_plan = RowPlan.from_mask(attention_mask[0, 0])
    scale = scaling if scaling is not None else d**-0.5
    if rows_on_device(query.device):
        return table_attention(query, key, value, RowTable.build(s - t, t, row_plan, query.device), scale), None
    kernel = _cpu_kernel() if query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32 else None
    if kernel is not None and key.stride(2) == d and value.stride(2) == d and key.stride(3) == value.stride(3) == 1:
        rows = _causal_rows(t, s) if row_plan is None else row_plan.visible_rows
        return kernel(query, key, value, rows, scale), None  # (1, T, H, D)
    groups = heads // key.shape[1]
    keys = key.float().repeat_interleave(groups, dim=1)  # (1, H, S, D)
    values = value.float().repeat_interleave(groups, dim=1)
    rows = []
    for i in range(t):
        if row_plan is None:  # causal: the past and the new tokens up to this one
            k, v = keys[:, :, : s - t + i + 1], values[:, :, : s - t + i + 1]  # (1, H, S_i, D)
        else:
            start, n, prefix = row_plan.spans[i]
            if prefix:
                k, v = keys[:, :, : row_plan.past + n], values[:, :, : row_plan.past + n]
            else:
                slots = row_plan.slots[start : start + n]  # (n_i,)
                k = torch.cat([keys[:, :, : row_plan.past], keys.index_select(2, slots)], dim=2)  # (1, H, S_i, D)
                v = torch.cat([values[:, :, : row_plan.past], values.index_select(2, slots)], dim=2)
        scores = torch.matmul(query[:, :, i : i + 1].float(), k.transpose(-1, -2)) * scale  # (1, H, 1, S_i)
        rows.append(torch.matmul(scores.softmax(dim=-1), v))  # (1, H, 1, D)
    out = torch.cat(rows, dim=2).to(query.dtype)  # (1, H, T, D)
    return out.transpose(1, 2).contiguous(), None


def causal_mask(*args, **kwargs) -> torch.Tensor | None:
    """The mask transformers builds for a pass without one of its own: none for a pass the rows
    handle (they know causality from the shapes, and reading a mask back would cost a sync per
    layer), transformers' own for what goes to SDPA or carries padding."""
    q_length, batch_size = kwargs.get("q_length"), kwargs.get("batch_size")
    if kwargs.get("attention_mask") is None and batch_size == 1 and q_length is not None and q_length <= ROW_BY_ROW_UP_TO:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, exact_attention)
AttentionMaskInterface.register(NAME, causal_mask)


def use_exact_attention(model: torch.nn.Module) -> None:
    """Make the target's attention row-exact (idempotent)."""
    if getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)
