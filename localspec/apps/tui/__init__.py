"""`localspec chat`: a Textual chat with live speculation statistics.

Imported only by the CLI; nothing below it imports the UI.
"""

from __future__ import annotations

from localspec.apps.tui.backend import ChatSettings, ResidentBackend, SessionBackend


def run_chat(settings: ChatSettings, fake_engine: bool = False, daemon: bool | None = None, keep_alive: str = "5m") -> int:
    """The chat, through the resident engine where one runs the model (`daemon`: as resident.connect)."""
    # textual (and, for the fake engine, torch) load when the chat starts: importing ChatSettings
    # to check the options needs neither
    from localspec.apps.tui.app import LocalspecApp

    if fake_engine:
        from localspec.apps.tui.fake import FakeBackend

        backend = FakeBackend(delay=0.05)
    else:
        backend = ResidentBackend(SessionBackend(), daemon, keep_alive)
    backend.registry.get(settings.model)  # an unknown name is a one-line CLI error, not a UI one
    LocalspecApp(backend, settings).run()
    return 0
