"""The lossless acceptance rule, walked on the host, and the pieces every implementation shares:
the order in which a tree's candidates are tried and what the target still allows after a rejection.

localspec/verify.py runs `walk` after one read of the pass's probabilities from the device;
triton_sampling.py's kernel runs the same walk on the GPU and is tested against it (its reference
is `walk`). The random numbers come from the caller, one uniform per node and one for the final
draw, so that any two implementations can be compared draw for draw.
"""

from __future__ import annotations

import numpy as np

MIN_Q = 1e-20
"""Floor on q(x) in the acceptance ratio: a token drawn from q has q(x) > 0."""


def children_table(parents: list[int]) -> list[list[int]]:
    """children[node + 1] lists the children of node (-1 = root) in index order, the order the
    proposer ranked them and the rule tries them."""
    table: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        table[parent + 1].append(i)
    return table


def residual(p: np.ndarray, q: np.ndarray | None, token: int) -> np.ndarray:
    """What the target still allows after rejecting `token` drawn from q (None = one-hot)."""
    if q is None:
        rest = p.copy()
        rest[token] = 0.0
    else:
        rest = np.maximum(p - q, np.float32(0.0))
    total = rest.sum(dtype=np.float32)
    # p == q up to rounding: a rejection was (numerically) impossible, so p itself is the answer
    return rest / total if total > 0 else p


def inverse_cdf(p: np.ndarray, u: float) -> int:
    """The first token whose cumulative probability exceeds u * total (float32, in order)."""
    cdf = np.cumsum(p, dtype=np.float32)  # (V,)
    above = np.flatnonzero(cdf > np.float32(u) * cdf[-1])
    # rounding can leave u * total at the very top: then the last token p allows
    return int(above[0]) if len(above) else int(np.flatnonzero(p)[-1])


def walk(
    target_probs: np.ndarray, tokens: list[int], parents: list[int], draft_probs: np.ndarray | None,
    uniforms: np.ndarray,
) -> tuple[list[int], int]:
    """The rule on host arrays, float32 throughout.

    target_probs (N+1, V): row 0 after the root, row i+1 after node i. tokens, parents: per node,
    a parent before its children, -1 for the root's children. draft_probs (N, V), the q each node
    was drawn from (a one-hot row for a fixed guess), or None when every node is a fixed guess.
    uniforms (N+1,) in [0, 1): uniforms[i] decides node i, uniforms[N] draws the final token.
    Returns (accepted node indices, the recovered or bonus token).
    """
    children = children_table(parents)
    accepted: list[int] = []
    node = -1
    p = target_probs[0]  # (V,)
    while True:
        for child in children[node + 1]:
            x = tokens[child]
            q = None if draft_probs is None else draft_probs[child]  # (V,)
            accept_prob = p[x] if q is None else min(p[x] / max(q[x], np.float32(MIN_Q)), np.float32(1.0))
            if uniforms[child] < accept_prob:
                accepted.append(child)
                node = child
                p = target_probs[node + 1]
                break
            p = residual(p, q, x)
        else:
            return accepted, inverse_cdf(p, uniforms[len(tokens)])
