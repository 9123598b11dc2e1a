"""Draft trees: the shape every proposer returns, and what the target needs to verify one.

A draft is a tree of N candidate tokens hanging off the last committed token (the root, which is
not part of the draft). `parents[i]` is the index of node i's parent, or -1 when it hangs off the
root; parents always come before their children. A chain (one candidate per position) is the tree
with parents = [-1, 0, 1, ...]; it needs no special mask because it is plain causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    tokens: list[int]
    """Candidate token ids, one per node."""
    parents: list[int]
    """Parent node of each node, -1 for children of the root."""
    probs: list[torch.Tensor | None] = field(default_factory=list)
    """Per node, the (V,) distribution its token was sampled from, or None for a deterministic
    guess (treated as one-hot on the token). Empty list means all None."""
    label: str = ""
    """Which kind of guess this is (e.g. "ngram-3": a 3-token match); the engine keeps a separate
    acceptance estimate per label, because a long match is far more reliable than a short one."""
    confidences: list[float] = field(default_factory=list)
    """Per node, the proposer's own probability for its guess (model proposers; empty otherwise):
    the engine learns how often guesses of each confidence are accepted."""
    steps: int | None = None
    """Model steps spent drafting (a tree drafts a whole level per step); None = one per node."""
    history: bool = False
    """The guesses came from earlier conversations (the suffix proposer's index), not this one."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("a draft needs one parent per token")
        if any(not (-1 <= p < i) for i, p in enumerate(self.parents)):
            raise ValueError("each parent must come before its child")
        if not self.probs:
            self.probs = [None] * len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def chain(
        cls, tokens: list[int], probs: list[torch.Tensor | None] | None = None, label: str = "",
        confidences: list[float] | None = None,
    ) -> "Draft":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), list(probs or []), label, list(confidences or []))

    def first(self, n: int) -> "Draft":
        """The first n nodes: still a valid tree, since parents come before their children (a
        chain keeps its first n guesses)."""
        return Draft(self.tokens[:n], self.parents[:n], self.probs[:n], self.label, self.confidences[:n], self.steps,
                     self.history)

    def likeliest_chain(self) -> "Draft":
        """The chain of first-ranked children from the root down (a chain is its own)."""
        if self.is_chain:
            return self
        nodes, node = [], -1
        while (below := self.children(node)):
            node = below[0]
            nodes.append(node)
        return Draft([self.tokens[i] for i in nodes], list(range(-1, len(nodes) - 1)), [self.probs[i] for i in nodes],
                     self.label, [self.confidences[i] for i in nodes] if self.confidences else [], self.steps, self.history)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node; children of the root have depth 1."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return depth

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 for the root) in the order the proposer ranked them."""
        return [i for i, p in enumerate(self.parents) if p == node]


def path_probabilities(draft: Draft) -> list[float]:
    """Each node's probability of being reached, by the proposer's own confidences: the product
    along its path from the root."""
    reach: list[float] = []
    for confidence, parent in zip(draft.confidences, draft.parents):
        reach.append(confidence * (reach[parent] if parent >= 0 else 1.0))
    return reach


def visible_rows(draft: Draft) -> list[list[int]]:
    """Per row of the pass over root + draft, the rows it sees (root = 0, node i = i + 1),
    ascending: the root, the node's ancestors, itself."""
    rows = [[0]]
    for i, p in enumerate(draft.parents, start=1):
        rows.append([*rows[p + 1], i])
    return rows


def verify_inputs(draft: Draft, root_token: int, past_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token ids, position ids and attention mask for one target pass over root + draft.

    The root is the last committed token, not yet in the KV cache (it sits at position past_len).
    Returns ids (1, N+1), positions (1, N+1) and either None (chain: causal attention suffices) or
    a boolean mask (1, 1, N+1, past_len + N + 1) where each node sees the past, the root and its
    own ancestors.
    """
    n = len(draft)
    ids = torch.tensor([[root_token, *draft.tokens]], dtype=torch.long)  # (1, N+1)
    depth = torch.tensor([0, *draft.depths()], dtype=torch.long)
    positions = (past_len + depth).unsqueeze(0)  # (1, N+1)
    if draft.is_chain:
        return ids, positions, None
    mask = torch.zeros(n + 1, past_len + n + 1, dtype=torch.bool)
    mask[:, :past_len] = True
    for i, seen in enumerate(visible_rows(draft)):
        mask[i, [past_len + j for j in seen]] = True
    return ids, positions, mask[None, None]


def graft(draft: Draft, guess: list[int]) -> Draft:
    """`draft` plus a deterministic chain of guesses from the root: the chain follows the draft's
    nodes while the tokens agree and branches off where they differ. New nodes come last, so the
    acceptance rule tries the draft's own guesses first; either way the rule stays exact, because
    each guess is fixed before the target's pass is sampled."""
    shared = matched_path(draft, guess)
    if len(shared) == len(guess):
        return draft
    node = shared[-1] if shared else -1
    tokens, parents = list(draft.tokens), list(draft.parents)
    for token in guess[len(shared):]:
        tokens.append(token)
        parents.append(node)
        node = len(tokens) - 1
    probs = list(draft.probs) + [None] * (len(tokens) - len(draft))
    return Draft(tokens, parents, probs, draft.label, steps=draft.steps)


def matched_path(draft: Draft, tokens: list[int]) -> list[int]:
    """Nodes of `draft` that spell the longest prefix of `tokens`, from the root down: how many of
    a proposer's guesses a pass accepted when it verified them together with other guesses."""
    path: list[int] = []
    node = -1
    for token in tokens:
        node = next((c for c, p in enumerate(draft.parents) if p == node and draft.tokens[c] == token), None)
        if node is None:
            break
        path.append(node)
    return path
