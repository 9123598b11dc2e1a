"""The one shape every proposer has."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from localspec.base.config import SamplingConfig
from localspec.core.tree import Draft


class Proposer(ABC):
    name: str = "?"
    has_model: bool = False
    """True when drafting runs a model: each drafted token costs a step, so the engine decides the
    length before proposing. False for lookups: they guess as far as they can for free and the
    engine keeps the prefix that pays, by the acceptance seen for that kind of guess."""

    @abstractmethod
    def propose(
        self, tokens: list[int], max_len: int, sampling: SamplingConfig, generator: torch.Generator,
        worth: Callable[[list[float]], bool] | None = None,
    ) -> Draft:
        """Guess up to max_len tokens that follow `tokens` (every committed token so far).

        A model proposer calls `worth(confidences)` with its confidence in each guess so far (the
        newest last) before keeping the newest; False ends the draft there, so an unsure draft
        stops early instead of paying for guesses the target will likely reject.

        Proposers keep whatever state they like (a KV cache, an index) and resynchronise it with
        `tokens` themselves, so the engine never has to tell them what was accepted.
        """

    builds_trees: bool = False
    """True when the proposer shapes its own tree from measured costs: the engine then offers it
    every node that fits and leaves the size to it."""

    def observe(self, start: int, kept: list[int] | None) -> None:
        """Called after each target pass that wrote cache entries from position `start`; `kept`
        lists the pass's inputs now committed (None = all, a prefill). Proposers that read the
        target's hidden states (EAGLE) collect them here; others ignore it."""

    def judged(self, accepted: int) -> None:
        """Called after the target verified this proposer's latest draft: `accepted` of its own
        guesses were kept (the pass may also have carried prompt lookup's guesses)."""

    def close(self) -> None:
        """Release anything attached to the target (hooks)."""
