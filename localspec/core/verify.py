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

from localspec.base.config import SamplingConfig
from localspec.core.sampling import probs_from_logits
from localspec.core.tree import Draft
from localspec.kernels import rejection_rule
from localspec.kernels.rejection_rule import children_table
from localspec.kernels.triton_sampling import rejection_sample
from localspec.kernels.triton_support import triton_available


@dataclass
class Verdict:
    accepted: list[int]
    """Node indices of the accepted path, the root's child first."""
    next_token: int
    """The recovered token (after a rejection) or the bonus token (whole path accepted)."""


def verify_greedy(draft: Draft, target_logits: torch.Tensor) -> Verdict:
    """target_logits: (N+1, V), row 0 after the root, row i+1 after node i."""
    best = target_logits.argmax(dim=-1).tolist()  # (N+1,): the pass's one read
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


def draft_probs(draft: Draft, vocab: int, device: torch.device) -> torch.Tensor | None:
    """(N, V) on `device`: each node's q, a one-hot row for a fixed guess (the rule treats both
    alike: accept with min(1, p(x) / 1), residual max(0, p - one-hot) = p without x); None when
    every node is a fixed guess."""
    if all(q is None for q in draft.probs):
        return None
    rows = torch.zeros(len(draft), vocab, device=device)  # (N, V)
    for i, (token, q) in enumerate(zip(draft.tokens, draft.probs)):
        if q is None:
            rows[i, token] = 1.0
        else:
            rows[i] = q
    return rows


def verify_sampling(
    draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator,
    fused: bool | None = None,
) -> Verdict:
    """Lossless rejection sampling over a chain or tree; target_logits as in verify_greedy.

    Probabilities and random numbers are made on the logits' device; the walk runs either in the
    fused kernel there (CUDA with Triton; `fused` forces it, e.g. under Triton's interpreter) or
    on the host after one read of everything it needs.
    """
    n = len(draft)
    device = target_logits.device
    target = probs_from_logits(target_logits, sampling)  # (N+1, V)
    uniforms = torch.rand(n + 1, generator=generator, device=device)  # (N+1,): one per node, then the final draw
    q = draft_probs(draft, target.shape[-1], device)  # (N, V) or None
    if fused is None:
        fused = device.type == "cuda" and triton_available()
    if fused:
        tokens, parents = torch.tensor(draft.tokens, dtype=torch.long), torch.tensor(draft.parents, dtype=torch.long)
        accepted, token = rejection_sample(target, tokens, parents, q, uniforms[:n], uniforms[n])  # one read
        return Verdict(accepted, token)
    parts = [target.flatten(), uniforms] + ([] if q is None else [q.flatten()])
    host = torch.cat(parts).numpy(force=True)  # the pass's one read: (N+1) x V probabilities, N+1 uniforms, q
    vocab = target.shape[-1]
    size = (n + 1) * vocab
    target_host = host[:size].reshape(n + 1, vocab)
    q_host = None if q is None else host[size + n + 1 :].reshape(n, vocab)
    accepted, token = rejection_rule.walk(target_host, draft.tokens, draft.parents, q_host, host[size : size + n + 1])
    return Verdict(accepted, token)


def verify(
    draft: Draft, target_logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator
) -> Verdict:
    if sampling.greedy:
        return verify_greedy(draft, target_logits)
    return verify_sampling(draft, target_logits, sampling, generator)
