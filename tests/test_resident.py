"""The resident engine: `localspec run` and `chat` answered by a running `localspec serve` exactly as
in-process, its queue, its key, its keep-alive, and what a client does when it is gone."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import asdict

import httpx
import pytest

from conftest import tiny_model
from localspec.apps import resident
from localspec.apps.cli import build_parser, main, spec_from
from localspec.apps.resident import EngineLost, EngineRecord, ResidentEngine, find_engine, parse_duration, serve_args
from localspec.apps.serve.app import create_app
from localspec.apps.serve.config import ServeConfig
from localspec.apps.serve.turns import Served
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig, home_dir
from localspec.base.errors import LocalspecError
from localspec.core.engine import Engine
from localspec.core.proposers import DraftModelProposer, NgramProposer
from test_server import ChatCharTokenizer, Gated, http_server, wait_for

REAL_HOME = home_dir()
"""Where the real models are (each test here gets a home of its own)."""
KEY = "test-engine-key"
DETAILS = {"model": "tiny", "summary": "tiny", "proposer": "ngram", "reason": "", "weights_choice": "float32 weights (why)",
           "weights_short": "float32", "proposer_choice": "ngram proposer: no draft (why)", "proposer_short": "ngram"}
GREEDY = SamplingConfig()
PROMPT = [{"role": "user", "content": "abcdabcdabcd say abcd"}]


@pytest.fixture(autouse=True)
def own_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    monkeypatch.delenv(resident.DAEMON_SETTING, raising=False)


def engines() -> dict[str, Engine]:
    """An engine per proposer kind (made afresh: a served one and an in-process one start alike)."""
    target = tiny_model("llama", seed=0)
    spec = SpecConfig(draft_len=3)
    return {
        "none": Engine(target, ChatCharTokenizer(), None, spec),
        "ngram": Engine(target, ChatCharTokenizer(), NgramProposer(), spec),
        "draft": Engine(target, ChatCharTokenizer(), DraftModelProposer(tiny_model("llama", seed=2)), spec),
    }


@contextmanager
def engine_at(engine, config: ServeConfig = ServeConfig(), loads: list | None = None):
    """`engine` served on real HTTP with the resident routes, and the record a client finds it by."""

    def load() -> Served:
        if loads is not None:
            loads.append(1)
        return Served("tiny", engine, "tiny engine", DETAILS | {"proposer": engine.proposer_name})

    app = create_app(load, config, engine_key=KEY)
    with http_server(app) as url:
        yield EngineRecord(os.getpid(), url, KEY, "tiny", "auto", {}), app.state.service


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
@pytest.mark.parametrize("sampling", [GREEDY, SamplingConfig(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_every_proposers_answer_through_the_engine_is_the_in_process_one(proposer, sampling):
    limits = GenerationLimits(24)
    local = list(engines()[proposer].generate(PROMPT, sampling, limits))
    with engine_at(engines()[proposer]) as (record, _):
        remote = ResidentEngine(record)
        received = list(remote.generate(PROMPT, sampling, limits))
    assert [e.pieces for e in received] == [e.pieces for e in local]  # text, ids, and which tokens were drafted
    assert [e.figures.drafted for e in received] == [e.figures.drafted for e in local]
    local_stats, remote_stats = local[-1].stats, received[-1].stats
    assert (remote_stats.new_tokens, remote_stats.accepted, remote_stats.passes, remote_stats.stop_reason) == \
        (local_stats.new_tokens, local_stats.accepted, local_stats.passes, local_stats.stop_reason)
    assert remote.about["proposer"] == engines()[proposer].proposer_name


def test_a_second_client_waits_its_turn_and_both_get_their_whole_answers():
    gated = Gated(engines()["ngram"])
    expected = "".join(e.text for e in engines()["ngram"].generate(PROMPT, GREEDY, GenerationLimits(12)))
    with engine_at(gated) as (record, service):
        gated.held = True
        said, texts = [], {}

        def ask(name: str) -> None:
            events = ResidentEngine(record, say=said.append).generate(PROMPT, GREEDY, GenerationLimits(12))
            texts[name] = "".join(e.text for e in events)

        first = threading.Thread(target=ask, args=("first",))
        first.start()
        wait_for(lambda: service.current is not None)
        second = threading.Thread(target=ask, args=("second",))
        second.start()
        wait_for(lambda: said)
        assert said == ["waiting for the resident engine: 1 answer ahead"]
        gated.held = False
        for _ in range(64):
            gated.go.release()
        first.join(30), second.join(30)
    # the second turn continues the first's cache, so compare text only
    assert texts == {"first": expected, "second": expected}


def test_only_the_key_in_this_users_engine_file_opens_the_engine(tmp_path):
    with engine_at(engines()["ngram"]) as (record, _):
        body = {"prompt": "hi", "limits": {"max_new_tokens": 2}}
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            answer = httpx.post(record.url + "/localspec/v1/generate", json=body, headers=headers)
            assert answer.status_code == 401 and "engine key" in answer.json()["error"]["message"]
        assert httpx.get(record.url + "/localspec/v1/engine", headers={"Authorization": f"Bearer {KEY}"}).json()["loaded"]
    resident.write_record(record)
    if os.name == "posix":
        assert stat.S_IMODE(resident.engine_file().stat().st_mode) == 0o600


def test_a_server_that_is_not_the_resident_engine_refuses_the_private_routes():
    app = create_app(lambda: Served("tiny", engines()["ngram"]), ServeConfig())
    with http_server(app) as url:
        answer = httpx.post(url + "/localspec/v1/generate", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {KEY}"})
    assert answer.status_code == 403


def test_a_stopped_engines_file_is_removed_with_one_line():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    resident.write_record(EngineRecord(int(gone.stdout), "http://127.0.0.1:9", KEY, "tiny", "auto", {}))
    said = []
    assert find_engine(said.append) is None and not resident.engine_file().exists()
    assert len(said) == 1 and "was stopped" in said[0]
    resident.engine_file().write_text("{half a file")
    assert find_engine(said.append) is None and not resident.engine_file().exists()


def test_the_keep_alive_unloads_the_model_and_the_next_request_loads_it_again():
    loads, unloaded = [], []
    expected = "".join(e.text for e in engines()["ngram"].generate(PROMPT, GREEDY, GenerationLimits(8)))
    with engine_at(engines()["ngram"], ServeConfig(keep_alive=0.5), loads) as (record, service):
        service.on_unload = lambda: unloaded.append(1)
        first = "".join(e.text for e in ResidentEngine(record).generate(PROMPT, GREEDY, GenerationLimits(8)))
        wait_for(lambda: service.unloaded)
        assert httpx.get(record.url + "/health").status_code == 200 and unloaded
        loaded_before, said = len(loads), []
        again = "".join(e.text for e in ResidentEngine(record, say=said.append).generate(PROMPT, GREEDY, GenerationLimits(8)))
        assert len(loads) == loaded_before + 1 and said == ["the resident engine is loading tiny"]
    assert first == again == expected


def test_an_engine_that_dies_mid_answer_is_an_engine_lost():
    """A server that sends the start of an answer, then closes the connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    start = json.dumps({"type": "start", "about": {"model": "tiny"}}) + "\n"

    def answer_then_die() -> None:
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n\r\n"
                           + f"{len(start):x}\r\n{start}\r\n".encode())
        connection.close()

    threading.Thread(target=answer_then_die, daemon=True).start()
    record = EngineRecord(os.getpid(), f"http://127.0.0.1:{listener.getsockname()[1]}", KEY, "tiny", "auto", {})
    with pytest.raises(EngineLost, match="stopped mid-answer"):
        list(ResidentEngine(record).generate("hi"))
    listener.close()
    with pytest.raises(EngineLost, match="does not answer"):
        list(ResidentEngine(record).generate("hi"))


