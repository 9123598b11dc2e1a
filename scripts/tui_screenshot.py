"""Writes docs/tui.svg, the README's picture of the chat with statistics: one real answer from
smollm2-135m (its converted weights must be in LOCALSPEC_HOME; loading takes seconds after that)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from textual.widgets import TextArea

from localspec.apps.tui.app import LocalspecApp
from localspec.apps.tui.backend import ChatSettings, SessionBackend
from localspec.apps.tui.history import HistoryStore
from localspec.base.config import GenerationLimits

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROMPT = "Write a Python function that checks whether a string is a palindrome."


async def main() -> None:
    settings = ChatSettings(model="smollm2-135m", dtype="float32", limits=GenerationLimits(max_new_tokens=160))
    with tempfile.TemporaryDirectory() as history:
        app = LocalspecApp(SessionBackend(), settings, HistoryStore(Path(history)))
        async with app.run_test(size=(150, 42)) as pilot:
            await app.workers.wait_for_complete()
            app.chat.query_one("#prompt", TextArea).load_text(PROMPT)
            await pilot.press("ctrl+j")
            await app.workers.wait_for_complete()
            await pilot.pause()
            print(app.save_screenshot(filename="tui.svg", path=str(DOCS)))


if __name__ == "__main__":
    asyncio.run(main())
