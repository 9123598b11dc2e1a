"""Exactness of the loop on tiny random models: greedy output, caches after rollback, stops."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import CharTokenizer, hf_greedy, tiny_model
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core.engine import Engine, StopScanner
from localspec.core.events import Piece
from localspec.core.proposers import DraftModelProposer, NgramProposer
from localspec.core.proposers.base import Proposer
from localspec.core.tree import Draft
from localspec.runtime.costs import CostModel

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 40, 41, 42, 5, 6, 7]


def run(engine: Engine, prompt, n: int, **kw) -> list[int]:
    return [p.token_id for ev in engine.generate(prompt, limits=GenerationLimits(n), **kw) for p in ev.pieces]


class RandomGuesser(Proposer):
    """Proposes the target's true greedy continuation with random corruptions, so every
    accept/reject pattern (all accepted, first rejected, rejected mid-way) occurs."""

    name = "random"

    def __init__(self, truth: list[int], prompt_len: int, seed: int = 0, tree: bool = False) -> None:
        self.truth, self.prompt_len, self.rng, self.tree = truth, prompt_len, random.Random(seed), tree

    def propose(self, tokens, max_len, sampling, generator):
        done = len(tokens) - self.prompt_len
        guess = list(self.truth[done : done + max_len])
        for i in range(len(guess)):
            if self.rng.random() < 0.3:
                guess[i] = self.rng.randrange(90)
        if not self.tree or not guess:
            return Draft.chain(guess)
        # a tree: a decoy sibling before the guess at every level, and a dangling decoy branch
        tokens_out, parents = [], []
        parent = -1
        for tok in guess:
            tokens_out.append((tok + 1) % 90)
            parents.append(parent)
            tokens_out.append(tok)
            parents.append(parent)
            parent = len(tokens_out) - 1
        tokens_out.append(3)
        parents.append(0)
        return Draft(tokens_out, parents)


@pytest.mark.parametrize("draft_len", [1, 3, 6])
def test_greedy_matches_transformers_every_proposer(arch, draft_len):
    target = tiny_model(arch, seed=0)
    other = tiny_model(arch, seed=1)
    expected = hf_greedy(target, PROMPT, 48)
    proposers = [None, NgramProposer(), DraftModelProposer(target), DraftModelProposer(other)]
    for proposer in proposers:
        engine = Engine(target, None, proposer, SpecConfig(draft_len=draft_len))
        assert run(engine, PROMPT, 48) == expected, proposer


LOOPING_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


@pytest.mark.parametrize("draft_len", [None, 3])
def test_model_proposers_carry_prompt_lookup_and_stay_exact(arch, draft_len):
    target = tiny_model(arch, seed=0)
    expected = hf_greedy(target, LOOPING_PROMPT, 48)
    costs = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 2.0}, draft_step_seconds=0.1)
    for lookup in (True, False):
        engine = Engine(target, None, DraftModelProposer(tiny_model(arch, seed=2)), SpecConfig(draft_len=draft_len, lookup=lookup), costs=costs)
        assert run(engine, LOOPING_PROMPT, 48) == expected
        # a random draft rarely agrees with the target; the target's own loops are what lookup finds
        assert (engine.stats.lookup_accepted > 0) == lookup


class FakeClock:
    """Seconds that pass only when a test says so (and a millisecond per reading), so that what
    the policy decides from measured times cannot depend on the machine's speed."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1e-3
        return self.now


def test_a_lookup_expected_to_pay_more_skips_the_model(arch):
    target = tiny_model(arch, seed=0)
    expected = hf_greedy(target, LOOPING_PROMPT, 40)
    calls = []
    clock = FakeClock()

    class SlowDraft(DraftModelProposer):
        def propose(self, tokens, *args, **kw):
            calls.append(len(tokens))
            clock.now += 0.05  # the model takes 50 ms a pass
            return super().propose(tokens, *args, **kw)

    # verify passes measured at a millisecond: a lookup guess alone beats a model taking 50 ms a pass
    fast_passes = CostModel({1: 1e-3, 2: 1.05e-3, 4: 1.1e-3, 8: 1.3e-3, 16: 2e-3}, draft_step_seconds=1e-4)
    engine = Engine(target, None, SlowDraft(tiny_model(arch, seed=2)), SpecConfig(), costs=fast_passes, clock=clock)
    engine.policy.guard = None  # against millisecond passes the slow model would pause speculation altogether
    assert run(engine, LOOPING_PROMPT, 40) == expected
    assert engine.stats.lookup_passes > 0
    assert len(calls) + engine.stats.lookup_passes >= engine.stats.passes - 1  # the last pass may have no room
    # passes measured at a second: the model's 50 ms pass always pays more, so it drafts every pass
    slow_passes = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 2.0}, draft_step_seconds=0.1)
    engine = Engine(target, None, SlowDraft(tiny_model(arch, seed=2)), SpecConfig(), costs=slow_passes, clock=clock)
    assert run(engine, LOOPING_PROMPT, 40) == expected
    assert engine.stats.lookup_passes == 0


def test_greedy_with_adaptive_draft_length(arch):
    target = tiny_model(arch, seed=0)
    expected = hf_greedy(target, PROMPT, 40)
    costs = CostModel({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.3, 16: 2.0}, draft_step_seconds=0.1)
    engine = Engine(target, None, DraftModelProposer(tiny_model(arch, seed=2)), SpecConfig(), costs=costs)
    assert run(engine, PROMPT, 40) == expected


