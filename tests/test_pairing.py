"""Tokenizer compatibility (real tokenizers too), the local history, the user registry, the wizard."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from conftest import CharTokenizer, tiny_model
from localspec.apps import pairing
from localspec.store import registry
from localspec.base.config import eagle_head_dir
from localspec.base.errors import LocalspecError
from localspec.core.proposers.eagle_head import save_head
from localspec.core.stats import GenerationStats
from localspec.store import history, machine, paths, proposer_catalog, tokenizers
from localspec.store.loading import LoadedModel
from localspec.store.proposer_catalog import rank_proposers
from localspec.store.registry import load_registry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class FakeTokenizer:
    def __init__(self, tokens: list[str], special=("<eos>",), template="<|im_start|>{{ m }}"):
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.all_special_tokens = list(special)
        self.chat_template = template

    def get_vocab(self):
        return dict(self.vocab)

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token)


TOKENS = ["<eos>", "a", "b", "c", "def", " return"]


@pytest.mark.parametrize("draft_tokens", [TOKENS, TOKENS + ["[PAD6]", "[PAD7]"]], ids=["identical", "padded"])
def test_identical_or_only_padded_tokenizers_pair(draft_tokens):
    assert machine.check_tokenizers("t", FakeTokenizer(TOKENS), "d", FakeTokenizer(draft_tokens)) is None


@pytest.mark.parametrize(
    "draft, message",
    [
        (FakeTokenizer(["<eos>", "a", "x", "c", "def", " return"]), "1 of 6 shared token ids map to different tokens (id 2 is 'b' in t, 'x' in d)"),
        (FakeTokenizer(TOKENS + ["extra"]), "d has 1 token ids the other lacks (6..6)"),
        (FakeTokenizer(TOKENS, special=("<eos>", "c")), "special tokens differ (c)"),
        (FakeTokenizer(TOKENS, template="<|start_header_id|>"), "chat templates differ (chatml vs llama3)"),
    ],
)
def test_a_refused_pair_says_what_differs(draft, message):
    reason = machine.check_tokenizers("t", FakeTokenizer(TOKENS), "d", draft)
    assert reason.startswith("d cannot draft for t: ") and message in reason


def tokenizer_of(name: str):
    entry = load_registry().get(name)
    if not paths.is_downloaded(entry):
        pytest.skip(f"{name} is not on this machine (run `localspec pull {name}`)")
    return tokenizers.load_tokenizer(entry, progress=False)


@pytest.mark.real_model
def test_real_smollm2_cannot_draft_for_qwen():
    reason = machine.check_tokenizers(
        "qwen2.5-coder-1.5b", tokenizer_of("qwen2.5-coder-1.5b"), "smollm2-135m", tokenizer_of("smollm2-135m")
    )
    assert reason.startswith("smollm2-135m cannot draft for qwen2.5-coder-1.5b: ")
    assert "shared token ids map to different tokens" in reason and "token ids the other lacks" in reason


@pytest.mark.real_model
def test_real_qwen_coder_half_b_drafts_for_one_and_a_half_b():
    target, draft = tokenizer_of("qwen2.5-coder-1.5b"), tokenizer_of("qwen2.5-coder-0.5b")
    assert machine.check_tokenizers("qwen2.5-coder-1.5b", target, "qwen2.5-coder-0.5b", draft) is None


def test_eagle_head_must_match_the_pinned_target_revision():
    entry = load_registry().get("qwen3-8b")
    assert machine.check_eagle_head(entry, entry.eagle_heads[0]) is None
    other = entry.eagle_heads[0].__class__("org/head", "main", "f" * 40, ("config.json",))
    assert "was trained on Qwen/Qwen3-8B at ffffffffffff" in machine.check_eagle_head(entry, other)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    return tmp_path


def stats(tokens: int, seconds: float, plain: float, drafted: int, accepted: int) -> GenerationStats:
    return GenerationStats(
        new_tokens=tokens, decode_seconds=seconds, plain_token_seconds=plain, drafted=drafted, accepted=accepted
    )


def test_history_accumulates_per_pair(home):
    history.record_generation("m", "draft", stats(101, 10.0, 0.05, 80, 40), draft="d")  # 10 tok/s, 0.5x
    history.record_generation("m", "draft", stats(101, 5.0, 0.05, 80, 60), draft="d")  # 20 tok/s, 1.0x
    history.record_generation("m", "ngram", stats(1, 0.0, 0.05, 0, 0))  # nothing to learn from
    seen = history.load_history("m")
    assert set(seen) == {"draft:d"}
    assert seen["draft:d"].tokens == 202
    assert seen["draft:d"].speedup == pytest.approx(0.75) and seen["draft:d"].acceptance == pytest.approx(100 / 160)
    assert history.load_history("other") == {}


def test_a_damaged_history_is_replaced_not_fatal(home):
    (home / "history.json").write_text("{not json")
    assert history.load_history("m") == {}
    history.record_generation("m", "ngram", stats(11, 1.0, 0.05, 5, 5))
    assert json.loads((home / "history.json").read_text())


def test_to_toml_round_trips_registry_shapes():
    data = {
        "default": "a.b",
        "models": {
            "a.b": {"arch": "qwen2", "files": ["x", "y"], "params": 1.5, "size": 10,
                    "eagle_heads": [{"repo": "r", "files": ["f"]}], "paired": {"proposer": "draft", "draft": 'q"d'}},
        },
    }
    assert tomllib.loads(registry.to_toml(data)) == data


def test_saved_pairing_is_loaded_and_chosen(home):
    (home / "models.toml").write_text('# mine\n[models."smollm2-135m"]\ndisplay = "my smol"\n')
    best = pairing.Candidate("ngram", None, tokens_per_second=30.0, acceptance=0.4, draft_len=3)
    pairing.save_pairing("smollm2-135m", best, speedup=1.2)
    entry = load_registry().get("smollm2-135m")
    assert entry.display == "my smol"  # what the user had is kept
    assert entry.paired.proposer == "ngram" and entry.paired.draft_len == 3 and entry.paired.speedup == pytest.approx(1.2)
    choice = rank_proposers("auto", entry, load_registry(), downloaded=set(), memory=None, history={})[0]
    assert choice.proposer == "ngram" and "won `localspec pair`" in choice.reason


def test_situation_describes_this_machine(home):
    registry = load_registry()
    now = machine.situation(registry, "qwen2.5-coder-1.5b")
    # nothing pulled in this fresh home: only the models with an offline mirror count as at hand
    assert now["downloaded"] == {name for name, e in registry.models.items() if e.mirror is not None}
    assert "llama-3.1-8b" not in now["downloaded"] and "qwen2.5-coder-0.5b" in now["downloaded"]
    assert now["memory"] > 0 and now["history"] == {}


def tiny_wizard(home, monkeypatch):
    """pairing.pair on tiny random models: no download, no real weights; returns the target model
    and a function that runs the wizard for qwen2.5-coder-1.5b and returns (winner, lines said)."""
    target_model, draft_model = tiny_model("qwen2", seed=0), tiny_model("qwen2", seed=1, layers=1)

    def load_models(entry, draft_entry, proposer, dtype, spec, quiet):
        def loaded(name, model):
            return LoadedModel(name, model, CharTokenizer(), torch.float32, torch.device("cpu"), 512, 0.0, False)
        return loaded(entry.name, target_model), loaded(draft_entry.name, draft_model) if draft_entry else None, "test"

    monkeypatch.setattr(pairing, "free_memory", lambda device: 64 * 10**9)
    monkeypatch.setattr(pairing, "load_models", load_models)
    monkeypatch.setattr(pairing.tokenizers, "load_tokenizer", lambda entry: FakeTokenizer(TOKENS))
    prompts = home / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": "def add(a, b): return a + b"}, {"prompt": "x = x + 1; y = y + 1"}]))

    def run():
        lines = []
        best = pairing.pair("qwen2.5-coder-1.5b", prompts_file=str(prompts), max_new_tokens=12, say=lines.append)
        return best, lines

    return target_model, run


def measured(lines: list[str]) -> list[str]:
    return [line.split()[0] for line in lines if "tok/s, acceptance" in line]


def test_the_wizard_measures_every_candidate_and_saves_the_winner(home, monkeypatch):
    pulled = []
    monkeypatch.setattr(pairing.hub, "pull", lambda entry, offline: pulled.append(entry.name))
    decoded: dict[str, list[tuple[int, float]]] = {}  # per candidate, per prompt: (decode tokens, seconds)
    record = pairing.record_generation

    def recording(model, proposer, stats, draft=None):
        # the first token of an answer comes from the prompt pass: decode speed counts the rest
        decoded.setdefault(history.pair_key(proposer, draft), []).append((stats.new_tokens - 1, stats.decode_seconds))
        record(model, proposer, stats, draft)

    monkeypatch.setattr(pairing, "record_generation", recording)
    _, run = tiny_wizard(home, monkeypatch)
    best, lines = run()

    assert pulled == ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]
    assert measured(lines) == ["none", "ngram", "suffix", "draft:qwen2.5-coder-0.5b"]
    assert any(line.startswith("eagle: no EAGLE head for qwen2.5-coder-1.5b") for line in lines)  # said, not silent
    assert list(decoded) == measured(lines) and all(len(runs) == 2 for runs in decoded.values())  # two prompts each
    speeds = {key: sum(t for t, _ in runs) / sum(s for _, s in runs) for key, runs in decoded.items()}
    winner = max(speeds, key=speeds.get)
    saved = load_registry().get("qwen2.5-coder-1.5b").paired
    assert history.pair_key(saved.proposer, saved.draft) == winner
    assert saved.tokens_per_second == pytest.approx(speeds[winner], abs=1e-3)
    assert saved.speedup == pytest.approx(speeds[winner] / speeds["none"], abs=1e-3)
    assert (best.proposer, best.draft, best.draft_len) == (saved.proposer, saved.draft, saved.draft_len)
    assert set(history.load_history("qwen2.5-coder-1.5b")) <= {"none", "ngram", "suffix", "draft:qwen2.5-coder-0.5b"}


def test_the_wizard_measures_every_proposer_in_the_catalog_with_a_head_trained_here(home, monkeypatch):
    """With an EAGLE head for the target on this machine (a tiny one, for the tiny target), the
    wizard measures it like the others: every proposer in the catalog is a candidate."""
    from test_eagle import random_head

    monkeypatch.setattr(pairing.hub, "pull", lambda entry, offline: None)
    target_model, run = tiny_wizard(home, monkeypatch)
    save_head(random_head(target_model, version=1), eagle_head_dir("qwen2.5-coder-1.5b"))
    best, lines = run()

    assert measured(lines) == ["none", "ngram", "suffix", "eagle", "draft:qwen2.5-coder-0.5b"]
    assert {name.split(":")[0] for name in measured(lines)} == set(proposer_catalog.KINDS)
    eagle = next(line for line in lines if line.split()[0] == "eagle")
    assert "acceptance" in eagle and " 0.00 tok/s" not in eagle
    assert not any(line.startswith("eagle:") for line in lines)  # not skipped
    # the head's hooks left the target with its engine: the draft measured after it ran on a clean target
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in target_model.modules())
    assert load_registry().get("qwen2.5-coder-1.5b").paired.proposer == best.proposer


def test_the_wizard_without_a_target_lists_what_fits(home, monkeypatch):
    monkeypatch.setattr(pairing, "free_memory", lambda device: 2 * 10**9)
    lines = []
    with pytest.raises(LocalspecError, match="name a target: localspec pair NAME \\(fits here: .*smollm2-135m"):
        pairing.pair(None, say=lines.append)
    assert not any("qwen3-8b" in line for line in lines)  # 16 GB of weights do not fit in 2 GB
