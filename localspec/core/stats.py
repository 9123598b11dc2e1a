"""Counters for one generation and the figures derived from them.

A plain object, updated by the engine once per target pass; the CLI, the UI and the benchmark read
it. The formula speedup beside the measured one is the draft policy's (`policy.predicted_speedup`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from localspec.core.policy import predicted_speedup


@dataclass
class GenerationStats:
    proposer: str = "none"
    reason: str = ""
    prompt_tokens: int = 0
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
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    decode_seconds: float = 0.0
    """From the first emitted token to the last."""
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
