"""One assistant turn, run in a worker thread: engine events -> history on disk -> UI in batches.

No Textual here: the app passes `deliver` (its call_from_thread) and a stop event, so the turn
can be tested, and cut off, without a screen.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localspec.apps.tui.backend import ChatEngine, ChatSettings, error_text
from localspec.apps.tui.history import Conversation, HistoryStore

BATCH_SECONDS = 0.1
"""Longest wait before new text is saved and shown: small batches, at most ~10 UI updates/s."""


@dataclass
class Batch:
    pieces: list = field(default_factory=list)
    """localspec.core.engine.Piece objects committed since the last batch."""
    stats: object = None
    """A copy of the engine's GenerationStats at the time of this batch."""
    tokens_per_pass: list[float] = field(default_factory=list)
    """Tokens committed by each target pass since the last batch (for the sparkline)."""
    progress: list[tuple[float, int]] = field(default_factory=list)
    """(decode seconds, tokens) after each engine event since the last batch: the 'now' rate is
    measured on these, so it does not depend on how events were grouped into batches."""
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
    passes = tokens = 0  # totals at the previous event, to split the counters per pass
    last_flush = time.monotonic()

    def flush(done: bool = False, error: str = "") -> None:
        nonlocal batch, last_flush
        batch.stats, batch.done, batch.error = copy.deepcopy(engine.stats), done, error
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
            answer.extend(event.pieces)
            batch.pieces += event.pieces
            stats = engine.stats
            new_passes, new_tokens = stats.passes - passes, stats.accepted + stats.passes - tokens
            if new_passes:
                batch.tokens_per_pass += [new_tokens / new_passes] * new_passes
            passes, tokens = stats.passes, stats.accepted + stats.passes
            batch.progress.append((stats.decode_seconds, stats.new_tokens))
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
        answer.stop_reason = "error" if error else engine.stats.stop_reason
        answer.stats = None if error else engine.stats.to_dict()
        flush(done=True, error=error)
