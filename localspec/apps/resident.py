"""The resident engine, from a client's side: where this home's engine is, whether it is alive and
serves what a command asks for, an engine-like object that streams its events, and starting one
in the background (`localspec run --daemon`).

The engine is `localspec serve` itself (`apps/serve/resident.py` answers these clients). Once it
listens it writes `engine.json` in localspec's home, readable by this user only (a private
temporary file renamed into place), with its loopback address, process id, what it loaded and a
random key that its private routes (/localspec/v1/...) require: another user cannot read the key,
so cannot use the engine. A file whose process is gone, or that no longer answers, was left by an
engine that was killed: the next client or server removes it.

Torch-free, with the standard library's HTTP client: a one-shot through a warm engine starts in a
fraction of a second.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig, home_dir
from localspec.base.errors import LocalspecError
from localspec.base.files import locked, write_text_atomic
from localspec.core.events import TokenEvent, from_wire

DAEMON_SETTING = "LOCALSPEC_DAEMON"
"""1: `localspec run` and `chat` start a resident engine when none runs (as --daemon); 0: they never
use one (as --no-daemon); unset: they use one that is running."""

STARTUP_SECONDS = 120.0
"""How long a client waits for an engine it started to listen (imports and a first build of the
kernels, not the model load: that streams its own progress)."""


class EngineLost(LocalspecError):
    """The engine stopped answering (killed, crashed) before the answer was complete."""


@dataclass(frozen=True)
class EngineRecord:
    """What `engine.json` says about the engine serving this home."""

    pid: int
    url: str
    """http://127.0.0.1:PORT (or the host it was told to listen on)."""
    key: str
    model: str
    dtype: str
    spec: dict
    """The SpecConfig it was started with, as data."""
    keep_alive: float | None = None
    """Idle seconds before it unloads the models (None: never)."""

    def serves(self, model: str, dtype: str, spec: SpecConfig) -> bool:
        """Whether an answer from it is what a command with these options would compute in-process."""
        return (self.model, self.dtype, self.spec) == (model, dtype, json.loads(json.dumps(asdict(spec))))  # as the file holds it

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.url.removeprefix("http://").rpartition(":")
        return host.strip("[]"), int(port)


def engine_file() -> Path:
    return home_dir() / "engine.json"


def write_record(record: EngineRecord) -> None:
    engine_file().parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(engine_file(), json.dumps(asdict(record), indent=1))


def remove_record(pid: int) -> None:
    """Remove the engine file if it is the engine `pid`'s (a newer engine's stays)."""
    with locked(engine_file()):
        record = read_record()
        if record is not None and record.pid == pid:
            engine_file().unlink(missing_ok=True)


