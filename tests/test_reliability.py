"""Faults and bad input never lose the stream: interrupted passes, out of memory, a broken or
useless proposer, an incompatible draft, and property tests of verification and rollback."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import hf_greedy, tiny_model
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core.engine import Engine
from localspec.core.policy import SpeedGuard
from localspec.core.proposers import DraftModelProposer, NgramProposer
from localspec.core.proposers.base import Proposer
from localspec.core.tree import Draft, graft, matched_path, verify_inputs
from localspec.core.verify import verify_greedy
from localspec.runtime.costs import CostModel
from localspec.runtime.kv import KVCache
from localspec.store import session as session_module

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 40, 41, 42, 5, 6, 7]


def tokens_of(engine: Engine, prompt, n: int) -> list[int]:
    return [p.token_id for ev in engine.generate(prompt, limits=GenerationLimits(n)) for p in ev.pieces]


class FailingForward:
    """Wraps a model: raises `error` on the `at`-th call (after letting the first layers run, so the
    cache is left half-updated, as a real Ctrl-C or out-of-memory would)."""

    def __init__(self, model, error, at: int, wide_only: bool = False) -> None:
        self.model, self.error, self.at, self.wide_only, self.calls = model, error, at, wide_only, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, **kw):
        self.calls += 1
        wide = kw["input_ids"].shape[1] > 1
        if self.calls == self.at or (self.wide_only and wide and self.calls >= self.at):
            cache = kw["cache"]
            first = cache.layers[0] if cache.layers else None
            if first is not None and getattr(first, "keys", None) is not None:
                # the first layer has taken the new positions, the rest have not
                n = kw["input_ids"].shape[1]
                first.update(first.keys[..., -n:, :].clone(), first.values[..., -n:, :].clone())
            raise self.error
        return self.model(**kw)


def test_ctrl_c_mid_pass_keeps_partial_output_and_the_next_prompt_is_exact(arch):
    target = tiny_model(arch)
    flaky = FailingForward(target, KeyboardInterrupt(), at=6)
    engine = Engine(flaky, None, DraftModelProposer(target), SpecConfig(draft_len=3))
    got = []
    with pytest.raises(KeyboardInterrupt):
        for event in engine.generate(PROMPT, limits=GenerationLimits(40)):
            got += [p.token_id for p in event.pieces]
    expected = hf_greedy(target, PROMPT, 40)
    assert got and got == expected[: len(got)]  # what was streamed before the interrupt is kept and exact
    assert len(engine.kv) == len(engine.kv_tokens.ids)  # the cache was put back to the committed tokens
    follow_up = PROMPT + got + [30, 31]
    assert tokens_of(engine, follow_up, 20) == hf_greedy(target, follow_up, 20)


def test_out_of_memory_on_a_wide_pass_shrinks_the_draft_and_carries_on():
    target = tiny_model("llama")
    flaky = FailingForward(target, torch.OutOfMemoryError("CUDA out of memory (simulated)"), at=3, wide_only=True)
    engine = Engine(flaky, None, DraftModelProposer(target), SpecConfig(draft_len=8))
    flaky.wide_only = False  # one failure is enough to see the shrink
    assert tokens_of(engine, PROMPT, 30) == hf_greedy(target, PROMPT, 30)
    assert engine.max_nodes == 4 and any("out of memory" in n for n in engine.stats.notices)


def test_kill_switch_pauses_a_useless_proposer_and_probes_again():
    class AlwaysWrong(Proposer):
        name = "wrong"

        def propose(self, tokens, max_len, sampling, generator):
            return Draft.chain([95] * max_len, label="wrong")  # a token the target never picks here

    target = tiny_model("llama")
    # plain decoding calibrated as instant: every speculative pass measures slower than plain
    costs = CostModel({1: 1e-7, 2: 1e-7, 16: 1e-7})
    engine = Engine(target, None, AlwaysWrong(), SpecConfig(draft_len=3), costs=costs)
    out = tokens_of(engine, PROMPT, 80)
    assert out == hf_greedy(target, PROMPT, 80)  # the output never changes
    stats = engine.stats
    assert any("speculation paused" in n for n in stats.notices)
    # 16 speculative passes, a pause of 16 plain passes, then probing again
    drafted_passes = stats.drafted_at[0]
    assert 16 < drafted_passes < stats.passes - 14


def test_speed_guard_leaves_a_fast_proposer_alone():
    guard = SpeedGuard(CostModel({1: 0.3}), window=4, pause=10)
    for _ in range(20):
        assert guard.record(drafted=4, tokens=3, seconds=0.35) == ""  # 8.6 tok/s > 3.3 plain
    assert guard.allows


def test_draft_that_does_not_fit_in_memory_falls_back_to_suffix_decoding(monkeypatch, capsys):
    from localspec.store.registry import load_registry

    registry = load_registry()
    calls = []

    def load_models(entry, draft_entry, proposer, dtype, spec, quiet):
        calls.append(draft_entry)
        if draft_entry is not None:
            raise torch.OutOfMemoryError("simulated: no room for the draft")
        target = tiny_model("qwen2")
        loaded = session_module.LoadedModel("tiny", target, None, torch.float32, torch.device("cpu"), 512, 0.0, False)
        return loaded, None, "test"

    monkeypatch.setattr(session_module, "load_models", load_models)
    monkeypatch.setattr(session_module, "costs_for", lambda target, draft, widths=None: CostModel({1: 0.1, 16: 0.2}))
    opened = session_module.open_session("qwen2.5-coder-1.5b", "draft", "float32", registry=registry)
    assert opened.proposer == "suffix" and "did not fit in memory" in opened.reason
    assert calls[0] is not None and calls[1] is None
    assert "did not fit in memory" in capsys.readouterr().err


def test_an_incompatible_draft_is_refused_with_the_reason(monkeypatch):
    from localspec.store.registry import load_registry

    registry = load_registry()
    monkeypatch.setattr(session_module, "check_tokenizers", lambda *a: "token 7 is 'a' in x but 'b' in y")
    fake = session_module.LoadedModel("m", tiny_model("llama"), object(), torch.float32, torch.device("cpu"), 512, 0, False)
    monkeypatch.setattr(session_module, "load_model", lambda *a, **k: fake)
    monkeypatch.setattr(session_module, "load_draft", lambda *a, **k: fake)
    entry = registry.get("qwen2.5-coder-1.5b")
    with pytest.raises(LocalspecError, match="token 7 is 'a' in x but 'b' in y; the draft proposer cannot pair them"):
        session_module.load_models(entry, registry.get("qwen2.5-coder-0.5b"), "draft", "float32", SpecConfig(), True)


# -- properties ------------------------------------------------------------------------------------

trees = st.integers(min_value=0, max_value=12).flatmap(
    lambda n: st.tuples(
        st.lists(st.integers(0, 7), min_size=n, max_size=n),
        st.tuples(*[st.integers(-1, i - 1) for i in range(n)]),
    )
)


@settings(max_examples=200, deadline=None)
@given(trees, st.integers(0, 2**31 - 1))
def test_greedy_tree_verification_accepts_exactly_the_argmax_path(tree, seed):
    tokens, parents = tree
    draft = Draft(list(tokens), list(parents))
    logits = torch.randn(len(draft) + 1, 8, generator=torch.Generator().manual_seed(seed))
    verdict = verify_greedy(draft, logits)
    node = -1
    for accepted in verdict.accepted:  # each accepted node is a child of the previous one with the argmax token
        assert draft.parents[accepted] == node and draft.tokens[accepted] == int(logits[node + 1].argmax())
        node = accepted
    best = int(logits[node + 1].argmax())
    assert verdict.next_token == best
    assert all(draft.tokens[c] != best for c in draft.children(node))  # it stopped where nothing matched


@settings(max_examples=40, deadline=None)
@given(trees, st.integers(0, 2**31 - 1), st.integers(1, 6))
def test_tree_pass_and_compaction_equal_a_fresh_prefill(tree, seed, past):
    tokens, parents = tree
    draft = Draft(list(tokens), list(parents))
    model = tiny_model("llama", vocab=8, layers=1, hidden=16)
    rng = random.Random(seed)
    prefix = [rng.randrange(8) for _ in range(past)]
    root = rng.randrange(8)
    kv = KVCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix]), cache=kv.cache, use_cache=True)
        ids, positions, mask = verify_inputs(draft, root, past)
        tree_logits = model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=kv.cache, use_cache=True).logits[0]
        # pick a random root-to-node path as "accepted" and compact the cache to it
        node = rng.randrange(-1, len(draft))
        path = []
        while node >= 0:
            path.append(node)
            node = draft.parents[node]
        path.reverse()
        kv.keep(past, [0] + [n + 1 for n in path])
        committed = prefix + [root] + [draft.tokens[n] for n in path]
        assert len(kv) == len(committed)
        fresh = model(input_ids=torch.tensor([committed])).logits[0]
        # every node's logits in the tree pass equal those of its own path in a plain pass
        torch.testing.assert_close(tree_logits[0], fresh[past], atol=1e-4, rtol=1e-4)
        for depth, n in enumerate(path, start=1):
            torch.testing.assert_close(tree_logits[n + 1], fresh[past + depth], atol=1e-4, rtol=1e-4)
        # and the compacted cache continues exactly like a fresh prefill
        probe = torch.tensor([[3]])
        cached = model(input_ids=probe, position_ids=torch.tensor([[len(committed)]]), cache=kv.cache).logits[0, -1]
        again = model(input_ids=torch.tensor([committed + [3]])).logits[0, -1]
        torch.testing.assert_close(cached, again, atol=1e-4, rtol=1e-4)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_sampling_verification_never_accepts_a_token_the_target_rules_out(drafted, seed):
    from localspec.core.verify import verify_sampling

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(drafted) + 1, 6, generator=gen)
    logits[:, 0] = float("-inf")  # token 0 is impossible for the target
    q = [torch.softmax(torch.randn(6, generator=gen), -1) for _ in drafted]
    verdict = verify_sampling(Draft.chain(drafted, q), logits, SamplingConfig(temperature=1.0), gen)
    assert all(drafted[n] != 0 for n in verdict.accepted) and verdict.next_token != 0
    assert verdict.accepted == list(range(len(verdict.accepted)))  # a prefix of the chain


@settings(max_examples=200, deadline=None)
@given(trees, st.lists(st.integers(0, 7), max_size=6))
def test_a_grafted_guess_keeps_the_draft_and_is_spelled_once_from_the_root(tree, guess):
    tokens, parents = tree
    draft = Draft(list(tokens), list(parents), probs=[torch.ones(8) / 8] * len(tokens))
    both = graft(draft, guess)
    # the draft's own nodes come first, unchanged, so the rule still tries them first
    assert both.tokens[: len(draft)] == draft.tokens and both.parents[: len(draft)] == draft.parents
    assert both.probs[: len(draft)] == draft.probs and all(q is None for q in both.probs[len(draft):])
    path = matched_path(both, guess)
    assert [both.tokens[n] for n in path] == guess  # the whole guess is one root path ...
    assert len(both) - len(draft) == len(guess) - len(matched_path(draft, guess))  # ... sharing what the draft had


def test_cache_buffers_are_written_in_place_and_grow_rarely():
    """No copy of the cache per pass: passes write into preallocated buffers, rollback and tree
    compaction stay inside them, and a buffer is reallocated only when it fills (doubling)."""
    model = tiny_model("llama")
    kv = KVCache()
    buffers = set()
    with torch.no_grad():
        model(input_ids=torch.tensor([list(range(10))]), cache=kv.cache, use_cache=True)
        for _ in range(300):
            past = len(kv)
            model(input_ids=torch.tensor([[1, 2, 3]]), position_ids=torch.arange(past, past + 3)[None], cache=kv.cache, use_cache=True)
            kv.keep(past, [0, 2])  # a tree pass that kept the root and its second node
            layer = kv.cache.layers[0]
            assert layer.keys.data_ptr() == layer.key_slots.buffer.data_ptr()  # the model sees a view, not a copy
            buffers.add(layer.key_slots.buffer.data_ptr())
    assert len(kv) == 10 + 2 * 300
    assert len(buffers) <= 3  # 610 slots: 256 -> 512 -> 1024
