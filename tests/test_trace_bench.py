"""`bench --trace`: the trace file, and a replay through a real HTTP server that resends the
conversation each turn and folds the server's figures."""

from __future__ import annotations

import json

import pytest

from localspec.apps.serve.app import create_app
from localspec.apps.serve.turns import Served
from localspec.apps.trace_bench import load_trace, passes_of, replay, summary
from localspec.base.errors import LocalspecError
from localspec.core.engine import Engine
from localspec.core.proposers.suffix import SuffixProposer
from localspec.base.config import SpecConfig
from conftest import tiny_model
from test_server import ChatCharTokenizer, http_server


def test_the_shipped_trace_quotes_real_source_and_has_two_conversations():
    trace = load_trace("edit-session")
    assert len(trace) >= 2 and sum(len(c["turns"]) for c in trace) >= 5
    first = trace[0]["turns"][0]
    assert "def dedent(text):" in first and "{source:" not in first


@pytest.mark.parametrize("content, complaint", [
    ("not json", "cannot read it as JSON"),
    ("[]", "non-empty JSON list"),
    ('[{"turns": []}]', "non-empty list of user turns"),
    ('[{"turns": ["hi"], "system": 3}]', "system prompt must be a string"),
    ('[{"turns": ["{source:no_such_module.thing}"]}]', "cannot read the source of no_such_module.thing"),
    ('[{"turns": ["{source:json.no_such_function}"]}]', "cannot read the source of json.no_such_function"),
])
def test_a_file_that_is_not_a_trace_gives_one_line(tmp_path, content, complaint):
    path = tmp_path / "trace.json"
    path.write_text(content)
    with pytest.raises(LocalspecError, match=complaint):
        load_trace(str(path))


def test_a_replay_resends_the_conversation_and_reads_the_servers_figures(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps([{"name": "a", "turns": ["abcabcabc", "again abcabc"]},
                                {"name": "b", "system": "be brief", "turns": ["{source:shlex.quote}"]}]))
    trace = load_trace(str(path))
    assert "def quote(" in trace[1]["turns"][0]
    engine = Engine(tiny_model("llama", seed=0), ChatCharTokenizer(), SuffixProposer(), SpecConfig(draft_len=3))
    seen: list[list[int]] = []
    generate = engine.generate

    def recording(prompt, *args, **kwargs):
        seen.append(list(prompt))
        return generate(prompt, *args, **kwargs)

    engine.generate = recording
    with http_server(create_app(lambda: Served("tiny", engine))) as url:
        turns = replay(int(url.rsplit(":", 1)[1]), trace, 12, "tiny", lambda line: None)
    assert [(t["conversation"], t["turn"]) for t in turns] == [("a", 1), ("a", 2), ("b", 1)]
    assert all(t["tokens"] == 12 and t["seconds"] > 0 and t["tokens_per_pass"] >= 1 for t in turns)
    # the second turn's prompt is the first turn's prompt, its answer and the new turn
    first_turn = ChatCharTokenizer().decode(seen[0])
    assert ChatCharTokenizer().decode(seen[1]).startswith(first_turn + turns[0]["text"])
    assert ChatCharTokenizer().decode(seen[2]).startswith("<system>be brief")
    total = summary(turns)
    assert total["tokens"] == 36 and total["tokens_per_second"] > 0


def test_tokens_per_pass_from_either_servers_timings():
    ours = passes_of({"passes": 4, "draft_n": 9, "draft_n_accepted": 8, "history_n_accepted": 5}, 12)
    assert ours == {"tokens_per_pass": 3.0, "drafted": 9, "accepted": 8, "history_accepted": 5}
    theirs = passes_of({"predicted_n": 12, "draft_n": 10, "draft_n_accepted": 6}, 12)  # llama-server: no pass count
    assert theirs["tokens_per_pass"] == 2.0 and theirs["history_accepted"] == 0
