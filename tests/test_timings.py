"""`localspec run --timings`: the phases' own times (base.timings), and what a CPU run reports and imports."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from localspec.base import timings


@pytest.fixture
def recorder(monkeypatch):
    monkeypatch.setattr(timings, "_spent", {})
    monkeypatch.setattr(timings, "_inner", [])


def test_a_phase_inside_another_counts_once_and_repeats_add_up(recorder):
    with timings.phase("target_load"):
        time.sleep(0.05)
        with timings.phase("tokenizer"):
            time.sleep(0.1)
    with timings.phase("tokenizer"):
        time.sleep(0.02)
    timings.record("prefill", 0.5)
    seconds = timings.breakdown()
    assert 0.05 <= seconds["target_load"] < 0.1 and 0.12 <= seconds["tokenizer"] < 0.2
    assert seconds["prefill"] == 0.5 and seconds["draft_load"] == 0.0
    assert list(seconds) == [*timings.PHASES, "other", "total"]
    assert sum(v for k, v in seconds.items() if k != "total") == pytest.approx(seconds["total"])
    assert timings.summary(seconds).startswith("timings: imports ")


def test_a_misspelt_phase_is_refused_rather_than_hidden_under_other(recorder):
    with pytest.raises(ValueError):
        with timings.phase("tokeniser"):
            pass
    with pytest.raises(ValueError):
        timings.record("decoding", 1.0)


def test_the_time_since_the_process_started_is_within_what_its_parent_saw():
    """Python's own start is part of `imports`: read from the operating system, to within its clock
    ticks. Read through the boot time in whole seconds it was up to a second over the process's
    whole life (a 0.2 s client start showed as 1.1 s)."""
    for _ in range(3):
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.3); from localspec.base import timings; "
                               "print(timings.since_process_start())"], capture_output=True, text=True, timeout=60)
        wall = time.perf_counter() - started
        assert proc.returncode == 0, proc.stderr
        assert 0.29 <= float(proc.stdout) <= wall + 0.02


RUN = """
import json, sys
from localspec.apps.cli import main
code = main(["run", "List three colours.", "--model", "smollm2-135m", "--proposer", "ngram", "--max-new-tokens", "8",
             "--json", "--timings"])
json.dump(sorted(sys.modules), open(sys.argv[1], "w"))
sys.exit(code)
"""

NOT_FOR_A_RUN = ("textual", "starlette", "uvicorn", "localspec.apps.tui", "localspec.apps.serve", "localspec.apps.bench",
                 "localspec.apps.pairing", "localspec.apps.train_eagle", "localspec.core.proposers.eagle")
"""Modules of other commands and proposers, which a one-shot with prompt lookup has no use for."""


@pytest.mark.real_model
def test_a_cpu_run_reports_every_phase_within_its_wall_clock_and_imports_only_what_it_uses(tmp_path):
    modules = tmp_path / "modules.json"
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", RUN, str(modules)], capture_output=True, timeout=1200)
    wall = time.time() - started
    assert proc.returncode == 0, proc.stderr.decode()
    seconds = json.loads(proc.stdout)["timings"]
    assert list(seconds) == [*timings.PHASES, "other", "total"]
    assert all(v >= 0 for v in seconds.values())
    assert sum(v for k, v in seconds.items() if k != "total") <= seconds["total"] + 1e-6 <= wall + 1e-6
    assert seconds["imports"] > 0 and seconds["target_load"] > 0 and seconds["prefill"] > 0
    loaded = set(json.loads(modules.read_text()))
    assert not {m for m in loaded for unused in NOT_FOR_A_RUN if m == unused or m.startswith(unused + ".")}
