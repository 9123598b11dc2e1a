"""The CLI turns every user mistake into one clear line on stderr and exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from localspec.apps.cli import main
from localspec.base.reasons import Reason


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", ""], "the prompt is empty"),
        (["run", "hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["run", "hi", "--temperature", "-1"], "--temperature must be between 0 and 100"),
        (["run", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["run", "hi", "--top-k", "-3"], "--top-k must be 0 (off) or a positive integer"),
        (["run", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
        (["run", "hi", "--draft-len", "500"], "--draft-len must be between 0 and 64"),
        (["bench", "--model", "nope"], "unknown model 'nope'"),
        (["bench", "--model", "smollm2-135m", "--prompts", "/nonexistent.json"], "cannot read prompt file"),
    ],
)
def test_bad_input_gives_one_line_error(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("localspec: error:") and message in err
    assert "\n" not in err and "Traceback" not in err


def test_non_utf8_stdin_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "localspec", "run", "-"], input=b"\xff\xfe bad", capture_output=True, timeout=120
    )
    assert proc.returncode == 2
    assert b"not valid UTF-8" in proc.stderr and b"Traceback" not in proc.stderr


def test_the_parser_help_and_models_answer_without_torch():
    """A resident engine's client answers from the CLI within half a second: nothing it runs before
    a model loads may import torch (seconds), nor transformers or numpy."""
    check = ("import contextlib, io, sys\n"
             "from localspec.apps.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()): main(['models'])\n"
             "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()): main(['run', '--help'])\n"
             "print(sorted({'torch', 'transformers', 'numpy'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_models_lists_the_registry(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b" in out and "(default)" in out and "smollm2-135m" in out


# -- what a person sees first -------------------------------------------------------------------

WEIGHTS = Reason("the file's own 4-bit weights (its wider ones in bf16): nothing re-quantized", "int4 · file's own 4-bit")
PROPOSER = Reason("prompt lookup needs no extra model (no registered draft)", "no draft registered")


@pytest.fixture
def opened(tmp_path, monkeypatch):
    """`localspec run`'s session: a tiny model running prompt lookup, with the reasons above."""
    import torch

    from conftest import CharTokenizer, tiny_model
    from localspec.base.config import SpecConfig
    from localspec.runtime.costs import CostModel
    from localspec.store import session
    from localspec.store.loading import LoadedModel
    from localspec.store.registry import load_registry

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    registry = load_registry()
    target = LoadedModel("smollm2-135m", tiny_model(), CharTokenizer(), torch.float32, torch.device("cpu"), 512, 0.0, False)
    made = session.Session(registry.get("smollm2-135m"), registry, target, None, WEIGHTS)
    made.engine = session.make_engine(target, None, "ngram", SpecConfig(), PROPOSER, CostModel({1: 0.01, 16: 0.02}))
    made.proposer, made.reason = "ngram", PROPOSER
    monkeypatch.setattr(session, "open_session", lambda *args, **kwargs: made)
    return made


def test_the_first_line_says_model_weights_and_proposer_in_a_few_words(opened, capsys):
    from conftest import assert_at_a_glance

    assert main(["run", "hi", "--max-new-tokens", "3"]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first == "localspec: smollm2-135m; int4 · file's own 4-bit · cpu; ngram · no draft registered"
    for part in first.removeprefix("localspec: ").split("; "):
        assert_at_a_glance(part)


def test_verbose_adds_the_full_reasons_under_the_first_line(opened, capsys):
    assert main(["run", "hi", "--max-new-tokens", "3", "--verbose"]) == 0
    first, weights, proposer = capsys.readouterr().err.splitlines()[:3]
    assert first == "localspec: smollm2-135m; int4 · file's own 4-bit · cpu; ngram · no draft registered"
    assert weights == f"localspec: weights: {WEIGHTS}, on cpu"
    assert proposer == f"localspec: ngram proposer: {PROPOSER}"


def test_json_has_the_full_reasons_and_the_short_forms(opened, capsys):
    import json

    assert main(["run", "hi", "--max-new-tokens", "3", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    settings = result["settings"]
    assert settings["dtype_reason"] == WEIGHTS and result["stats"]["reason"] == PROPOSER, "the full texts, as before"
    assert settings["device"] == "cpu"
    assert settings["weights_short"] == "int4 · file's own 4-bit · cpu"
    assert settings["proposer_short"] == "ngram · no draft registered"
    assert err == "", "--json prints nothing before the answer"


def test_the_servers_ready_line_has_the_same_few_words(opened):
    from localspec.apps.serve.app import session_loader
    from localspec.base.config import SpecConfig

    served = session_loader("smollm2-135m", "auto", "auto", SpecConfig())()
    assert served.about == "int4 · file's own 4-bit · cpu; ngram · no draft registered"