def test_run_answers_through_a_matching_engine_and_falls_back_when_it_dies(capsys, monkeypatch):
    from localspec.store import session

    made = []

    def open_tiny(model, proposer, dtype, spec, quiet=False, registry=None):
        from test_cli import PROPOSER, WEIGHTS
        import torch

        from conftest import CharTokenizer
        from localspec.runtime.costs import CostModel
        from localspec.store.loading import LoadedModel
        from localspec.store.registry import load_registry

        registry = load_registry()
        target = LoadedModel("smollm2-135m", tiny_model(), CharTokenizer(), torch.float32, torch.device("cpu"), 512, 0.0, False)
        opened = session.Session(registry.get("smollm2-135m"), registry, target, None, WEIGHTS)
        opened.engine = session.make_engine(target, None, "ngram", spec, PROPOSER, CostModel({1: 0.01, 16: 0.02}))
        opened.proposer, opened.reason = "ngram", PROPOSER
        made.append(opened)
        return opened

    monkeypatch.setattr(session, "open_session", open_tiny)
    argv = ["run", "abcabcabc", "--model", "smollm2-135m", "--max-new-tokens", "6", "--json"]
    assert main([*argv, "--no-daemon"]) == 0
    in_process = json.loads(capsys.readouterr().out)
    served = open_tiny("smollm2-135m", "auto", "auto", SpecConfig())
    app = create_app(lambda: Served("smollm2-135m", served.engine, served.summary, served.details()), engine_key=KEY)
    with http_server(app) as url:
        resident.write_record(EngineRecord(os.getpid(), url, KEY, "smollm2-135m", "auto", asdict(SpecConfig())))
        assert main(argv) == 0
        through = json.loads(capsys.readouterr().out)
        assert main([*argv[:-1], "--draft-len", "2"]) == 0  # other options: in-process, said
        assert "with other options; answering in-process" in capsys.readouterr().err
    assert through["settings"]["engine"] == f"resident (pid {os.getpid()})" and in_process["settings"]["engine"] == "in-process"
    assert through["text"] == in_process["text"] and through["stats"]["new_tokens"] == in_process["stats"]["new_tokens"]
    assert {k: v for k, v in through["settings"].items() if k != "engine"} == \
        {k: v for k, v in in_process["settings"].items() if k != "engine"}
    # the engine is gone now, its file left behind: the next run says so once and answers in-process
    opened_before = len(made)
    assert main(argv[:-1]) == 0
    out, err = capsys.readouterr()
    assert "removed the file of a resident engine that was stopped" in err and len(made) == opened_before + 1
    assert not resident.engine_file().exists()


