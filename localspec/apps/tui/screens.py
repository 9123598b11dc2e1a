"""Modal screens: settings, model picker (with why the loaded model runs as it does), help,
loading, and the pairing wizard."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from rich.markup import escape
from rich.table import Table
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, LoadingIndicator, OptionList, RichLog, Select, Static, TextArea

from localspec.apps.tui.backend import ChatSettings, Loaded, error_text
from localspec.base.errors import LocalspecError
from localspec.store.registry import fitting_targets


def _number(text: str, kind, name: str):
    try:
        return kind(text)
    except ValueError:
        raise LocalspecError(f"{name} must be a number, got {text!r}") from None


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """Proposer, draft length, sampling and the system prompt; applied from the next turn."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, settings: ChatSettings, proposers: list[str]) -> None:
        super().__init__()
        self.settings = settings
        self.proposers = proposers

    def compose(self) -> ComposeResult:
        s = self.settings
        with VerticalScroll(id="dialog"):
            yield Label("Settings", classes="title")
            yield Label("proposer")
            current = s.spec.proposer if s.spec.proposer in self.proposers else self.proposers[0]
            yield Select([(p, p) for p in self.proposers], value=current, allow_blank=False, id="proposer")
            yield Label("draft length (empty: adaptive, from measured costs)")
            yield Input("" if s.spec.draft_len is None else str(s.spec.draft_len), id="draft_len")
            with Horizontal(classes="row"):
                with Vertical():
                    yield Label("temperature (0 = greedy)")
                    yield Input(str(s.sampling.temperature), id="temperature")
                with Vertical():
                    yield Label("top-p")
                    yield Input(str(s.sampling.top_p), id="top_p")
                with Vertical():
                    yield Label("max new tokens")
                    yield Input(str(s.limits.max_new_tokens), id="max_new_tokens")
            yield Label("system prompt")
            yield TextArea(s.system, id="system")
            yield Static("", id="error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def read(self) -> ChatSettings:
        """The form as settings; the config classes reject bad values with their usual message."""
        def value(widget_id: str) -> str:
            return self.query_one(f"#{widget_id}", Input).value.strip()

        s = self.settings
        draft_len = _number(value("draft_len"), int, "draft length") if value("draft_len") else None
        return replace(
            s,
            spec=replace(s.spec, proposer=self.query_one("#proposer", Select).value, draft_len=draft_len),
            sampling=replace(s.sampling, temperature=_number(value("temperature"), float, "temperature"),
                             top_p=_number(value("top_p"), float, "top-p")),
            limits=replace(s.limits, max_new_tokens=_number(value("max_new_tokens"), int, "max new tokens")),
            system=self.query_one("#system", TextArea).text.strip(),
        )

    @on(Button.Pressed, "#save")
    def save(self) -> None:
        try:
            self.dismiss(self.read())
        except LocalspecError as exc:
            self.query_one("#error", Static).update(f"[b red]{escape(str(exc))}[/]")

    @on(Button.Pressed, "#cancel")
    def cancel(self) -> None:
        self.dismiss(None)


class ModelPicker(ModalScreen[str | None]):
    """The models to load, under the full story of the one loaded: the side panel says it in a
    few words, this screen why (the numbers, the command that would change it)."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, registry, current: str, loaded: Loaded | None = None) -> None:
        super().__init__()
        self.registry = registry
        self.current = current
        self.loaded = loaded

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            if self.loaded is not None:
                yield Label(f"Loaded: {self.loaded.model}", classes="title", markup=False)
                yield Static(f"{self.loaded.weights}\n\n{self.loaded.proposer_choice}", id="why", markup=False)
            yield Label("Model (Enter loads it)", classes="title")
            names = list(self.registry.models)
            options = OptionList(*(f"{escape(n)}  [dim]{escape(self.registry.models[n].display)}[/]" for n in names),
                                 id="models")
            options.highlighted = names.index(self.current) if self.current in names else 0
            yield options

    @on(OptionList.OptionSelected)
    def chosen(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(list(self.registry.models)[event.option_index])


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss(None)", "Close")]

    def __init__(self, bindings: list[Binding]) -> None:
        super().__init__()
        self.key_bindings = bindings

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan")
        table.add_column()
        for binding in self.key_bindings:
            table.add_row(binding.key.replace(",", " / "), binding.description)
        with Vertical(id="dialog"):
            yield Label("Keys", classes="title")
            yield Static(table, id="keys")
            yield Static("[dim]Settings apply from the next answer. The model screen also says in full why the "
                         "panel's weights and proposer were chosen. Esc closes this screen.[/]")


class LoadingScreen(ModalScreen[None]):
    """Shown while a model loads in a worker thread: the current stage and the time so far."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.started = time.monotonic()
        self.stage = "starting"

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(f"Loading {self.what}", classes="title", markup=False)
            yield LoadingIndicator()
            yield Static(self.stage, id="stage")

    def on_mount(self) -> None:
        self.redraw()
        self.set_interval(0.5, self.redraw)

    def set_stage(self, stage: str) -> None:
        self.stage = stage
        if self.is_mounted:  # the worker may report before the screen is up
            self.redraw()

    def redraw(self) -> None:
        seconds = time.monotonic() - self.started
        self.query_one("#stage", Static).update(f"{escape(self.stage)}  [dim]{seconds:.0f} s[/]")


class WizardScreen(ModalScreen[str | None]):
    """`localspec pair` as a screen: pick a target that fits, measure every proposer for it, save
    the winner. Dismisses with the paired model's name (None when nothing was paired)."""

    BINDINGS = [Binding("escape", "close", "Close")]

    def __init__(self, registry, memory: int, run_pair: Callable[..., object]) -> None:
        super().__init__()
        self.registry = registry
        self.memory = memory
        self.run_pair = run_pair  # pairing.pair, or a fake in tests
        self.targets = fitting_targets(registry, memory)
        self.paired: str | None = None
        self.running = False

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Pair a model with its fastest proposer", classes="title")
            yield Static(f"{self.memory / 1e9:.1f} GB free for a model. Targets that fit:")
            targets = OptionList(
                *(f"{escape(e.name)}  [dim]{e.params:.2f}B, {e.size / 1e9:.1f} GB[/]" for e in self.targets), id="targets"
            )
            targets.highlighted = 0 if self.targets else None
            yield targets
            yield RichLog(id="wizard-log", wrap=True, markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Measure", id="measure", variant="primary")
                yield Button("Close", id="close")

    @on(Button.Pressed, "#measure")
    def measure(self) -> None:
        targets = self.query_one("#targets", OptionList)
        if self.running or targets.highlighted is None:
            return
        self.running = True
        self.query_one("#measure", Button).disabled = True
        name = self.targets[targets.highlighted].name
        self.query_one("#wizard-log", RichLog).write(f"measuring {name}: downloads, then every proposer...")
        self.pair_worker(name)

    @work(thread=True, exclusive=True, group="pair")
    def pair_worker(self, name: str) -> None:
        log = self.query_one("#wizard-log", RichLog)
        try:
            best = self.run_pair(name, say=lambda line: self.app.call_from_thread(log.write, line))
        except Exception as exc:  # shown in the log; the chat and its engine are untouched
            self.app.call_from_thread(log.write, f"error: {error_text(exc)}")
            self.app.call_from_thread(self.finished, None)
        else:
            self.app.call_from_thread(self.finished, name, best)

    def finished(self, name: str | None, best=None) -> None:
        self.running = False
        self.query_one("#measure", Button).disabled = False
        if name is not None:
            self.paired = name
            self.query_one("#wizard-log", RichLog).write(
                f"saved: {name} will use {best.proposer}{' with ' + best.draft if best.draft else ''}. "
                "Close to load it."
            )

    @on(Button.Pressed, "#close")
    def action_close(self) -> None:
        if not self.running:  # a measurement holds the CPU/GPU: let it finish first
            self.dismiss(self.paired)
