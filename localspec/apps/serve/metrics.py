"""What generations measured: one generation's `timings` (llama-server's names, plus speculation's
own) and the Prometheus counters `/metrics` shows, both read from the same `GenerationStats`, so a
response's figures and the totals always agree."""

from __future__ import annotations

import threading

from localspec.core.stats import GenerationStats


def timings(stats: GenerationStats) -> dict:
    """llama-server's `timings` names, plus what speculation adds."""
    fresh = stats.prompt_tokens - stats.cached_tokens
    return {
        "prompt_n": stats.prompt_tokens,
        "cache_n": stats.cached_tokens,
        "prompt_ms": stats.prefill_seconds * 1e3,
        "prompt_per_second": fresh / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0,
        "ttft_ms": stats.ttft_seconds * 1e3,
        "predicted_n": stats.new_tokens,
        "predicted_ms": stats.decode_seconds * 1e3,
        "predicted_per_second": stats.decode_tokens_per_second,
        "passes": stats.passes,
        "tokens_per_pass": stats.mean_tokens_per_pass,
        "drafts": stats.drafted_at[0] if stats.drafted_at else 0,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "accepted_at_position": list(stats.accepted_at),
        "history_passes": stats.history_passes,
        "history_n_accepted": stats.history_accepted,
        "proposer": stats.proposer,
    }


COUNTERS = (
    # (name, help, key in timings)
    ("prompt_tokens_total", "Prompt tokens received.", "prompt_n"),
    ("prompt_cached_tokens_total", "Prompt tokens found in the cache from an earlier request (not prefilled again).", "cache_n"),
    ("generated_tokens_total", "Tokens generated.", "predicted_n"),
    ("passes_total", "Target forward passes after the prefill.", "passes"),
    ("drafts_total", "Passes that verified a draft.", "drafts"),
    ("drafted_tokens_total", "Tokens proposed for verification.", "draft_n"),
    ("accepted_tokens_total", "Proposed tokens the target accepted.", "draft_n_accepted"),
    ("history_passes_total", "Passes that verified suffix decoding's guesses from earlier conversations.", "history_passes"),
    ("history_accepted_tokens_total", "Accepted tokens guessed from earlier conversations (suffix decoding).",
     "history_n_accepted"),
)


class Metrics:
    """Counters since start; each generation adds its final statistics (the ones its response's
    `timings` shows). Written on the engine thread, read on the event loop: a lock keeps reads whole."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals = {name: 0 for name, _, _ in COUNTERS}
        self.accepted_at: list[int] = []
        self.drafted_at: list[int] = []
        self.seconds = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}
        self.finished: dict[str, int] = {}
        self.rejected = 0

    def record(self, stats: GenerationStats, finish: str) -> None:
        figures = timings(stats)
        with self.lock:
            for name, _, key in COUNTERS:
                self.totals[name] += figures[key]
            for mine, theirs in ((self.accepted_at, stats.accepted_at), (self.drafted_at, stats.drafted_at)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, n in enumerate(theirs):
                    mine[i] += n
            self.seconds["prefill"] += stats.prefill_seconds
            self.seconds["draft"] += stats.draft_seconds
            self.seconds["verify"] += stats.verify_seconds
            self.finished[finish] = self.finished.get(finish, 0) + 1

    def render(self, waiting: int, busy: bool) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP localspec_{name} {help_}", f"# TYPE localspec_{name} {kind}"])
            lines.extend(f"localspec_{name}{labels} {value}" for labels, value in samples)

        with self.lock:
            metric("generations_total", "counter", "Generations by how they ended (stop, length, cancelled, error).",
                   [(f'{{finish="{k}"}}', v) for k, v in sorted(self.finished.items())])
            metric("rejected_requests_total", "counter", "Requests refused with 429 because the queue was full.", [("", self.rejected)])
            for name, help_, _ in COUNTERS:
                metric(name, "counter", help_, [("", self.totals[name])])
            metric("drafted_at_position_total", "counter", "Drafts that reached each position (0-based).",
                   [(f'{{position="{i}"}}', n) for i, n in enumerate(self.drafted_at)])
            metric("accepted_at_position_total", "counter", "Drafts accepted up to and including each position.",
                   [(f'{{position="{i}"}}', n) for i, n in enumerate(self.accepted_at)])
            for part, help_ in (("prefill", "Prompt prefill time."), ("draft", "Time spent drafting."),
                                ("verify", "Time in target verify passes.")):
                metric(f"{part}_seconds_total", "counter", help_, [("", float(self.seconds[part]))])
        metric("queue_waiting", "gauge", "Requests waiting for the engine.", [("", waiting)])
        metric("busy", "gauge", "1 while a generation runs.", [("", int(busy))])
        return "\n".join(lines) + "\n"
