"""A busy machine: the thread pool is sized to the cores other programs leave free (a real busy
loop in another process takes one), and given back when they are free again."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from localspec.store import machine


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(machine.THREADS < 2, reason="one core: nothing to leave to another program")
def test_a_busy_loop_in_another_process_takes_one_core_from_the_pool(threads):
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # the loop is running
        said = []
        assert machine.fit_threads(said.append) == torch.get_num_threads() < machine.THREADS
        assert said and "cores busy" in said[0]
    finally:
        loop.kill()
        loop.wait()


def test_the_pool_follows_the_free_cores_and_says_so_only_when_it_changes(threads, monkeypatch):
    said = []
    for free, expected in ((machine.THREADS, 0), (1, 1), (1, 1), (machine.THREADS, 2)):
        monkeypatch.setattr(machine, "free_cores", lambda free=free, load=None: free)
        assert machine.fit_threads(said.append) == free == torch.get_num_threads()
        assert len(said) == (expected if machine.THREADS > 1 else 0)
    if machine.THREADS > 1:
        assert "runs on 1 thread" in said[0] and "quiet again" in said[1]


def test_a_session_sizes_the_pool_before_it_times_or_loads_anything(threads, monkeypatch):
    from localspec.base.errors import LocalspecError
    from localspec.store import session

    monkeypatch.setattr(machine, "free_cores", lambda load=None: 1)
    seen = []

    def load_models(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise LocalspecError("stopped here")

    monkeypatch.setattr(session, "load_models", load_models)
    with pytest.raises(LocalspecError, match="stopped here"):
        session.open_session("smollm2-135m", "none", quiet=True)
    assert seen == [1]


def test_the_load_of_other_processes_is_measured_beside_our_own_work():
    load = machine.OthersLoad()
    spin = time.monotonic() + 0.5
    while time.monotonic() < spin:  # this process's own work is not another program's
        pass
    assert load.cores() < 0.5
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        load = machine.OthersLoad()
        time.sleep(1.0)
        assert load.cores() > 0.6
    finally:
        loop.kill()
        loop.wait()


def test_a_calibration_beside_a_busy_loop_is_not_kept_though_its_passes_agree(tmp_path, monkeypatch):
    """A steady load slows every repeat alike, so the passes agree; the other process's load tells."""
    from conftest import tiny_model
    from localspec.runtime import costs
    from localspec.store import measurements

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(measurements, "_BUSY_SAID", set())

    def steady_passes(model, widths, context):
        time.sleep(0.4)  # while the loop runs beside
        return {w: [0.02 * w] * 4 for w in widths}

    monkeypatch.setattr(costs, "time_passes", steady_passes)
    said = []
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert measurements.measured_costs("tiny", tiny_model("llama"), (1, 2), say=said.append) == {1: 0.02, 2: 0.04}
    finally:
        loop.kill()
        loop.wait()
    assert not measurements.load_calibrations() and len(said) == 1 and "busy" in said[0]
    assert measurements.measured_costs("tiny", tiny_model("llama"), (1, 2), say=said.append) == {1: 0.02, 2: 0.04}
    assert measurements.load_calibrations(), "the same passes on a quiet machine are kept"


def test_between_turns_the_load_since_the_last_answer_sizes_the_pool_without_a_wait(threads):
    """A turn's look at the machine is what other programs did while the engine was idle: no
    sample of its own (which would add its wait to every answer's first token)."""
    if machine.THREADS < 2:
        pytest.skip("one core: nothing to leave to another program")
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        idle = machine.OthersLoad()
        time.sleep(1.0)  # between two answers
        started = time.monotonic()
        assert machine.fit_threads(lambda line: None, idle) < machine.THREADS
        assert time.monotonic() - started < 0.1
    finally:
        loop.kill()
        loop.wait()
