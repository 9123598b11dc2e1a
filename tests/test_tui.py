"""The chat UI, driven by Pilot with a scripted engine (and once with smollm2-135m)."""

from __future__ import annotations

import fcntl
import io
import json
import os
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console
from textual.widgets import Markdown, Static, TextArea

from conftest import assert_at_a_glance
from localspec.apps.pairing import Candidate
from localspec.apps.tui import streaming
from localspec.apps.tui.app import LocalspecApp
from localspec.apps.tui.backend import ChatSettings, SessionBackend
from localspec.apps.tui.fake import ANSWER, FakeBackend, FakeEngine
from localspec.apps.tui.history import Conversation, HistoryStore, Message
from localspec.apps.tui.screens import HelpScreen, SettingsScreen, WizardScreen
from localspec.apps.tui.widgets import DRAFT_STYLE, MessageView, StatsPanel
from localspec.base.config import GenerationLimits, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core.stats import GenerationStats

pytestmark = pytest.mark.anyio  # async tests run under anyio's pytest plugin (asyncio backend)



@pytest.fixture
def anyio_backend():
    return "asyncio"  # Textual runs on asyncio


MODEL = "smollm2-135m"  # no registered draft: the proposers offered are suffix, ngram and none
SETTINGS = ChatSettings(model=MODEL)


def fake_pair(target, say):
    """Stands in for pairing.pair: reports like it and names a winner, measuring nothing."""
    say(f"  {target}: none 30.00 tok/s")
    say(f"  {target}: ngram 41.00 tok/s, acceptance 62%, best draft length 5")
    return Candidate("ngram", None, tokens_per_second=41.0, acceptance=0.62, draft_len=5)


def make_app(tmp_path: Path, delay: float = 0.0, settings: ChatSettings = SETTINGS) -> LocalspecApp:
    backend = FakeBackend(delay=delay, memory="512 MiB RAM")
    return LocalspecApp(backend, settings, HistoryStore(tmp_path / "history"), run_pair=fake_pair)


async def settle(pilot) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


async def ask(pilot, text: str = "hi") -> None:
    await pilot.press(*text)
    await pilot.press("ctrl+j")


def shown(static: Static) -> str:
    """What a Static shows, as plain text."""
    console = Console(width=200, file=io.StringIO(), record=True)
    console.print(static.content)
    return console.export_text()


def answer_views(app) -> list[MessageView]:
    return [v for v in app.chat.query(MessageView) if v.message.role == "assistant"]


# -- history and the streaming turn, without a screen --------------------------------------------


def test_history_round_trip_and_runs(tmp_path):
    store = HistoryStore(tmp_path)
    conv = Conversation(title="t", system="be brief")
    answer = Message("assistant")
    engine = FakeEngine("ngram", "r", draft_len=3, delay=0)
    for event in engine.generate([{"role": "user", "content": "hi"}]):
        answer.extend(event.pieces)
    conv.messages = [Message("user", "hi"), answer]
    store.save(conv)
    assert answer.content == ANSWER
    assert sum(n for n, _ in answer.runs) == len(ANSWER) and {f for _, f in answer.runs} == {0, 1}
    (loaded,) = store.list()
    assert loaded == conv
    assert list(tmp_path.iterdir()) == [store.path(conv.id)]  # no temporary files left


def test_each_batch_is_on_disk_before_it_is_shown_and_stop_keeps_the_text(tmp_path, monkeypatch):
    monkeypatch.setattr(streaming, "BATCH_SECONDS", 0.0)
    store = HistoryStore(tmp_path)
    conv = Conversation(messages=[Message("user", "hi"), Message("assistant", partial=True)])
    stop = threading.Event()
    shown = []

    def deliver(batch):
        on_disk = store.load(conv.id).messages[-1]
        shown.append("".join(p.text for p in batch.pieces))
        assert on_disk.content == "".join(shown)
        if len(shown) == 3:
            stop.set()

    engine = FakeEngine("ngram", "r", draft_len=None, delay=0)
    streaming.stream_answer(engine, conv, SETTINGS, store, stop, deliver)
    answer = store.load(conv.id).messages[-1]
    assert 0 < len(answer.content) < len(ANSWER) and ANSWER.startswith(answer.content)
    assert answer.stop_reason == "stopped" and not answer.partial
    assert answer.stats["stop_reason"] == "stopped"