def test_the_chat_opens_on_a_resident_engine_running_its_model_and_streams_from_it():
    from localspec.apps.tui.backend import ChatSettings, ResidentBackend, SessionBackend
    from localspec.apps.tui.history import Conversation, HistoryStore, Message
    from localspec.apps.tui.streaming import stream_answer

    local_opens = []

    class Local(SessionBackend):
        def open(self, settings, status):
            local_opens.append(settings)
            raise LocalspecError("loaded in-process")

    expected = "".join(e.text for e in engines()["ngram"].generate(PROMPT, GREEDY, GenerationLimits(10)))
    backend = ResidentBackend(Local())
    with engine_at(engines()["ngram"]) as (record, _):
        resident.write_record(EngineRecord(os.getpid(), record.url, KEY, "smollm2-135m", "auto", asdict(SpecConfig())))
        statuses = []
        loaded = backend.open(ChatSettings(model="smollm2-135m", limits=GenerationLimits(10)), statuses.append)
        assert not local_opens and loaded.proposer == "ngram" and loaded.weights.short == "float32 · resident engine"
        assert "MiB RAM in the resident engine" in loaded.memory()
        conversation = Conversation(model="smollm2-135m", messages=[Message("user", PROMPT[0]["content"]), Message("assistant")])
        batches = []
        stream_answer(loaded.engine, conversation, ChatSettings(model="smollm2-135m", limits=GenerationLimits(10)),
                      HistoryStore(home_dir() / "chats"), threading.Event(), batches.append)
        assert batches[-1].done and not batches[-1].error and batches[-1].stats.new_tokens == 10
        assert "".join(p.text for b in batches for p in b.pieces) == expected
        # a proposer chosen in the chat is not what the engine runs: that one loads here
        with pytest.raises(LocalspecError, match="loaded in-process"):
            backend.open(ChatSettings(model="smollm2-135m", spec=SpecConfig(proposer="none")), statuses.append)
        assert len(local_opens) == 1


def test_the_engine_is_started_with_the_commands_own_options(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "docs").mkdir()
    spec = SpecConfig(proposer="draft", draft_len=4, max_draft_len=9, ngram_min=2, ngram_max=5, draft_quant="int8",
                      tree_top_k=3, tree_nodes=20, tree_depth=4, lookup=False, quant="w8a8", history=False,
                      context=(str((tmp_path / "a.py").resolve()), str((tmp_path / "docs").resolve())))
    for each in (spec, SpecConfig()):
        args = build_parser().parse_args(["serve", *serve_args(each)])
        assert spec_from(args, args.proposer) == each


def test_keep_alive_durations():
    assert [parse_duration(d) for d in ("30s", "5m", "1h", "0", "2.5", "forever", "-1")] == [30, 300, 3600, 0, 2.5, None, None]
    for bad in ("soon", "-5m", "", "m"):
        with pytest.raises(LocalspecError, match="--keep-alive"):
            parse_duration(bad)


@pytest.mark.real_model
def test_run_daemon_starts_an_engine_the_next_run_finds_warm(capsys):
    """A real `localspec serve` in the background: the second prompt is answered by it, with the
    text an in-process run gives; killed, it leaves a file the next run cleans up."""
    (home_dir() / "models").mkdir(parents=True)
    os.symlink(REAL_HOME / "models" / "smollm2-135m", home_dir() / "models" / "smollm2-135m")
    if (REAL_HOME / "calibration.json").exists():  # what earlier tests measured need not be measured again
        shutil.copy(REAL_HOME / "calibration.json", home_dir())
    argv = ["run", "List three colours.", "--model", "smollm2-135m", "--max-new-tokens", "12", "--json"]
    assert main([*argv, "--no-daemon"]) == 0
    in_process = json.loads(capsys.readouterr().out)
    try:
        assert main([*argv, "--daemon", "--keep-alive", "2m"]) == 0
        first = json.loads(capsys.readouterr().out)
        record = find_engine()
        assert record is not None and first["settings"]["engine"] == f"resident (pid {record.pid})"
        assert main(argv) == 0  # without --daemon: the engine that runs answers
        second = json.loads(capsys.readouterr().out)
        assert first["text"] == second["text"] == in_process["text"]
        assert second["settings"]["engine"] == first["settings"]["engine"]
    finally:
        if (record := find_engine()) is not None:
            os.kill(record.pid, 9)
    assert main(argv[:-1]) == 0  # the killed engine's file: removed, and the answer comes in-process
    assert "removed the file of a resident engine" in capsys.readouterr().err
    assert not resident.engine_file().exists()
