"""A scripted engine for tests, snapshots and the tmux check: real TokenEvents (their figures, the
last one's GenerationStats), no torch, and a simulated clock so the statistics are the same on
every run. It keeps no statistics of its own to read: a consumer that looks anywhere but the
events fails."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator

from localspec.apps.tui.backend import ChatSettings, Loaded, memory_in_use
from localspec.base.config import GenerationLimits, SamplingConfig
from localspec.base.reasons import Reason
from localspec.core.events import FinalEvent, Piece, TokenEvent
from localspec.core.stats import GenerationStats, Opening, PassFigures
from localspec.store.registry import Registry, load_registry

ANSWER = """Here is a function that reverses a string:

```python
def reverse(text: str) -> str:
    return text[::-1]
```

It works because a slice with step `-1` walks the string backwards. For example,
`reverse("localspec")` returns `"cepslacol"`. Two notes:

- strings are immutable, so the slice builds a new one;
- it reverses code points, not grapheme clusters.
"""

PASS_SECONDS = 0.05
"""Simulated time of one target pass; a draft step costs a tenth of it."""


def words(text: str) -> list[str]:
    """The fake's tokens: each run of spaces goes with the word after it, newlines stand alone."""
    return re.findall(r"\n| *[^\s]+| +", text)


class FakeEngine:
    def __init__(self, proposer: str, reason: str, draft_len: int | None, delay: float) -> None:
        self.proposer = proposer
        self.reason = reason
        self.draft_len = 0 if proposer == "none" else (draft_len if draft_len is not None else 4)
        self.delay = delay

    def generate(
        self, prompt: list[dict], sampling: SamplingConfig = SamplingConfig(),
        limits: GenerationLimits = GenerationLimits(), system: str | None = None,
    ) -> Iterator[TokenEvent]:
        prompt_tokens = sum(len(words(m["content"])) for m in prompt)
        opening: Opening | None = Opening(self.proposer, self.reason, prompt_tokens, 0, 0.0)
        stats = GenerationStats()
        draft_seconds = self.draft_len * PASS_SECONDS / 10
        tokens = words(ANSWER)[: limits.max_new_tokens]
        produced = 0
        while produced < len(tokens):
            time.sleep(self.delay)
            # a fixed pattern of partial and full acceptances, so every statistic has something to show
            accepted = min((stats.passes * 3) % (self.draft_len + 1), len(tokens) - produced - 1)
            pieces = [
                Piece(text, produced + i, from_draft=i < accepted)
                for i, text in enumerate(tokens[produced : produced + accepted + 1])
            ]
            produced += len(pieces)
            # the first token after one pass; each later pass takes a pass and its draft steps
            elapsed = PASS_SECONDS + stats.passes * (PASS_SECONDS + draft_seconds)
            figures = PassFigures(self.draft_len, accepted, draft_seconds=draft_seconds, verify_seconds=PASS_SECONDS,
                                  tokens=len(pieces), plain_seconds=len(pieces) * PASS_SECONDS, elapsed=elapsed,
                                  opening=opening)
            opening = None
            stats.add(figures)
            if produced == len(tokens):
                stats.stop_reason = "eos" if produced == len(words(ANSWER)) else "max tokens"
                yield FinalEvent(pieces, figures, stats)
                return
            yield TokenEvent(pieces, figures)


class FakeBackend:
    def __init__(self, registry: Registry | None = None, delay: float = 0.0, memory: str | None = None) -> None:
        self.registry = registry or load_registry()
        self.delay = delay
        """Real seconds slept per pass: 0 in tests, visible streaming in the tmux check."""
        self.memory = memory
        """A fixed 'memory in use' text for snapshots (None measures this process)."""
        self.opened: list[ChatSettings] = []

    def open(self, settings: ChatSettings, status: Callable[[str], None]) -> Loaded:
        entry = self.registry.get(settings.model)
        status(f"loading {entry.name}")
        proposer = "ngram" if settings.spec.proposer == "auto" else settings.spec.proposer
        reason = f"{proposer} (fake engine for tests)"
        self.opened.append(settings)
        engine = FakeEngine(proposer, reason, settings.spec.draft_len, self.delay)
        memory = (lambda: self.memory) if self.memory else (lambda: memory_in_use("cpu"))
        weights = Reason("weights: float32, all a fake engine has, on cpu", "float32 · cpu")
        choice = Reason(f"{proposer} proposer: {reason}", f"{proposer} · fake engine")
        return Loaded(engine, entry.name, proposer, weights, choice, memory)