def test_disk_full_while_saving_history_keeps_the_answer_going_and_the_old_file_intact(tmp_path, monkeypatch):
    from localspec.base import files

    monkeypatch.setattr(streaming, "BATCH_SECONDS", 0.0)
    store = HistoryStore(tmp_path)
    conv = Conversation(messages=[Message("user", "hi"), Message("assistant", partial=True)])
    store.save(conv)
    before = store.path(conv.id).read_text()
    real_fdopen = files.os.fdopen

    def full_disk(fd, *args, **kw):
        out = real_fdopen(fd, *args, **kw)
        real_write = out.write

        def write(text):
            real_write(text[: len(text) // 2])  # part of the file is written, then the disk is full
            raise OSError(28, "No space left on device")

        out.write = write
        return out

    monkeypatch.setattr(files.os, "fdopen", full_disk)
    batches = []
    engine = FakeEngine("ngram", "r", draft_len=None, delay=0)
    streaming.stream_answer(engine, conv, SETTINGS, store, threading.Event(), batches.append)
    assert "".join(p.text for b in batches for p in b.pieces) == ANSWER  # the whole answer still streamed
    assert batches[-1].done and "No space left" in batches[-1].notice
    assert store.path(conv.id).read_text() == before  # the last good file is intact
    assert list(tmp_path.glob("*.tmp")) == []  # no partial files left behind


HOSTILE = {
    "list.json": "[]", "not-json.json": "{", "messages.json": '{"messages": 3}',
    "runs.json": '{"messages": [{"role": "user", "content": "x", "runs": [["a"]]}]}',
    "keys.json": '{"messages": [{"role": "user", "colour": "red"}]}', "title.json": '{"title": ["x"]}',
    "..json": '{"title": "dots"}',
}


def write_hostile_history(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in HOSTILE.items():
        (root / name).write_text(text)
    (root / "moved.json").write_text(json.dumps({"id": "../../escaped", "title": "[/x] moved", "messages": []}))


def test_history_files_of_another_shape_are_skipped_and_ids_never_leave_the_folder(tmp_path):
    store = HistoryStore(tmp_path / "history")
    write_hostile_history(store.root)
    (moved,) = store.list()  # only the one conversation-shaped file
    assert moved.id == "moved" and moved.title == "[/x] moved"  # the id is the file's name, not its content
    store.save(moved)
    assert sorted(p.name for p in tmp_path.rglob("*.json") if p.name not in HOSTILE) == ["moved.json"]
    for bad in ("..", "../x", "/etc/passwd", "a/b"):
        with pytest.raises(LocalspecError, match="not a valid name"):
            store.path(bad)
        with pytest.raises(LocalspecError):
            store.save(Conversation(id=bad))
    with pytest.raises(LocalspecError, match=r"cannot open the conversation in .*list\.json: not a conversation"):
        store.load("list")


async def test_the_chat_opens_with_malformed_history_and_shows_markup_characters_as_text(tmp_path):
    write_hostile_history(tmp_path / "history")
    app = make_app(tmp_path)
    markup = "[/x] [b]not bold[/b] [link=x]"
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await ask(pilot, markup)  # typed, answered, listed, shown in the status line
        await settle(pilot)
        assert app.history.list()[0].messages[0].content == markup
        await pilot.press("f2")
        screen = app.screen
        screen.query_one("#top_p").value = markup
        await pilot.click("#save")
        await pilot.pause()
        assert markup in shown(screen.query_one("#error", Static))
        await pilot.press("escape")

        def broken(settings, status):
            status(markup)
            raise LocalspecError(markup)

        app.backend.open = broken
        await pilot.press("ctrl+r")
        await settle(pilot)
        await pilot.pause(0.2)  # the notice is drawn
        assert any(markup in str(n.message) for n in app._notifications)
        assert app.is_running and app.return_code is None


async def test_the_panel_opens_with_the_model_its_weights_and_the_proposer_in_a_few_words(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        rows = [" ".join(line.split()) for line in shown(app.chat.query_one("#engine", Static)).splitlines() if line.strip()]
        assert rows == [f"model {MODEL}", "weights float32 · cpu", "proposer ngram · fake engine"]
        for part in (app.loaded.weights.short, app.loaded.proposer_choice.short):
            assert_at_a_glance(part)


def test_statistics_show_what_prompt_lookup_added_only_when_it_added_something():
    def text(stats) -> str:
        console = Console(width=200, file=io.StringIO(), record=True)
        console.print(StatsPanel().figures(stats, 0.0))
        return console.export_text()

    stats = GenerationStats(proposer="eagle", passes=10, new_tokens=40)
    assert "from lookup" not in text(stats)
    stats.lookup_accepted, stats.lookup_passes = 23, 4
    assert "from lookup 23 tokens (4 passes without the model)" in " ".join(text(stats).split())


# -- Pilot ---------------------------------------------------------------------------------------


async def test_type_send_and_see_the_answer_and_statistics(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await ask(pilot, "hi")
        await settle(pilot)
        (view,) = answer_views(app)
        assert view.message.content == ANSWER and view.message.stop_reason == "eos"
        assert "def reverse" in view.query_one(Markdown).source
        assert app.chat.query_one("#prompt", TextArea).text == ""
        figures = shown(app.chat.query_one("#figures", Static))
        assert "acceptance" in figures and "formula" in figures and "512 MiB RAM" in figures
        assert app.chat.query_one("#spark").data  # tokens per pass over time
        (saved,) = app.history.list()
        assert [m.role for m in saved.messages] == ["user", "assistant"] and saved.title == "hi"


async def test_escape_stops_the_answer_and_keeps_the_text(tmp_path):
    app = make_app(tmp_path, delay=0.1)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await ask(pilot)
        while not answer_views(app)[0].message.content:
            await pilot.pause(0.05)
        assert app.chat.generating
        await pilot.press("escape")
        await settle(pilot)
        (view,) = answer_views(app)
        assert not app.chat.generating
        assert 0 < len(view.message.content) < len(ANSWER) and view.message.stop_reason == "stopped"
        assert app.history.list()[0].messages[-1].content == view.message.content


async def test_switch_proposer_between_turns(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert app.loaded.proposer == "ngram"  # the fake engine's auto
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert app.loaded.proposer == "none" and app.settings.spec.proposer == "none"
        await ask(pilot)
        await settle(pilot)
        assert answer_views(app)[0].message.stats["drafted"] == 0
        await pilot.press("ctrl+r")  # round to the first the catalog offers
        await settle(pilot)
        assert app.loaded.proposer == "suffix"


async def test_settings_screen_changes_draft_length_and_rejects_bad_values(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await pilot.press("f2")
        screen = app.screen
        assert isinstance(screen, SettingsScreen)
        screen.query_one("#top_p").value = "2"
        await pilot.click("#save")
        assert app.screen is screen and "top-p" in shown(screen.query_one("#error", Static))
        await pilot.pause(0.3)  # a Button ignores clicks for 0.2 s after a press
        screen.query_one("#top_p").value = "0.9"
        screen.query_one("#draft_len").value = "2"
        screen.query_one("#system", TextArea).load_text("Answer in one line.")
        await pilot.click("#save")
        await settle(pilot)
        assert app.settings.spec.draft_len == 2 and app.settings.sampling.top_p == 0.9
        assert app.loaded.engine.draft_len == 2  # a new engine for the new draft length
        await ask(pilot)
        await settle(pilot)
        assert app.history.list()[0].system == "Answer in one line."


async def test_highlighting_shows_which_tokens_came_from_accepted_drafts(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await ask(pilot)
        await settle(pilot)
        (view,) = answer_views(app)
        provenance = view.query_one(".provenance", Static)
        assert provenance.styles.display == "none"
        await pilot.press("ctrl+t")
        assert app.chat.has_class("highlight")
        assert provenance.styles.display == "block" and view.query_one(Markdown).styles.display == "none"
        text = view.highlighted()
        assert provenance.content == text
        drafted = "".join(text.plain[s.start : s.end] for s in text.spans if str(s.style) == DRAFT_STYLE)
        assert 0 < len(drafted) < len(ANSWER)
        await pilot.press("ctrl+t")
        assert not app.chat.has_class("highlight")


async def test_new_chat_and_reload_a_past_conversation(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await ask(pilot, "first")
        await settle(pilot)
        first_id = app.chat.conversation.id
        await pilot.press("ctrl+n")
        await settle(pilot)
        assert not app.chat.query(MessageView)
        await ask(pilot, "second")
        await settle(pilot)
        listed = app.chat.query_one("#conversations")
        assert [item.name for item in listed.children][1] == first_id
        listed.index = 1
        listed.action_select_cursor()
        await settle(pilot)
        assert app.chat.conversation.id == first_id
        assert [v.message.content for v in app.chat.query(MessageView)][0] == "first"


async def test_model_picker_and_help(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        help_text = shown(app.screen.query_one("#keys", Static))
        assert "ctrl+j" in help_text and "Stop" in help_text
        await pilot.press("escape")
        await pilot.press("f3")
        # the side panel's few words, and one key away the model screen's full reasons
        loaded = app.loaded
        why = shown(app.screen.query_one("#why", Static))
        assert str(loaded.weights) in why and str(loaded.proposer_choice) in why
        names = list(app.backend.registry.models)
        target = names.index("qwen2.5-coder-0.5b")
        app.screen.query_one("#models").highlighted = target
        await pilot.press("enter")
        await settle(pilot)
        assert app.loaded.model == "qwen2.5-coder-0.5b"


async def test_a_load_failure_is_shown_and_the_app_keeps_running(tmp_path):
    app = make_app(tmp_path)

    def broken(settings, status):
        raise RuntimeError("out of memory")

    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        app.backend.open = broken
        await pilot.press("ctrl+r")
        await settle(pilot)
        assert app.loaded.proposer == "ngram" and app.settings.spec.proposer == "ngram"
        assert any("out of memory" in str(n.message) for n in app._notifications)


# -- the command line ----------------------------------------------------------------------------


def test_bare_localspec_opens_the_chat(monkeypatch):
    from localspec.apps import tui
    from localspec.apps.cli import main

    seen = []
    monkeypatch.setattr(tui, "run_chat", lambda settings, fake_engine, daemon, keep_alive: seen.append((settings, daemon)) or 0)
    assert main([]) == 0
    assert main(["chat", "--proposer", "ngram", "--temperature", "0.5", "--system", "be brief", "--daemon"]) == 0
    assert main(["chat", "--no-daemon"]) == 0
    assert [daemon for _, daemon in seen] == [None, True, False]
    seen = [settings for settings, _ in seen]
    assert seen[0] == ChatSettings()
    assert seen[1].spec.proposer == "ngram" and seen[1].sampling.temperature == 0.5 and seen[1].system == "be brief"


def test_chat_with_an_unknown_model_is_a_one_line_error(capsys):
    from localspec.apps.cli import main

    assert main(["chat", "--model", "no-such-model"]) == 2
    assert capsys.readouterr().err.strip().startswith("localspec: error: unknown model 'no-such-model'")


# -- killed mid-answer ---------------------------------------------------------------------------


def test_killing_the_app_mid_answer_keeps_the_partial_answer(tmp_path):
    """A real `localspec chat` under a pseudo-terminal, SIGKILLed while the answer streams."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    env = dict(os.environ, LOCALSPEC_HOME=str(tmp_path), TERM="xterm-256color")
    proc = subprocess.Popen(
        [sys.executable, "-m", "localspec", "chat", "--fake-engine", "--model", MODEL],
        stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True,
    )
    os.close(slave)
    screen = bytearray()

    def drain():  # the app blocks if nobody reads its terminal
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            screen.extend(chunk)

    threading.Thread(target=drain, daemon=True).start()
    store = HistoryStore(tmp_path / "history")
    try:
        deadline = time.monotonic() + 60
        while b"adaptive" not in screen:  # the status line appears once the engine is ready
            assert time.monotonic() < deadline and proc.poll() is None, screen[-2000:]
            time.sleep(0.05)
        os.write(master, b"hi")
        time.sleep(0.3)  # a key on its own, as a person types it
        os.write(master, b"\n")  # Ctrl+J: send
        while True:
            assert time.monotonic() < deadline and proc.poll() is None
            saved = store.list()
            if saved and saved[0].messages[-1].content:
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        os.close(master)
    (conv,) = store.list()
    user, answer = conv.messages
    assert user.content == "hi" and answer.partial
    assert 0 < len(answer.content) < len(ANSWER) and ANSWER.startswith(answer.content)


# -- SVG snapshots -------------------------------------------------------------------------------


def steady(pilot) -> None:
    """No blinking cursors in snapshots: the picture must not depend on the moment it is taken."""
    for screen in pilot.app.screen_stack:
        for widget in screen.query("Input, TextArea"):
            widget.cursor_blink = False


async def _answered(pilot) -> None:
    await settle(pilot)
    steady(pilot)
    pilot.app.chat.query_one("#prompt", TextArea).load_text("Write a Python function that reverses a string.")
    await pilot.press("ctrl+j")
    await settle(pilot)


def test_snapshot_chat_with_statistics(tmp_path, snap_compare):
    assert snap_compare(make_app(tmp_path), terminal_size=(150, 45), run_before=_answered)


def test_snapshot_statistics_with_highlighting(tmp_path, snap_compare):
    async def run_before(pilot):
        await _answered(pilot)
        await pilot.press("f5", "ctrl+t")
        steady(pilot)

    assert snap_compare(make_app(tmp_path), terminal_size=(150, 45), run_before=run_before)


def test_snapshot_settings(tmp_path, snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f2")
        steady(pilot)

    assert snap_compare(make_app(tmp_path), terminal_size=(150, 45), run_before=run_before)


def test_snapshot_help(tmp_path, snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f1")
        steady(pilot)

    assert snap_compare(make_app(tmp_path), terminal_size=(150, 45), run_before=run_before)


def test_snapshot_model_screen(tmp_path, snap_compare):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.press("f3")
        steady(pilot)

    assert snap_compare(make_app(tmp_path), terminal_size=(150, 45), run_before=run_before)


def _wizard_measured(memory: float = 8e9):
    async def run_before(pilot):
        await settle(pilot)
        await pilot.app.push_screen(WizardScreen(pilot.app.backend.registry, int(memory), fake_pair))
        await pilot.click("#measure")
        await settle(pilot)

    return run_before


async def test_wizard_measures_and_loads_the_winner(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await pilot.press("f8")  # the wizard, sized to this machine's free memory
        await pilot.pause()
        await pilot.click("#measure")
        await settle(pilot)
        wizard = app.screen
        assert isinstance(wizard, WizardScreen) and wizard.paired == wizard.targets[0].name
        log = "\n".join(str(line) for line in wizard.query_one("#wizard-log").lines)
        assert "ngram 41.00 tok/s" in log and "saved:" in log
        await pilot.press("escape")
        await settle(pilot)
        # closing loads the paired model with the automatic proposer, which prefers the saved pairing
        assert app.settings.model == wizard.targets[0].name


async def test_wizard_shows_errors_without_closing(tmp_path):
    def broken_pair(target, say):
        raise RuntimeError("no network")

    app = make_app(tmp_path)
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        await app.push_screen(WizardScreen(app.backend.registry, int(8e9), broken_pair))
        await pilot.click("#measure")
        await settle(pilot)
        assert isinstance(app.screen, WizardScreen) and app.screen.paired is None
        assert "error: RuntimeError: no network" in "\n".join(str(line) for line in app.screen.query_one("#wizard-log").lines)


def test_snapshot_wizard(tmp_path, snap_compare):
    assert snap_compare(make_app(tmp_path), terminal_size=(150, 45), run_before=_wizard_measured())


# -- the real model ------------------------------------------------------------------------------


@pytest.mark.real_model
async def test_chat_with_smollm2(tmp_path):
    from localspec.store.session import open_session

    session = open_session(MODEL, "ngram", "float32", quiet=True)
    settings = ChatSettings(model=MODEL, dtype="float32", spec=SpecConfig(proposer="ngram"),
                            limits=GenerationLimits(max_new_tokens=32))
    app = LocalspecApp(SessionBackend(session=session), settings, HistoryStore(tmp_path / "history"))
    async with app.run_test(size=(150, 45)) as pilot:
        await settle(pilot)
        assert app.loaded.proposer == "ngram" and app.loaded.model == MODEL
        await ask(pilot, "Say hello")
        await settle(pilot)
        (view,) = answer_views(app)
        stats = view.message.stats
        assert view.message.content.strip() and stats["new_tokens"] > 0 and stats["passes"] > 0
        assert json.loads(app.history.path(app.chat.conversation.id).read_text())["messages"][1]["content"]
        assert "tok/s" in shown(app.chat.query_one(StatsPanel).query_one("#figures", Static))


def test_an_in_process_chat_answer_is_recorded_by_the_session_once_it_is_finished():
    """The chat's answers reach the session's record (the machine's history, the pass-cost check)
    as the CLI's and the server's do; the events pass through unchanged."""
    from localspec.apps.tui.backend import Recorded
    from localspec.core.events import FinalEvent, TokenEvent
    from localspec.core.stats import GenerationStats

    final = FinalEvent(stats=GenerationStats(new_tokens=3))
    events = [TokenEvent(), TokenEvent(), final]

    class Engine:
        def generate(self, prompt, sampling, limits, system=None):
            yield from events

    recorded = []
    chat = Recorded(Engine(), recorded.append)
    stream = chat.generate("hi", None, None)
    assert [next(stream), next(stream)] == events[:2] and not recorded
    assert next(stream) is final
    assert list(stream) == [] and recorded == [final.stats]