def read_record() -> EngineRecord | None:
    try:
        return EngineRecord(**json.loads(engine_file().read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError):  # half a file from another version, or hand-edited
        return EngineRecord(pid=-1, url="http://127.0.0.1:0", key="", model="", dtype="", spec={})


def find_engine(say: Callable[[str], None] = lambda line: None) -> EngineRecord | None:
    """This home's engine if one is running and answers; a file left by a killed one is removed
    (with one line to `say`)."""
    record = read_record()
    if record is None:
        return None
    if record.pid > 0 and psutil.pid_exists(record.pid) and _answers(record):
        return record
    with locked(engine_file()):
        if read_record() == record:
            engine_file().unlink(missing_ok=True)
    gone = f"process {record.pid} is gone" if record.pid > 0 and not psutil.pid_exists(record.pid) else "it does not answer"
    say(f"removed the file of a resident engine that was stopped ({gone})")
    return None


def _answers(record: EngineRecord) -> bool:
    """Whether the engine's port answers at all (a reused process id does not listen there)."""
    connection = http.client.HTTPConnection(*record.address, timeout=5)
    try:
        connection.request("GET", "/health")
        connection.getresponse().read()
        return True
    except OSError:
        return False
    finally:
        connection.close()


class ResidentEngine:
    """The engine in another process, with the part of `Engine`'s interface the CLI and chat use:
    `generate` yields the same events an in-process engine would, folded the same way."""

    def __init__(self, record: EngineRecord, say: Callable[[str], None] = lambda line: None,
                 on_start: Callable[[dict], None] = lambda about: None) -> None:
        self.record, self.say, self.on_start = record, say, on_start
        self.about: dict | None = None
        """What the engine runs (`Session.details()`), once an answer has started."""

    def details(self) -> dict:
        """What the engine runs (`Session.details()`), loading the model first if it is not loaded."""
        connection = http.client.HTTPConnection(*self.record.address)
        try:
            connection.request("GET", "/localspec/v1/engine?load=1", headers={"Authorization": f"Bearer {self.record.key}"})
            response = connection.getresponse()
            if response.status != 200:
                raise LocalspecError(_error_text(response))
            found = json.loads(response.read())
        except (OSError, http.client.HTTPException) as exc:
            raise EngineLost(f"the resident engine (pid {self.record.pid}) does not answer: {exc}") from None
        finally:
            connection.close()
        if not found["loaded"]:
            raise LocalspecError(f"the resident engine (pid {self.record.pid}) could not load {self.record.model}")
        self.about = found["details"]
        return self.about

    def generate(self, prompt: str | list[dict], sampling: SamplingConfig = SamplingConfig(),
                 limits: GenerationLimits = GenerationLimits(), system: str | None = None) -> Iterator[TokenEvent]:
        body = json.dumps({"prompt": prompt, "system": system, "sampling": asdict(sampling), "limits": asdict(limits)})
        # no read timeout: a long prompt's prefill, or a wait in the queue, sends nothing for a while
        connection = http.client.HTTPConnection(*self.record.address)
        try:
            try:
                connection.request("POST", "/localspec/v1/generate", body, {
                    "Authorization": f"Bearer {self.record.key}", "Content-Type": "application/json"})
                response = connection.getresponse()
            except OSError as exc:
                raise EngineLost(f"the resident engine (pid {self.record.pid}) does not answer: {exc}") from None
            if response.status != 200:
                raise LocalspecError(_error_text(response))
            yield from self._events(response)
        finally:
            connection.close()  # a consumer that stops early: the engine notices and ends the answer

    def _events(self, response: http.client.HTTPResponse) -> Iterator[TokenEvent]:
        lost = f"the resident engine (pid {self.record.pid}) stopped mid-answer"
        while True:
            try:
                line = response.readline()
            except (OSError, http.client.HTTPException):
                raise EngineLost(lost) from None
            if not line:
                raise EngineLost(lost)
            message = json.loads(line)
            kind = message["type"]
            if kind == "queued":
                ahead = message["ahead"]
                self.say(f"waiting for the resident engine: {ahead} answer{'s' if ahead != 1 else ''} ahead")
            elif kind == "loading":
                self.say(f"the resident engine is loading {self.record.model}")
            elif kind == "start":
                self.about = message["about"]
                self.on_start(self.about)
            elif kind == "event":
                event = from_wire(message["event"])
                yield event
                if "stats" in message["event"]:
                    return
            elif kind == "error":
                raise LocalspecError(message["message"])


def _error_text(response: http.client.HTTPResponse) -> str:
    try:
        return json.loads(response.read())["error"]["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return f"the resident engine answered HTTP {response.status}"


def connect(model: str, dtype: str, spec: SpecConfig, daemon: bool | None, keep_alive: str,
            say: Callable[[str], None] = lambda line: None) -> EngineRecord | None:
    """The engine a command for `model` with these options is answered by, or None (in-process).
    `daemon`: True starts one when none runs, False never uses one, None leaves it to the
    LOCALSPEC_DAEMON setting (1: as True, 0: as False, unset: use one that runs)."""
    setting = os.environ.get(DAEMON_SETTING, "")
    if daemon is False or (daemon is None and setting == "0"):
        return None
    record = find_engine(say)
    if record is None and (daemon or setting == "1"):
        parse_duration(keep_alive)  # a wrong duration is refused here, not in the engine's log
        record = start_engine(model, dtype, spec, keep_alive, say)
    if record is not None and not record.serves(model, dtype, spec):
        say(f"the resident engine (pid {record.pid}) runs {record.model} with other options; answering in-process")
        return None
    return record


def serve_args(spec: SpecConfig) -> list[str]:
    """`localspec serve`'s options that give `spec` (the CLI's `spec_from` reads them back)."""
    args = ["--proposer", spec.proposer, "--max-draft-len", str(spec.max_draft_len), "--ngram-min", str(spec.ngram_min),
            "--ngram-max", str(spec.ngram_max), "--draft-quant", spec.draft_quant, "--quant", spec.quant,
            "--tree-top-k", str(spec.tree_top_k)]
    for flag, value in (("--draft-len", spec.draft_len), ("--tree-nodes", spec.tree_nodes), ("--tree-depth", spec.tree_depth)):
        if value is not None:
            args += [flag, str(value)]
    for path in spec.context:
        args += ["--context", path]
    return args + ([] if spec.lookup else ["--no-lookup"]) + ([] if spec.history else ["--no-history"])


def start_engine(model: str, dtype: str, spec: SpecConfig, keep_alive: str,
                 say: Callable[[str], None] = lambda line: None) -> EngineRecord:
    """Start `localspec serve` in the background as this home's engine for `model` (unless one
    started meanwhile), and wait until it listens. It unloads the models and exits once idle for
    `keep_alive`; what it prints goes to engine.log in the home."""
    with locked(home_dir() / "engine-start"):  # two CLIs at once start one engine between them
        if (running := find_engine(say)) is not None:
            return running
        log_path = home_dir() / "engine.log"
        command = [sys.executable, "-m", "localspec", "serve", "--model", model, "--dtype", dtype, *serve_args(spec),
                   "--port", "0", "--keep-alive", keep_alive, "--exit-when-idle"]
        detached = ({"creationflags": subprocess.DETACHED_PROCESS | subprocess.CREATE_NEW_PROCESS_GROUP}
                    if os.name == "nt" else {"start_new_session": True})
        with open(log_path, "ab") as log:
            child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, **detached)
        say(f"starting a resident engine for {model} (pid {child.pid}, log {log_path}); "
            f"it stays loaded for {keep_alive} after the last answer")
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if (record := read_record()) is not None and record.pid == child.pid:
                return record
            if child.poll() is not None:
                raise LocalspecError(f"the resident engine stopped before it listened: {_last_line(log_path)}")
            time.sleep(0.05)
        child.kill()
        raise LocalspecError(f"the resident engine did not listen within {STARTUP_SECONDS:.0f} s (see {log_path})")


def _last_line(log_path: Path) -> str:
    try:
        lines = [line for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1].removeprefix("localspec: ") if lines else "it printed nothing"


def parse_duration(text: str) -> float | None:
    """'5m', '30s', '1h', '0' (unload after each answer), '-1' or 'forever' (never) -> seconds, or None for never."""
    value = text.strip().lower()
    if value in ("-1", "forever", "never"):
        return None
    units = {"s": 1, "m": 60, "h": 3600}
    number, unit = (value[:-1], units[value[-1]]) if value and value[-1] in units else (value, 1)
    try:
        seconds = float(number) * unit
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise LocalspecError(f"--keep-alive takes a duration such as 30s, 5m or 1h, 0, or forever; got {text!r}")
    return seconds
