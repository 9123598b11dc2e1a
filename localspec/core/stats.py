"""Counters for one generation and the figures derived from them.

The engine counts a generation in a `GenerationStats` and hands its numbers out in its events:
each pass's event carries that pass's `PassFigures` (the first also the `Opening`), the last one
the finished `GenerationStats`. A consumer that needs the totals before the end (a live panel, an
answer stopped early) folds the figures with `GenerationStats.add`, which reaches what the engine
counted; no consumer reads the engine's attributes. The formula speedup beside the measured one is
the textbook one (`predicted_speedup`), which the draft policy shares.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def chain_tokens(acceptance: float, length: float) -> float:
    """`expected_tokens` of a chain whose guesses are each accepted with probability `acceptance`:
    1 + a + a^2 + ... + a^length, in closed form so that a mean length may be fractional."""
    a = min(max(acceptance, 0.0), 1.0)
    return length + 1.0 if a == 1.0 else (1.0 - a ** (length + 1)) / (1.0 - a)


def predicted_speedup(acceptance: float, draft_len: float, cost_ratio: float) -> float:
    """The expected rate over plain decoding's when a verify pass costs one plain pass at any
    width and a draft step costs `cost_ratio` of one (the textbook figure beside a measured one)."""
    return chain_tokens(acceptance, max(draft_len, 0.0)) / (1.0 + max(draft_len, 0.0) * cost_ratio)


@dataclass(frozen=True, slots=True)
class Opening:
    """What a generation starts from, known once its prompt is in the cache."""

    proposer: str
    reason: str
    prompt_tokens: int
    cached_tokens: int
    """Prompt tokens the cache already held from the previous generation, so were not prefilled."""
    prefill_seconds: float


@dataclass(frozen=True, slots=True)
class PassFigures:
    """One target pass's share of a generation's numbers."""

    drafted: int = 0
    accepted: int = 0
    lookup_accepted: int = 0
    """Of the accepted guesses, those only prompt lookup had made (beside a model proposer);
    the rest are the proposer's own."""
    lookup_passes: int = 0
    """1 when the pass verified prompt lookup's guess alone, without the model proposer."""
    history_passes: int = 0
    """1 when the pass verified guesses from earlier conversations (the suffix index)."""
    history_accepted: int = 0
    """Of the accepted guesses, those from earlier conversations; the rest came from this one or a model."""
    draft_steps: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    expected_verify_seconds: float = 0.0
    """What the calibrated costs said the verify pass would take."""
    tokens: int = 0
    """Tokens the pass added to the answer: accepted + 1, fewer where the answer stopped."""
    plain_seconds: float = 0.0
    """What plain decoding's passes would have cost for the pass's accepted + 1 tokens (calibrated)."""
    elapsed: float = 0.0
    """Seconds from the start of the generation (prefill included) to the end of this pass."""
    notices: tuple[str, ...] = ()
    """Notices the pass raised."""
    opening: Opening | None = None
    """On the first pass's figures only."""

    def since(self, before: PassFigures, **rest) -> PassFigures:
        """Counted totals less those `before` a pass: that pass's counters, with its other figures."""
        return PassFigures(
            self.drafted - before.drafted, self.accepted - before.accepted,
            self.lookup_accepted - before.lookup_accepted, self.lookup_passes - before.lookup_passes,
            self.history_passes - before.history_passes, self.history_accepted - before.history_accepted,
            self.draft_steps - before.draft_steps, self.draft_seconds - before.draft_seconds,
            self.verify_seconds - before.verify_seconds, self.expected_verify_seconds - before.expected_verify_seconds,
            **rest,
        )


