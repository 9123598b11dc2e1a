"""The Textual app: owns the settings, the loaded engine and the history; loads in a worker."""

from __future__ import annotations

from dataclasses import replace

from textual import work
from textual.app import App

from localspec.apps.tui.backend import Backend, ChatSettings, Loaded, available_proposers, error_text
from localspec.apps.tui.chat import ChatScreen
from localspec.apps.tui.history import HistoryStore
from localspec.apps.tui.screens import HelpScreen, LoadingScreen, ModelPicker, SettingsScreen, WizardScreen
from localspec.store.registry import load_registry


class LocalspecApp(App):
    CSS_PATH = "localspec.tcss"
    TITLE = "localspec"

    def __init__(
        self, backend: Backend, settings: ChatSettings, history: HistoryStore | None = None, run_pair=None
    ) -> None:
        super().__init__()
        self.backend = backend
        self.run_pair = run_pair
        """The wizard's measurement (None: localspec.apps.pairing.pair); tests pass a fake."""
        self.settings = settings
        self.history = history or HistoryStore()
        self.loaded: Loaded | None = None
        self.chat = ChatScreen()

    def get_default_screen(self) -> ChatScreen:
        return self.chat

    def on_mount(self) -> None:
        self.load(self.settings)

    # -- loading --------------------------------------------------------------------------------

    def load(self, settings: ChatSettings) -> None:
        screen = LoadingScreen(settings.model or self.backend.registry.default)
        self.push_screen(screen)
        self.load_worker(settings, screen)

    @work(thread=True, exclusive=True, group="load")
    def load_worker(self, settings: ChatSettings, screen: LoadingScreen) -> None:
        try:
            loaded = self.backend.open(settings, lambda stage: self.call_from_thread(screen.set_stage, stage))
        except Exception as exc:  # shown on screen; the app and any loaded engine stay usable
            self.call_from_thread(self.load_failed, screen, error_text(exc))
        else:
            self.call_from_thread(self.load_done, screen, settings, loaded)

    def load_done(self, screen: LoadingScreen, settings: ChatSettings, loaded: Loaded) -> None:
        screen.dismiss()
        self.loaded = loaded
        # the resolved proposer (auto -> draft or ngram), so later comparisons see real changes
        self.settings = replace(settings, model=loaded.model, spec=replace(settings.spec, proposer=loaded.proposer))
        self.chat.show_engine()

    def load_failed(self, screen: LoadingScreen, error: str) -> None:
        screen.dismiss()
        self.notify(error, title="could not load the model", severity="error", timeout=15, markup=False)

    def apply_settings(self, settings: ChatSettings) -> None:
        """Settings from a screen or a key: a new engine only when the model or speculation changed."""
        if self.chat.generating:
            self.notify("Stop the answer first (Esc); settings apply between turns.", severity="warning")
            return
        if settings.needs_new_engine(self.settings) or self.loaded is None:
            self.load(settings)  # the settings take effect once the engine is ready
        else:
            self.settings = settings
            self.chat.show_status()

    # -- screens --------------------------------------------------------------------------------

    def action_help(self) -> None:
        self.push_screen(HelpScreen(ChatScreen.BINDINGS))

    def action_settings(self) -> None:
        proposers = available_proposers(self.backend.registry, self.settings.model)
        self.push_screen(SettingsScreen(self.settings, proposers), self._settings_closed)

    def _settings_closed(self, settings: ChatSettings | None) -> None:
        if settings is not None:
            self.apply_settings(settings)

    def action_pick_model(self) -> None:
        current = self.settings.model or self.backend.registry.default
        self.push_screen(ModelPicker(self.backend.registry, current, self.loaded), self._model_chosen)

    def _model_chosen(self, name: str | None) -> None:
        if name is not None and name != self.settings.model:
            # a new model gets the automatic proposer: the old choice may not exist for it
            self.apply_settings(replace(self.settings, model=name, spec=replace(self.settings.spec, proposer="auto")))

    def action_pair(self) -> None:
        if self.chat.generating:
            self.notify("Stop the answer first (Esc): pairing measures on the same CPU/GPU.", severity="warning")
            return
        # these import torch: here, when the wizard opens, so that the chat is up before torch is
        from localspec.apps import pairing
        from localspec.store import loading, machine

        memory = machine.free_memory(loading.pick_device())
        self.push_screen(WizardScreen(self.backend.registry, memory, self.run_pair or pairing.pair), self._wizard_closed)

    def _wizard_closed(self, model: str | None) -> None:
        if model is not None:
            # reload the registry so the saved pairing is seen, then let auto pick the winner
            self.backend.registry = load_registry()
            self.apply_settings(replace(self.settings, model=model, spec=replace(self.settings.spec, proposer="auto")))

    def on_unmount(self) -> None:
        self.chat.stop_event.set()  # let a streaming worker end after its current pass
