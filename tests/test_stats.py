"""The engine's events carry its numbers: folding the pass figures gives what it counted, and the
last event holds the finished statistics (a consumer needs nothing else)."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_model
from localspec.base.config import GenerationLimits, SpecConfig
from localspec.core.engine import Engine
from localspec.core.events import FinalEvent
from localspec.core.proposers import DraftModelProposer
from localspec.core.stats import GenerationStats
from localspec.runtime.costs import CostModel

LOOPING_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
COSTS = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 2.0}, draft_step_seconds=0.1)
SECONDS = ("prefill_seconds", "ttft_seconds", "decode_seconds", "draft_seconds", "verify_seconds",
           "expected_verify_seconds", "plain_seconds", "plain_token_seconds")


def model_engine() -> Engine:
    """A draft model with prompt lookup beside it, and costs: every kind of figure gets counted."""
    target = tiny_model("llama", seed=0)
    return Engine(target, None, DraftModelProposer(tiny_model("llama", seed=2)), SpecConfig(draft_len=3), costs=COSTS)


def assert_same(folded: GenerationStats, counted: GenerationStats) -> None:
    """Every counter equal; the seconds equal up to the rounding of summing a pass's share."""
    ours, theirs = dataclasses.asdict(folded), dataclasses.asdict(counted)
    for name in SECONDS:
        assert ours.pop(name) == pytest.approx(theirs.pop(name), rel=1e-9, abs=1e-12), name
    assert ours == theirs


def test_folded_pass_figures_are_the_final_statistics():
    engine = model_engine()
    events = list(engine.generate(LOOPING_PROMPT, limits=GenerationLimits(40)))
    *passes, last = events
    assert isinstance(last, FinalEvent) and not any(isinstance(e, FinalEvent) for e in passes)
    final = last.stats
    assert final is engine.stats and final.stop_reason == "max tokens" and final.new_tokens == 40
    assert final.lookup_accepted > 0 and final.draft_steps > 0  # the random draft's guesses rarely hold; lookup's do
    folded = GenerationStats()
    for event in events:
        folded.add(event.figures)
    folded.stop_reason = final.stop_reason  # the one figure only the end knows
    assert_same(folded, final)
    # per pass: the drafted and accepted (the proposer's and lookup's) sum to the totals
    figures = [e.figures for e in events]
    assert len(figures) == final.passes
    assert sum(f.drafted for f in figures) == final.drafted
    assert sum(f.accepted for f in figures) == final.accepted
    assert sum(f.lookup_accepted for f in figures) == final.lookup_accepted
    assert sum(f.tokens for f in figures) == final.new_tokens == sum(len(e.pieces) for e in events)
    assert all(f.tokens == f.accepted + 1 for f in figures[:-1])
    assert all(f.draft_seconds >= 0 and f.verify_seconds > 0 for f in figures)
    assert [f.opening is not None for f in figures] == [True] + [False] * (len(figures) - 1)


def test_an_answer_stopped_early_is_counted_from_its_events_alone():
    engine = model_engine()
    events = engine.generate(LOOPING_PROMPT, limits=GenerationLimits(40))
    folded = GenerationStats()
    for _, event in zip(range(3), events):
        folded.add(event.figures)
    events.close()
    assert folded.passes == 3 and folded.proposer == engine.proposer_name and folded.prompt_tokens == len(LOOPING_PROMPT)
    assert_same(folded, engine.stats)


def test_the_opening_says_how_much_of_the_prompt_the_cache_reused():
    engine = model_engine()
    first = list(engine.generate(LOOPING_PROMPT, limits=GenerationLimits(8)))
    assert first[0].figures.opening.cached_tokens == 0
    answer = [p.token_id for e in first for p in e.pieces]
    follow_up = LOOPING_PROMPT + answer + [7, 8]
    again = list(engine.generate(follow_up, limits=GenerationLimits(8)))
    opening = again[0].figures.opening
    # the cache holds the prompt and every answer token but the last (the next pass's root)
    assert opening.cached_tokens == len(LOOPING_PROMPT) + len(answer) - 1 == again[-1].stats.cached_tokens
    assert opening.prompt_tokens == len(follow_up) and opening.prefill_seconds == again[-1].stats.prefill_seconds
