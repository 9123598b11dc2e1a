"""Conversations on disk: one JSON file each under home_dir()/history, replaced atomically.

The answer being streamed is saved after every batch, before the batch is shown, so a killed app
keeps every finished message and the partial answer up to what was on screen.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from localspec.config import home_dir

TITLE_CHARS = 48


@dataclass
class Message:
    role: str
    """'user' or 'assistant'."""
    content: str = ""
    runs: list[list[int]] = field(default_factory=list)
    """Provenance of the assistant's text as [chars, from_draft] runs, for draft highlighting."""
    partial: bool = False
    """True while the answer streams; stays True on disk if the app died mid-answer."""
    stop_reason: str = ""
    stats: dict | None = None
    """GenerationStats.to_dict() of the turn that wrote this answer."""

    def extend(self, pieces) -> None:
        """Append engine Pieces, merging runs of the same provenance."""
        for piece in pieces:
            if not piece.text:
                continue
            self.content += piece.text
            flag = int(piece.from_draft)
            if self.runs and self.runs[-1][1] == flag:
                self.runs[-1][0] += len(piece.text)
            else:
                self.runs.append([len(piece.text), flag])


@dataclass
class Conversation:
    id: str = field(default_factory=lambda: time.strftime("%Y%m%d-%H%M%S-") + os.urandom(3).hex())
    title: str = "New chat"
    model: str = ""
    system: str = ""
    messages: list[Message] = field(default_factory=list)

    def prompt(self) -> list[dict]:
        """The chat so far as engine messages (answers with no text yet are left out)."""
        return [{"role": m.role, "content": m.content} for m in self.messages if m.content]

    @classmethod
    def from_dict(cls, raw: dict) -> Conversation:
        messages = [Message(**m) for m in raw.get("messages", [])]
        return cls(raw["id"], raw.get("title", "?"), raw.get("model", ""), raw.get("system", ""), messages)


class HistoryStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or home_dir() / "history"

    def path(self, conversation_id: str) -> Path:
        return self.root / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> None:
        # Written to a temporary file beside the real one, then renamed over it: a reader or a
        # killed process sees the old or the new file, never half of one. No fsync: it would
        # slow every batch, and what it adds (surviving a power cut) is not promised here.
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{conversation.id}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(asdict(conversation), out, ensure_ascii=False, indent=1)
            os.replace(tmp, self.path(conversation.id))
        except BaseException:  # disk full, Ctrl-C: no half-written file left, the previous one intact
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, conversation_id: str) -> Conversation:
        return Conversation.from_dict(json.loads(self.path(conversation_id).read_text(encoding="utf-8")))

    def list(self) -> list[Conversation]:
        """Saved conversations, most recently written first; unreadable files are skipped."""
        if not self.root.is_dir():
            return []
        files = sorted(self.root.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        found = []
        for path in files:
            try:
                found.append(Conversation.from_dict(json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, ValueError, KeyError, TypeError):
                continue
        return found


def title_for(prompt: str) -> str:
    line = prompt.strip().splitlines()[0] if prompt.strip() else "New chat"
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"
