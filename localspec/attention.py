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
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "localspec_exact"
ROW_BY_ROW_UP_TO = 128
"""Passes of at most this many new tokens (decode steps and verify passes) go row by row."""


def exact_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query (B, H, T, D), key/value (B, Hkv, S, D), attention_mask (B, 1, T, S) bool (True =
    may attend) or None (causal) -> output (B, T, H, D), no weights."""
    b, heads, t, d = query.shape
    if t > ROW_BY_ROW_UP_TO or b != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    s = key.shape[2]
    groups = heads // key.shape[1]
    keys = key.float().repeat_interleave(groups, dim=1)  # (1, H, S, D)
    values = value.float().repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else d**-0.5
    rows = []
    for i in range(t):
        if attention_mask is None:
            visible = None
            end = s - t + i + 1  # causal: the past and the new tokens up to this one
        else:
            allowed = attention_mask[0, 0, i]
            if allowed.dtype != torch.bool:
                allowed = allowed == 0  # an additive mask: 0 where attending
            index = allowed.nonzero().flatten()  # (S_i,)
            end = int(index[-1]) + 1
            visible = None if len(index) == end else index  # a prefix needs no gather
        k = keys[:, :, :end] if visible is None else keys.index_select(2, visible)  # (1, H, S_i, D)
        v = values[:, :, :end] if visible is None else values.index_select(2, visible)
        scores = torch.matmul(query[:, :, i : i + 1].float(), k.transpose(-1, -2)) * scale  # (1, H, 1, S_i)
        rows.append(torch.matmul(scores.softmax(dim=-1), v))  # (1, H, 1, D)
    out = torch.cat(rows, dim=2).to(query.dtype)  # (1, H, T, D)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, exact_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_exact_attention(model: torch.nn.Module) -> None:
    """Make the target's attention row-exact (idempotent)."""
    if getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)
