"""Exact acceptance rules: which drafted tokens the target keeps, and the token it adds.

Glossary (as in the speculative-decoding papers):
- accepted: drafted tokens the target agrees with; they are committed as if the target had made them.
- recovered: on the first rejection, the token sampled from what the target still allows there.
- bonus: when a whole path is accepted, the target's own next token, which came free with the pass.

T = 0: a node is accepted when it equals the target's argmax, so the output is the target's own
greedy sequence. T > 0: a node drawn from q is accepted with probability min(1, p(x)/q(x)); on
rejection p becomes normalize(max(0, p - q)) and the next sibling is tried (one-hot q for
deterministic guesses: accept with p(x), else p(x) = 0). When no child is left the recovered token
is drawn from p. This keeps the output distributed exactly as the target's (Leviathan et al. 2023;
Chen et al. 2023; the multi-candidate form as in SpecInfer / EAGLE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localspec.config import SamplingConfig
from localspec.sampling import probs_from_logits, sample
from localspec.tree import Draft
from localspec_kernels.rejection_rule import children_table
from localspec_kernels.rejection_rule import residual as _residual  # a module global: tests swap in a wrong rule


@dataclass
class Verdict:
    accepted: list[int]
    """Node indices of the accepted path, the root's child first."""
    next_token: int
    """The recovered token (after a rejection) or the bonus token (whole path accepted)."""


def verify_greedy(draft: Draft, target_logits: torch.Tensor) -> Verdict:
    """target_logits: (N+1, V), row 0 after the root, row i+1 after node i."""
    best = target_logits.argmax(dim=-1).tolist()  # (N+1,)
    children = children_table(draft.parents)
    accepted: list[int] = []
    node = -1
    while True:
        want = best[node + 1]
        match = next((c for c in children[node + 1] if draft.tokens[c] == want), None)
        if match is None:
            return Verdict(accepted, want)
        accepted.append(match)
        node = match


def verify_sampling(
    draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> Verdict:
    """Lossless rejection sampling over a chain or tree; target_logits as in verify_greedy."""
    target_probs = probs_from_logits(target_logits, sampling)  # (N+1, V)
    children = children_table(draft.parents)
    accepted: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1]
        for child in children[node + 1]:
            x, q = draft.tokens[child], draft.probs[child]
            px = float(p[x])
            accept_prob = px if q is None else min(1.0, px / max(float(q[x]), 1e-20))
            if torch.rand((), generator=generator).item() < accept_prob:
                accepted.append(child)
                node = child
                break
            p = _residual(p, q, x)
        else:
            return Verdict(accepted, sample(p, generator))


def verify(
    draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> Verdict:
    if sampling.greedy:
        return verify_greedy(draft, target_logits)
    return verify_sampling(draft, target_logits, sampling, generator)
