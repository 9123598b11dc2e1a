"""The CLI turns every user mistake into one clear line on stderr and exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from localspec.apps.cli import main


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


def test_models_lists_the_registry(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b" in out and "(default)" in out and "smollm2-135m" in out