@dataclass
class GenerationStats:
    proposer: str = "none"
    reason: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens the cache already held from the previous generation (not prefilled)."""
    new_tokens: int = 0
    passes: int = 0
    """Target forward passes after the prefill (each commits accepted + 1 tokens)."""
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    """drafted_at[i]: passes whose draft reached position i (0-based)."""
    accepted_at: list[int] = field(default_factory=list)
    """accepted_at[i]: passes whose draft was accepted up to and including position i."""
    accepted_hist: list[int] = field(default_factory=list)
    """Passes by how many drafted tokens they accepted (for a tree: the depth of the accepted path)."""
    draft_steps: int = 0
    """Draft model forward passes (0 for lookups)."""
    lookup_passes: int = 0
    """Passes that verified prompt lookup's guess alone, since it was expected to beat the model proposer."""
    lookup_accepted: int = 0
    """With a model proposer: accepted tokens that only prompt lookup had guessed."""
    history_passes: int = 0
    """Passes that verified guesses from earlier conversations (the suffix proposer's index)."""
    history_accepted: int = 0
    """Accepted tokens guessed from earlier conversations; the rest from this one or a model."""
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    expected_verify_seconds: float = 0.0
    """What the calibrated costs said those verify passes would take (a session compares the two
    to see a calibration go stale)."""
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    decode_seconds: float = 0.0
    """From the first emitted token to the last."""
    plain_seconds: float = 0.0
    """What plain decoding's passes would have cost for the tokens so far (calibrated)."""
    plain_token_seconds: float = 0.0
    """Calibrated cost of one plain one-token target pass, for the measured-speedup figure."""
    stop_reason: str = ""
    notices: list[str] = field(default_factory=list)
    """Things the user should know about this generation (speculation paused, a fallback, ...)."""

    def record_pass(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        self.passes += 1
        while len(self.accepted_hist) <= accepted:
            self.accepted_hist.append(0)
        self.accepted_hist[accepted] += 1
        self.drafted += drafted
        self.accepted += accepted
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def counted(self) -> PassFigures:
        """The counters the passes have added up so far, as figures (a pass's share is their
        difference across it)."""
        return PassFigures(self.drafted, self.accepted, self.lookup_accepted, self.lookup_passes,
                           self.history_passes, self.history_accepted, self.draft_steps, self.draft_seconds, self.verify_seconds,
                           self.expected_verify_seconds)

    def advance(self, figures: PassFigures) -> None:
        """The answer's side of a pass: its tokens, their plain-decoding cost and the clock."""
        if figures.tokens and not self.new_tokens:  # this pass gave the answer its first token
            self.ttft_seconds = figures.elapsed
        self.new_tokens += figures.tokens
        if self.new_tokens:
            self.decode_seconds = figures.elapsed - self.ttft_seconds
        if figures.plain_seconds:
            self.plain_seconds += figures.plain_seconds
            self.plain_token_seconds = self.plain_seconds / (self.passes + self.accepted)

    def add(self, figures: PassFigures) -> None:
        """Fold one pass's figures in, as the engine counted them."""
        if (opening := figures.opening) is not None:
            self.proposer, self.reason, self.prompt_tokens = opening.proposer, opening.reason, opening.prompt_tokens
            self.cached_tokens, self.prefill_seconds = opening.cached_tokens, opening.prefill_seconds
        self.record_pass(figures.drafted, figures.accepted, figures.draft_seconds, figures.verify_seconds)
        self.lookup_accepted += figures.lookup_accepted
        self.lookup_passes += figures.lookup_passes
        self.history_passes += figures.history_passes
        self.history_accepted += figures.history_accepted
        self.draft_steps += figures.draft_steps
        self.expected_verify_seconds += figures.expected_verify_seconds
        self.notices += figures.notices
        self.advance(figures)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def mean_tokens_per_pass(self) -> float:
        return (self.accepted + self.passes) / self.passes if self.passes else 0.0

    @property
    def mean_draft_len(self) -> float:
        return self.drafted / self.passes if self.passes else 0.0

    @property
    def cost_ratio(self) -> float:
        """c: time of one draft step over time of one target pass, as measured in this generation."""
        if not self.draft_steps or not self.passes or not self.verify_seconds:
            return 0.0
        return (self.draft_seconds / self.draft_steps) / (self.verify_seconds / self.passes)

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token's time belongs to TTFT; the rest were produced in decode_seconds
        return (self.new_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 and self.new_tokens > 1 else 0.0

    @property
    def predicted_speedup(self) -> float:
        return predicted_speedup(self.acceptance_rate, self.mean_draft_len, self.cost_ratio)

    @property
    def measured_speedup(self) -> float:
        tps = self.decode_tokens_per_second
        return tps * self.plain_token_seconds if self.plain_token_seconds > 0 else 0.0

    def summary(self) -> str:
        alone = f"{self.lookup_passes} pass{'' if self.lookup_passes == 1 else 'es'} alone"
        lookup = f", prompt lookup +{self.lookup_accepted} tokens ({alone})" if self.lookup_accepted or self.lookup_passes else ""
        if self.history_passes:
            lookup += f", history +{self.history_accepted} tokens ({self.history_passes} pass{'' if self.history_passes == 1 else 'es'})"
        return (
            f"[{self.proposer}] {self.new_tokens} tokens, {self.decode_tokens_per_second:.2f} tok/s, "
            f"TTFT {self.ttft_seconds * 1000:.0f} ms, acceptance {self.acceptance_rate:.0%}, "
            f"{self.mean_tokens_per_pass:.2f} tokens/pass, draft len {self.mean_draft_len:.1f}, "
            f"c {self.cost_ratio:.2f}, speedup {self.measured_speedup:.2f}x "
            f"(formula {self.predicted_speedup:.2f}x){lookup}, stop: {self.stop_reason}"
        )

    def to_dict(self) -> dict:
        return {
            "proposer": self.proposer,
            "reason": self.reason,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "passes": self.passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "accepted_length_histogram": self.accepted_hist,
            "mean_tokens_per_pass": self.mean_tokens_per_pass,
            "mean_draft_len": self.mean_draft_len,
            "draft_steps": self.draft_steps,
            "lookup_passes": self.lookup_passes,
            "lookup_accepted": self.lookup_accepted,
            "history_passes": self.history_passes,
            "history_accepted": self.history_accepted,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "cost_ratio_c": self.cost_ratio,
            "prefill_seconds": self.prefill_seconds,
            "ttft_seconds": self.ttft_seconds,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "predicted_speedup": self.predicted_speedup,
            "measured_speedup": self.measured_speedup,
            "stop_reason": self.stop_reason,
            "notices": self.notices,
        }
