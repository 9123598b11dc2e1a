"""What the chat needs from the engine side: settings, an engine factory, the loaded engine.

The app is handed a Backend (dependency injection): `SessionBackend` loads real models through
`localspec.store.session`; `ResidentBackend` chats through this home's resident engine when it runs
the chat's model and options, else through the SessionBackend it wraps;
`localspec.apps.tui.fake.FakeBackend` scripts answers for tests and demos. Nothing here imports
torch at module level, so the UI is up before the weights are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import psutil

from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.base.reasons import Reason
from localspec.core.events import FinalEvent
from localspec.core.stats import GenerationStats
from localspec.store import proposer_catalog
from localspec.store.registry import Registry, load_registry


@dataclass(frozen=True)
class ChatSettings:
    """Everything a turn depends on; each part validates itself (LocalspecError)."""

    model: str | None = None
    """Registry name; None is the registry's default."""
    dtype: str = "auto"
    spec: SpecConfig = field(default_factory=SpecConfig)
    """Proposer and draft length: changing them rebuilds the engine."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    limits: GenerationLimits = field(default_factory=GenerationLimits)
    system: str = ""
    """System prompt sent with every turn ('' for none)."""

    def needs_new_engine(self, other: ChatSettings) -> bool:
        return (self.model, self.dtype, self.spec) != (other.model, other.dtype, other.spec)


class ChatEngine(Protocol):
    """The part of localspec.core.engine.Engine the chat uses: its events carry the numbers."""

    def generate(self, prompt, sampling, limits, system=None): ...


@dataclass
class Loaded:
    """A ready engine and what the statistics panel (in short) and the model screen (in full) say
    about it."""

    engine: ChatEngine
    model: str
    proposer: str
    weights: Reason
    """The target's weight format and device, and why."""
    proposer_choice: Reason
    """The proposer (with its draft model) and why."""
    memory: Callable[[], str]
    """Memory in use now, as one short text (RAM, and GPU memory on CUDA)."""


class Backend(Protocol):
    registry: Registry

    def open(self, settings: ChatSettings, status: Callable[[str], None]) -> Loaded:
        """Load what `settings` needs (reusing what is loaded) and build an engine. Runs in a
        worker thread; `status` reports each stage for the loading screen."""


def available_proposers(registry: Registry, model: str | None) -> list[str]:
    """The proposers in the catalog that can run for this model here (the draft one with a
    registered draft, EAGLE with a head trained here)."""
    return proposer_catalog.available(registry.get(model))


def error_text(exc: Exception) -> str:
    """One line for the user: our own errors as they are, anything else with its type."""
    return str(exc) if isinstance(exc, LocalspecError) else f"{type(exc).__name__}: {exc}"


def memory_in_use(device: str) -> str:
    rss = psutil.Process().memory_info().rss
    text = f"{rss / 2**20:,.0f} MiB RAM"
    if device == "cuda":
        import torch  # only reached when a CUDA engine is loaded, so torch is already imported

        text += f", {torch.cuda.memory_allocated() / 2**20:,.0f} MiB GPU"
    return text


class SessionBackend:
    """Real models through localspec.store.session; keeps the target (and draft) weights loaded so a
    proposer or draft-length change only rebuilds the engine."""

    def __init__(self, registry: Registry | None = None, session=None) -> None:
        self.registry = registry or load_registry()
        self.session = session
        self.dtype = None
        """The dtype option the session was opened with (None: opened by the caller)."""

    def open(self, settings: ChatSettings, status: Callable[[str], None]) -> Loaded:
        status("importing torch")
        # imported here, in the loading worker, so that the UI is up before torch is
        from localspec.store import session as sessions
        from localspec.store.loading import release_memory

        entry = self.registry.get(settings.model)
        current = self.session
        if current is None or current.entry.name != entry.name or self.dtype not in (None, settings.dtype):
            self.session = current = None
            release_memory()  # free the old weights before the new ones arrive
            status(f"loading {entry.name} (the first time: download, conversion, measurements)")
            current = self.session = sessions.open_session(
                entry.name, settings.spec.proposer, settings.dtype, settings.spec, quiet=True, registry=self.registry
            )
            self.dtype = settings.dtype
        else:
            # a proposer picked in the UI on the weights already loaded ('auto' only comes with a
            # load); a failure leaves the old engine working
            proposer = settings.spec.proposer
            current.switch_proposer(proposer, settings.spec, Reason(f"{proposer} was chosen in the chat", "chosen here"), status)
        device = current.target.device.type
        return Loaded(Recorded(current.engine, current.record), entry.name, current.proposer, current.weights_choice,
                      current.proposer_choice, lambda: memory_in_use(device))


@dataclass
class Recorded:
    """An in-process engine whose finished answers go to the session's `record` (this machine's
    history of what each proposer measured, and the check of its pass costs), as the CLI's and
    the server's do."""

    engine: ChatEngine
    record: Callable[[GenerationStats], None]

    def generate(self, prompt, sampling, limits, system=None):
        for event in self.engine.generate(prompt, sampling, limits, system=system):
            yield event
            if isinstance(event, FinalEvent):
                self.record(event.stats)


class ResidentBackend:
    """The resident engine (`localspec serve`, apps/resident.py) for a model and options it runs, so
    the chat opens warm; anything else (another model, a proposer picked in the chat) loads in this
    process through `local`. `daemon` as `resident.connect` takes it."""

    def __init__(self, local: SessionBackend, daemon: bool | None = None, keep_alive: str = "5m") -> None:
        self.local, self.daemon, self.keep_alive = local, daemon, keep_alive

    @property
    def registry(self) -> Registry:
        return self.local.registry

    @registry.setter
    def registry(self, registry: Registry) -> None:
        self.local.registry = registry

    def open(self, settings: ChatSettings, status: Callable[[str], None]) -> Loaded:
        from localspec.apps import resident

        entry = self.registry.get(settings.model)
        said: list[str] = []
        record = resident.connect(entry.name, settings.dtype, settings.spec, self.daemon, self.keep_alive, said.append)
        if record is None:
            for line in said:
                status(line)
            return self.local.open(settings, status)
        status(f"the resident engine (pid {record.pid}) has {entry.name}; loading it there if it is not loaded")
        engine = resident.ResidentEngine(record)
        about = engine.details()
        engine_process = psutil.Process(record.pid)
        return Loaded(engine, entry.name, about["proposer"],
                      Reason(about["weights_choice"], f"{about['weights_short']} · resident engine"),
                      Reason(about["proposer_choice"], about["proposer_short"]),
                      lambda: f"{engine_process.memory_info().rss / 2**20:,.0f} MiB RAM in the resident engine")
