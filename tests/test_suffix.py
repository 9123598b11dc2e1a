"""Suffix decoding: the index against brute force, the tree it builds, exactness against plain
greedy decoding and the target's distribution, and the history kept on disk."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import PROMPT_IDS, VOCAB, hf_greedy, tiny_model
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core.engine import Engine
from localspec.core.proposers.suffix import (
    MAX_MATCH, MIN_PATH_PROBABILITY, SuffixIndex, SuffixProposer, expected_accepted, frequency_tree, live_match,
)
from localspec.core.tree import path_probabilities
from localspec.store import token_history
from localspec.store.token_history import HISTORY_TOKENS, TokenHistory, forget
from test_lossless_sampling import VOCAB as SMALL_VOCAB, chi2, chi2_limit, exact_pairs


def brute_occurrences(documents, pattern) -> list[int]:
    """Continuation starts of every occurrence of `pattern` followed by a token of its document,
    as positions in the concatenation with one END after each document."""
    found, offset = [], 0
    for doc in documents:
        for i in range(len(doc) - len(pattern)):
            if list(doc[i: i + len(pattern)]) == list(pattern):
                found.append(offset + i + len(pattern))
        offset += len(doc) + 1
    return sorted(found)


def brute_longest(documents, tokens) -> int:
    return max((m for m in range(1, min(MAX_MATCH, len(tokens)) + 1) if brute_occurrences(documents, tokens[-m:])), default=0)


@pytest.mark.parametrize("seed", range(4))
def test_the_index_finds_every_occurrence_brute_force_finds(seed):
    rng = np.random.default_rng(seed)
    alphabet = 3 + seed * 40  # a tiny alphabet repeats a lot; a large one (beyond a byte) hardly
    documents = [rng.integers(0, alphabet, rng.integers(1, 60)).tolist() for _ in range(12)]
    documents[3] = documents[1][5:40] + documents[3]  # a long repeat across documents
    index = SuffixIndex(documents)
    assert len(index) == sum(map(len, documents))
    for doc in documents:
        for length in (1, 2, 3, 6, 20):
            for start in range(0, max(1, len(doc) - length), 7):
                pattern = np.asarray(doc[start: start + length])
                assert sorted(index.occurrences(pattern) + len(pattern)) == brute_occurrences(documents, pattern)
    for _ in range(40):
        tokens = np.asarray(rng.integers(0, alphabet, rng.integers(1, 50)).tolist() + documents[3][:rng.integers(1, 30)])
        matched, starts = index.longest_match(tokens)
        assert matched == brute_longest(documents, tokens.tolist())
        assert sorted(starts.tolist()) == (brute_occurrences(documents, tokens[len(tokens) - matched:]) if matched else [])
        for s in starts:  # each continuation lies in one document
            assert index.continuation(int(s), 5).tolist() == index.corpus[s: s + len(index.continuation(int(s), 5))].tolist()
            assert -1 not in index.continuation(int(s), 5).tolist()


def test_no_match_runs_across_two_documents_and_an_empty_index_finds_nothing():
    index = SuffixIndex([[1, 2], [3, 4]])
    matched, starts = index.longest_match(np.asarray([9, 2, 3]))  # "2, 3" only exists across the boundary
    assert matched == 1 and index.continuation(int(starts[0]), 4).tolist() == [4]
    assert index.longest_match(np.asarray([1, 2]))[0] == 0  # nothing follows [1, 2] or [2] in their document
    empty = SuffixIndex([])
    assert len(empty) == 0 and empty.longest_match(np.asarray([1, 2]))[0] == 0


def test_live_match_agrees_with_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(200):
        tokens = rng.integers(0, 4, rng.integers(1, 80))
        matched, starts = live_match(tokens)
        expected_len = max((m for m in range(1, min(MAX_MATCH, len(tokens) - 1) + 1)
                            if brute_occurrences([tokens[:-1].tolist() + [tokens[-1]]], tokens[-m:])
                            and any(list(tokens[i - m: i]) == list(tokens[-m:]) for i in range(m, len(tokens)))), default=0)
        ends = [i for i in range(expected_len, len(tokens)) if list(tokens[i - expected_len: i]) == list(tokens[-expected_len:])] if expected_len else []
        assert matched == expected_len
        assert starts.tolist() == ends


def test_the_tree_counts_what_followed_and_offers_it_best_first():
    runs = [np.asarray(r) for r in ([5, 6, 7], [5, 6, 8], [5, 6, 7], [9], [5, 1])]
    draft = frequency_tree(runs, 16, "history-3", history=True)
    assert draft.history and draft.label == "history-3"
    # 5 (4 of 5), then 6 (3 of those 4), then 7 (2 of those 3); 9, 8 and 1 later
    assert draft.tokens[:3] == [5, 6, 7]
    assert draft.parents[:3] == [-1, 0, 1]
    assert draft.confidences[:3] == pytest.approx([0.8, 0.75, 2 / 3])
    reach = path_probabilities(draft)
    assert reach == sorted(reach, reverse=True) and min(reach) >= MIN_PATH_PROBABILITY
    assert expected_accepted(draft) == pytest.approx(sum(reach))
    assert sorted(draft.tokens) == [1, 5, 6, 7, 8, 9]
    assert len(frequency_tree(runs, 2, "x")) == 2
    chain = draft.likeliest_chain()
    assert chain.tokens == [5, 6, 7] and chain.is_chain and chain.history


def _greedy(model, prompt, n):
    return hf_greedy(model, prompt, n)


def _run(engine, prompt, n, sampling=SamplingConfig()):
    return [p.token_id for ev in engine.generate(prompt, sampling, GenerationLimits(n)) for p in ev.pieces]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_suffix_decoding_reproduces_plain_greedy_from_right_wrong_and_branching_history(arch):
    model = tiny_model(arch, seed=1)
    n = 40
    expected = _greedy(model, PROMPT_IDS, n)
    right = PROMPT_IDS + expected  # an earlier answer to the same prompt
    branching = PROMPT_IDS + expected[:7] + [(t + 1) % VOCAB for t in expected[7:]]  # agrees, then not
    wrong = PROMPT_IDS[-3:] + [(t + 3) % VOCAB for t in expected]
    for documents in ([right], [branching, right, wrong], [wrong], []):
        engine = Engine(model, None, SuffixProposer([SuffixIndex(documents)]), SpecConfig())
        assert _run(engine, PROMPT_IDS, n) == expected, documents
        if documents and documents[0] is right:
            assert engine.stats.history_accepted > n // 2 and engine.stats.history_passes > 0
            assert engine.stats.mean_tokens_per_pass > 3


def test_a_model_proposer_carries_suffix_guesses_and_stays_exact():
    from localspec.core.proposers import DraftModelProposer

    model, draft = tiny_model("llama", seed=1), tiny_model("llama", seed=9)
    n = 32
    expected = _greedy(model, PROMPT_IDS, n)
    lookup = SuffixProposer([SuffixIndex([PROMPT_IDS + expected])])
    engine = Engine(model, None, DraftModelProposer(draft), SpecConfig(draft_len=3), lookup=lookup)
    assert engine.lookup is lookup
    assert _run(engine, PROMPT_IDS, n) == expected
    assert engine.stats.history_accepted > 0 and engine.stats.lookup_accepted > 0


def test_finished_answers_are_remembered_and_guessed_next_time(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    model = tiny_model("llama", seed=1)
    n = 40
    expected = _greedy(model, PROMPT_IDS, n)
    history = TokenHistory("tiny")
    first = Engine(model, None, SuffixProposer(history.indexes(), history.remember), SpecConfig())
    assert _run(first, PROMPT_IDS, n) == expected
    assert first.stats.history_passes == 0
    assert token_history.history_file("tiny").exists()
    again = TokenHistory("tiny")  # another process, later
    second = Engine(model, None, SuffixProposer(again.indexes(), again.remember), SpecConfig())
    assert _run(second, PROMPT_IDS, n) == expected
    # every guess from the history, and right (without measured costs a chain is cut at 4)
    assert second.stats.history_accepted == second.stats.accepted == second.stats.drafted >= n * 3 // 4
    assert forget("tiny") and not token_history.history_file("tiny").exists()


def test_no_history_neither_reads_nor_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    TokenHistory("tiny").remember([1, 2, 3, 4], set())
    off = TokenHistory("tiny", context=[[7, 8, 9]], keep=False)
    assert [len(i) for i in off.indexes()] == [3]  # the context only
    assert off.remember([5, 6], set()) is None
    assert [len(i) for i in TokenHistory("tiny").indexes()] == [4]


def test_sampling_through_suffix_trees_keeps_the_target_distribution():
    """Two earlier answers disagree after the prompt's suffix: their first tokens are siblings,
    fixed guesses tried one after the other by the rule; the first two tokens must still follow
    the target's own distribution."""
    target = tiny_model("llama", seed=3, vocab=SMALL_VOCAB, layers=1, hidden=16)
    prompt = [1, 2, 3, 4, 0, 5]
    sampling = SamplingConfig(temperature=1.0)
    exact = exact_pairs(target, sampling, prompt)
    first: dict[int, float] = {}
    for (a, _), p in exact.items():
        first[a] = first.get(a, 0.0) + p
    a1, a2 = sorted(first, key=first.get, reverse=True)[:2]
    b1, b2 = (max((pair for pair in exact if pair[0] == a), key=exact.get)[1] for a in (a1, a2))
    index = SuffixIndex([prompt[-3:] + [a1, b1], prompt[-3:] + [a2, b2]])
    engine = Engine(target, None, SuffixProposer([index]), SpecConfig(draft_len=4))
    n, counts, from_history, siblings = 1000, {}, 0, 0
    for seed in range(n):  # four tokens, so the first pass may verify three nodes: a1, b1 and a2
        out = tuple(_run(engine, prompt, 4, SamplingConfig(temperature=1.0, seed=seed))[:2])
        counts[out] = counts.get(out, 0) + 1
        from_history += engine.stats.history_accepted
        siblings += out[0] == a2
    assert from_history > n / 10 and siblings > n / 20, "the test must exercise the history's guesses and the sibling"
    stat, df = chi2(counts, exact, n)
    assert stat < chi2_limit(df), (stat, df)


