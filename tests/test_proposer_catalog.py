"""The proposer catalog is the one list: every proposer in it can be chosen from the CLI and the
chat UI (the wizard: test_pairing.py), and what cannot run for a target says why."""

from __future__ import annotations

import pytest

from localspec.apps.cli import build_parser
from localspec.apps.tui.app import LocalspecApp
from localspec.apps.tui.backend import ChatSettings, available_proposers
from localspec.apps.tui.fake import FakeBackend
from localspec.apps.tui.history import HistoryStore
from localspec.base.config import eagle_head_dir
from localspec.base.errors import LocalspecError
from localspec.store import proposer_catalog
from localspec.store.proposer_catalog import KINDS, rank_proposers
from localspec.store.registry import load_registry

TARGET = "qwen2.5-coder-1.5b"  # has a registered draft
LONE = "smollm2-135m"  # has none


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    return tmp_path


def train_head_here(model: str) -> None:
    """What has_eagle_head looks for: the files `localspec train-eagle` writes."""
    folder = eagle_head_dir(model)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")


def test_the_catalog_names_what_each_proposer_needs():
    assert list(KINDS) == ["eagle", "draft", "suffix", "ngram", "none"]  # the order auto prefers
    assert proposer_catalog.CHOICES == ("auto", *KINDS)
    assert KINDS["eagle"].head and KINDS["eagle"].trees and not KINDS["eagle"].draft_model
    assert KINDS["draft"].draft_model and not KINDS["draft"].head
    assert KINDS["suffix"].trees and not (KINDS["suffix"].head or KINDS["suffix"].draft_model)
    assert not any(KINDS[n].head or KINDS[n].draft_model or KINDS[n].trees for n in ("ngram", "none"))
    with pytest.raises(LocalspecError, match="--proposer must be one of auto, eagle, draft, suffix, ngram, none, got 'medusa'"):
        proposer_catalog.kind("medusa")


def test_availability_says_why_not(home):
    registry = load_registry()
    assert proposer_catalog.available(registry.get(TARGET)) == ["draft", "suffix", "ngram", "none"]
    assert proposer_catalog.available(registry.get(LONE)) == ["suffix", "ngram", "none"]
    assert proposer_catalog.unavailable("draft", registry.get(LONE)) == f"{LONE} has no registered draft model"
    why = proposer_catalog.unavailable("eagle", registry.get(TARGET))
    assert why.startswith(f"no EAGLE head for {TARGET} on this machine ({eagle_head_dir(TARGET)})")
    assert "localspec train-eagle --target qwen2.5-coder-1.5b" in why
    with pytest.raises(LocalspecError, match=f"no EAGLE head for {TARGET} on this machine.*; try --proposer ngram"):
        rank_proposers("eagle", registry.get(TARGET))
    train_head_here(TARGET)
    assert proposer_catalog.available(registry.get(TARGET)) == list(KINDS)
    assert [c.proposer for c in rank_proposers("eagle", registry.get(TARGET))] == ["eagle"]  # asked for: no other


@pytest.mark.parametrize("command", ["run", "chat", "serve"])
@pytest.mark.parametrize("name", proposer_catalog.CHOICES)
def test_every_proposer_can_be_chosen_on_the_command_line(command, name):
    argv = [command, *(["hi"] if command == "run" else []), "--proposer", name]
    assert build_parser().parse_args(argv).proposer == name


def test_bench_runs_every_proposer_by_default():
    from localspec.apps.bench import requested_proposers

    assert set(requested_proposers(build_parser().parse_args(["bench"]).proposers)) == set(KINDS)
    assert requested_proposers("none, suffix") == ["none", "suffix"]


@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


@pytest.mark.anyio
async def test_the_chat_switches_through_every_proposer_when_each_can_run(home):
    train_head_here(TARGET)
    registry = load_registry()
    assert available_proposers(registry, TARGET) == list(KINDS)
    app = LocalspecApp(FakeBackend(), ChatSettings(model=TARGET), HistoryStore(home / "history"))
    seen = []
    async with app.run_test(size=(150, 45)) as pilot:
        for _ in range(len(KINDS) + 1):
            await pilot.app.workers.wait_for_complete()
            await pilot.pause()
            seen.append(app.loaded.proposer)
            await pilot.press("ctrl+r")
    assert seen[0] == "ngram"  # the fake backend's auto
    assert set(seen) == set(KINDS) and seen[-1] == seen[0]  # each once, round to the start
