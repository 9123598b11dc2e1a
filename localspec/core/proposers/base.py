"""The one shape every proposer has, and the questions a model proposer asks while it drafts.

Every draft size is decided by the draft policy (core/policy.py): a lookup guesses as far as it can
and the policy cuts the guess; a model proposer asks the policy, through `DraftRules`, before each
guess or tree level and for a tree's node count.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from localspec.base.config import SamplingConfig
from localspec.core.tree import Draft


class DraftRules(Protocol):
    """What a model proposer asks the draft policy while it drafts (`DraftPolicy` answers)."""

    def another_guess(self, confidences: list[float]) -> bool:
        """A chain: keep the newest guess? `confidences`: the model's in each guess, newest last."""

    def tree_nodes(self, probs: list[float], levels: int, limit: int) -> int:
        """A tree: how many candidates (path probabilities, most likely first) to verify."""

    def another_level(self, probs: list[float], nodes: int, frontier: list[float], levels: int, limit: int) -> bool:
        """A tree: draft one more level below the frontier (its path probabilities)?"""

    def timed_level(self, seconds: float) -> None:
        """A tree level took `seconds` to draft."""


class Proposer(ABC):
    name: str = "?"
    has_model: bool = False
    """True when drafting runs a model: each drafted token costs a step, so the policy decides the
    length before proposing. False for lookups: they guess as far as they can for free and the
    policy keeps the prefix that pays, by the acceptance seen for that kind of guess."""

    @abstractmethod
    def propose(
        self, tokens: list[int], max_len: int, sampling: SamplingConfig, generator: torch.Generator,
        rules: DraftRules | None = None,
    ) -> Draft:
        """Guess up to max_len tokens that follow `tokens` (every committed token so far).

        A model proposer asks `rules` before keeping each guess (a chain) or drafting each level
        (a tree), and how many of a tree's candidates to keep, so an unsure draft stops early
        instead of paying for guesses the target will likely reject; None: draft max_len.

        Proposers keep whatever state they like (a KV cache, an index) and resynchronise it with
        `tokens` themselves, so the engine never has to tell them what was accepted.
        """

    builds_trees: bool = False
    """True when the proposer drafts a tree: the policy then offers it every node that fits and
    sizes the tree through `rules`."""

    def observe(self, start: int, kept: list[int] | None) -> None:
        """Called after each target pass that wrote cache entries from position `start`; `kept`
        lists the pass's inputs now committed (None = all, a prefill). Proposers that read the
        target's hidden states (EAGLE) collect them here; others ignore it."""

    def finished(self, tokens: list[int]) -> None:
        """A generation ended: `tokens` are its prompt and its answer. Proposers that learn from
        earlier conversations (suffix decoding) keep them; others ignore it."""

    def close(self) -> None:
        """Release anything attached to the target (hooks)."""