def test_the_history_replaces_a_conversations_earlier_turn_and_keeps_within_its_cap(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    clock = iter(range(1, 1000))
    history = TokenHistory("tiny", clock=lambda: next(clock))
    history.remember([1, 2, 3], set())
    history.remember([1, 2, 3, 4, 5], set())  # the same conversation, one turn later
    history.remember([1, 2], set())  # held whole already: only used
    docs = token_history.read_documents(history.path, print)
    assert [d.tolist() for d in docs.runs] == [[1, 2, 3, 4, 5]] and docs.ids == [1] and docs.next_id == 2
    monkeypatch.setattr(token_history, "HISTORY_TOKENS", 10)
    history.remember([20, 21, 22, 23], set())
    history.remember([30, 31, 32, 33], {1})  # [1..5] was offered since: [20..23] is the least recently used
    docs = token_history.read_documents(history.path, print)
    assert [d.tolist() for d in docs.runs] == [[1, 2, 3, 4, 5], [30, 31, 32, 33]] and docs.ids == [1, 3]
    monkeypatch.setenv("LOCALSPEC_HISTORY_TOKENS", "5")
    history.remember([40, 41], set())
    assert [d.tolist() for d in token_history.read_documents(history.path, print).runs] == [[40, 41]]
    monkeypatch.setenv("LOCALSPEC_HISTORY_TOKENS", "lots")
    with pytest.raises(LocalspecError, match="LOCALSPEC_HISTORY_TOKENS"):
        history.remember([50], set())


def test_a_session_searches_what_it_added_without_rebuilding_the_settled_index(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    history = TokenHistory("tiny", context=[[90, 91, 92]])
    settled, = history.indexes()
    assert len(settled) == 3 and settled.ids.tolist() == [-1]
    indexes = history.remember(list(range(10, 30)), set())
    assert indexes[0] is settled and len(indexes[1]) == 20
    indexes = history.remember(list(range(40, 50)), set())
    assert indexes[0] is settled and len(indexes[1]) == 30  # both answers in the fresh one
    monkeypatch.setattr(token_history, "SETTLE_MINIMUM", 10)
    merged, = history.remember(list(range(60, 70)), set())  # past a quarter of the settled index: one again
    assert len(merged) == 43 and history.settled is merged


def test_a_damaged_history_is_set_aside_with_one_notice(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    path = token_history.history_file("tiny")
    path.parent.mkdir(parents=True)
    said = []
    for damage in (b"not an npz", b"PK\x03\x04truncated"):
        path.write_bytes(damage)
        history = TokenHistory("tiny", notify=said.append)
        assert [len(i) for i in history.indexes()] == [0]
        assert len(said) == 1 and "damaged" in said[0] and path.with_name(path.name + ".damaged").exists()
        history.remember([1, 2, 3], set())
        assert [len(i) for i in TokenHistory("tiny").indexes()] == [3]
        said.clear()
    np.savez(open(path, "wb"), tokens=np.array([1, 2], dtype=np.int32), lengths=np.array([5]), ids=np.array([0]), used=np.array([0.0]))
    assert [len(i) for i in TokenHistory("tiny", notify=said.append).indexes()] == [0] and len(said) == 1  # parts that disagree
    # forgetting every model's history also takes a file set aside as damaged with nothing beside it
    assert not path.exists() and forget() == [path.with_name(path.name + ".damaged")]
    assert [p.name for p in path.parent.glob("*.npz*")] == ["tiny.npz.lock"]  # a lock file stays, empty (base.files.locked)


def test_context_files_are_read_and_binaries_and_hidden_files_passed_over(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "src" / "blob.bin").write_bytes(b"\0\1\2")
    (tmp_path / "src" / ".secret").write_text("hidden")
    docs = token_history.context_documents([str(tmp_path / "src")], lambda text: [ord(c) for c in text])
    assert docs == [[ord(c) for c in "def f():\n    return 1\n"]]
    with pytest.raises(LocalspecError, match="does not exist"):
        token_history.context_documents([str(tmp_path / "missing")], list)
    with pytest.raises(LocalspecError, match="not a text file"):
        token_history.context_documents([str(tmp_path / "src" / "blob.bin")], list)


def test_forget_and_context_from_the_command_line(tmp_path, monkeypatch, capsys):
    from localspec.apps.cli import build_parser, main, spec_from

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    TokenHistory("smollm2-135m").remember([1, 2, 3], set())
    TokenHistory("qwen2.5-coder-1.5b").remember([4, 5], set())
    assert main(["forget", "--model", "smollm2-135m"]) == 0
    assert "1 file removed" in capsys.readouterr().out
    assert not token_history.history_file("smollm2-135m").exists() and token_history.history_file("qwen2.5-coder-1.5b").exists()
    assert main(["forget"]) == 0 and not token_history.history_file("qwen2.5-coder-1.5b").exists()
    # a missing --context path is refused before any model loads, the prompt written after it included
    assert main(["run", "--context", str(tmp_path / "missing.py"), "hi", "--no-daemon"]) != 0
    assert "--context: " in capsys.readouterr().err and not (tmp_path / "models").exists()
    (tmp_path / "a.py").write_text("x = 1\n")
    args = build_parser().parse_args(["run", "--context", str(tmp_path / "a.py"), "--context", str(tmp_path), "hi"])
    assert args.prompt == "hi" and spec_from(args, "auto").context == (str((tmp_path / "a.py").resolve()), str(tmp_path.resolve()))


def test_a_benchmarks_empty_history_is_fresh_then_gone_and_the_users_setting_comes_back(monkeypatch, tmp_path):
    from localspec.store import token_history

    monkeypatch.setenv("LOCALSPEC_HISTORY_DIR", str(tmp_path / "mine"))
    with token_history.empty_history():
        inside = token_history.history_dir()
        assert inside != tmp_path / "mine" and inside.is_dir() and not any(inside.iterdir())
    assert not inside.exists() and token_history.history_dir() == tmp_path / "mine"
    monkeypatch.delenv("LOCALSPEC_HISTORY_DIR")
    with token_history.empty_history():
        pass
    assert "LOCALSPEC_HISTORY_DIR" not in os.environ
