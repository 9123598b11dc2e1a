"""The two pieces of the lossless acceptance rule that every implementation shares: the order in
which a tree's candidates are tried, and what the target still allows after a rejection.

localspec/verify.py (the engine's rule) and triton_sampling.py's reference both use these, so the
fused kernel is tested against exactly the rule the engine runs.
"""

from __future__ import annotations

import torch


def children_table(parents: list[int]) -> list[list[int]]:
    """children[node + 1] lists the children of node (-1 = root) in index order, the order the
    proposer ranked them and the rule tries them."""
    table: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        table[parent + 1].append(i)
    return table


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """What the target still allows after rejecting `token` drawn from q (None = one-hot)."""
    if q is None:
        rest = p.clone()
        rest[token] = 0.0
    else:
        rest = (p - q).clamp_min(0.0)
    total = rest.sum()
    # p == q up to rounding: a rejection was (numerically) impossible, so p itself is the answer
    return rest / total if total > 0 else p
