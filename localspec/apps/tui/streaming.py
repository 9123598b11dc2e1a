"""One assistant turn, run in a worker thread: engine events -> history on disk -> UI in batches.

No Textual here: the app passes `deliver` (its call_from_thread) and a stop event, so the turn
can be tested, and cut off, without a screen. The numbers come from the events alone: each batch
hands on its passes' figures (frozen, so the UI thread reads them safely), the last one the
answer's statistics.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localspec.apps.tui.backend import ChatEngine, ChatSettings, error_text
from localspec.apps.tui.history import Conversation, HistoryStore
from localspec.core.stats import GenerationStats

BATCH_SECONDS = 0.1
"""Longest wait before new text is saved and shown: small batches, at most ~10 UI updates/s."""


@dataclass
class Batch:
    pieces: list = field(default_factory=list)
    """localspec.core.engine.Piece objects committed since the last batch."""
    figures: list = field(default_factory=list)
    """The PassFigures of each target pass since the last batch, in order."""
    stats: GenerationStats | None = None
    """The answer's statistics, on the last batch of an answer that did not fail."""
    done: bool = False
    error: str = ""
    notice: str = ""
    """A problem the answer goes on through (history could not be saved)."""


def stream_answer(
    engine: ChatEngine,
    conversation: Conversation,
    settings: ChatSettings,
    store: HistoryStore,
    stop: threading.Event,
    deliver: Callable[[Batch], None],
) -> None:
    """Fill the conversation's last message (an empty assistant answer) from the engine."""
    answer = conversation.messages[-1]
    batch = Batch()
    stats = GenerationStats()  # the answer's so far, folded from the events
    last_flush = time.monotonic()

    def flush(done: bool = False, error: str = "") -> None:
        nonlocal batch, last_flush
        batch.done, batch.error = done, error
        batch.stats = stats if done and not error else None
        try:
            store.save(conversation)  # before the UI sees it: what was shown is on disk
        except OSError as exc:  # e.g. disk full: the answer goes on, the previous file stays intact
            batch.notice = f"history not saved: {exc}"
        deliver(batch)
        batch, last_flush = Batch(), time.monotonic()

    events = engine.generate(conversation.prompt(), settings.sampling, settings.limits, system=settings.system or None)
    error = ""
    try:
        for event in events:
            stats = event.fold(stats)
            answer.extend(event.pieces)
            batch.pieces += event.pieces
            batch.figures.append(event.figures)
            if stop.is_set():
                stats.stop_reason = "stopped"
                break
            if time.monotonic() - last_flush >= BATCH_SECONDS:
                flush()
    except Exception as exc:  # shown in the chat; the text so far is kept
        error = error_text(exc)
    finally:
        events.close()
        answer.partial = False
        answer.stop_reason = "error" if error else stats.stop_reason
        answer.stats = None if error else stats.to_dict()
        flush(done=True, error=error)