@pytest.mark.parametrize("tree", [False, True])
def test_greedy_and_cache_exact_after_any_accept_reject_pattern(arch, tree):
    target = tiny_model(arch, seed=0)
    expected = hf_greedy(target, PROMPT, 60)
    for seed in range(3):
        proposer = RandomGuesser(expected, len(PROMPT), seed=seed, tree=tree)
        engine = Engine(target, None, proposer, SpecConfig(draft_len=4))
        out = run(engine, PROMPT, 60)
        assert out == expected
        assert engine.stats.accepted > 0 and engine.stats.accepted < engine.stats.drafted
        # the cache must equal a fresh prefill of the committed text: compare next-token logits
        committed = engine.kv_tokens.ids
        assert committed == (PROMPT + out)[: len(committed)]
        probe = torch.tensor([[(PROMPT + out)[len(committed)]]])
        with torch.no_grad():
            cached = target(probe, cache=engine.kv.cache, position_ids=torch.tensor([[len(committed)]])).logits[0, -1]
            fresh = target(torch.tensor([committed + probe[0].tolist()])).logits[0, -1]
        torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=1e-4)


def test_multi_turn_reuses_cache_and_stays_exact(arch):
    target = tiny_model(arch, seed=0)
    engine = Engine(target, None, NgramProposer(), SpecConfig(draft_len=3))
    first = run(engine, PROMPT, 20)
    follow_up = PROMPT + first + [30, 31, 32]
    assert run(engine, follow_up, 20) == hf_greedy(target, follow_up, 20)


def test_context_limit_stops_generation():
    target = tiny_model("llama", seed=0)
    engine = Engine(target, None, NgramProposer(), SpecConfig(draft_len=4), context_len=30)
    out = run(engine, PROMPT, 100)
    assert len(PROMPT) + len(out) == 30
    assert engine.stats.stop_reason == "context limit"


def test_prompt_filling_the_context_is_refused():
    engine = Engine(tiny_model("llama"), None, None, context_len=len(PROMPT))
    with pytest.raises(LocalspecError, match="context window is 18 tokens"):
        run(engine, PROMPT, 5)


def test_empty_prompt_is_refused():
    engine = Engine(tiny_model("llama"), CharTokenizer(), None)
    with pytest.raises(LocalspecError, match="empty"):
        run(engine, "   ", 5)


def test_eos_ends_the_answer():
    target = tiny_model("llama", seed=0)
    expected = hf_greedy(target, PROMPT, 30)
    tokenizer = CharTokenizer()
    tokenizer.eos_token_id = expected[7]  # make the 8th greedy token the end of the answer
    engine = Engine(target, tokenizer, NgramProposer(), SpecConfig(draft_len=4))
    out = run(engine, PROMPT, 30)
    assert out == expected[: expected.index(expected[7])]
    assert engine.stats.stop_reason == "eos"


def test_stop_string_cuts_text_and_holds_back_partial_matches():
    target = tiny_model("llama", seed=0)
    tokenizer = CharTokenizer()
    text = tokenizer.decode(hf_greedy(target, PROMPT, 40))
    stop = text[10:13]
    engine = Engine(target, tokenizer, DraftModelProposer(target), SpecConfig(draft_len=5))
    streamed = "".join(ev.text for ev in engine.generate(PROMPT, limits=GenerationLimits(40, (stop,))))
    assert streamed == text[: text.index(stop)]
    assert engine.stats.stop_reason == "stop string"


def test_stop_scanner_across_pieces():
    scanner = StopScanner(("END",))
    out = []
    for i, t in enumerate(["ab", "cE", "N", "Dxy"]):
        out += scanner.push(Piece(t, i, False))
        if scanner.stopped:
            break
    assert "".join(p.text for p in out) == "abc"
    scanner = StopScanner(("zz",))
    assert scanner.push(Piece("abz", 0, False)) == []  # its last character may start "zz"
    assert scanner.push(Piece("q", 1, False)) == [Piece("abz", 0, False)]
    assert scanner.flush() == [Piece("q", 1, False)]


def test_sampling_is_reproducible_with_a_seed():
    target = tiny_model("qwen2", seed=0)
    engine = Engine(target, None, DraftModelProposer(tiny_model("qwen2", seed=1)), SpecConfig(draft_len=3))
    sampling = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    assert run(engine, PROMPT, 20, sampling=sampling) == run(engine, PROMPT, 20, sampling=sampling)


def test_a_failing_proposer_falls_back_to_plain_decoding():
    class Broken(Proposer):
        name = "broken"

        def propose(self, *args):
            raise RuntimeError("boom")

    target = tiny_model("llama", seed=0)
    engine = Engine(target, None, Broken(), SpecConfig(draft_len=3))
    assert run(engine, PROMPT, 20) == hf_greedy(target, PROMPT, 20)
    assert any("proposer failed" in n for n in engine.stats.notices)


def test_every_target_pass_yields_an_event_even_while_text_is_held_back():
    """A consumer (the server on a disconnect) can stop between any two passes."""
    model, tokenizer = tiny_model("llama"), CharTokenizer()
    engine = Engine(model, tokenizer, None)
    stop = "".join(tokenizer.decode([t]) for t in hf_greedy(model, tokenizer.encode("abc"), 12)[3:9])  # never matches early
    events = list(engine.generate(tokenizer.encode("abc"), limits=GenerationLimits(12, stop=(stop + "~~~",))))
    assert len(events) == engine.stats.passes == 12
    assert any(not e.pieces for e in events), "the stop string held some passes' text back"
