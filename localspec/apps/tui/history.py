"""Conversations on disk: one JSON file each under home_dir()/history, replaced atomically.

The answer being streamed is saved after every batch, before the batch is shown, so a killed app
keeps every finished message and the partial answer up to what was on screen.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from localspec.base.config import home_dir
from localspec.base.errors import LocalspecError
from localspec.base.files import check_name, write_text_atomic

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
    def from_dict(cls, raw: object, conversation_id: str) -> Conversation:
        """The conversation in a file's JSON; ValueError when it has another shape. The id is the
        file's name, never the content's: a saved id is a path, and content may be edited."""
        if not isinstance(raw, dict) or not isinstance(raw.get("messages", []), list):
            raise ValueError("not a conversation")
        texts = {k: raw.get(k, d) for k, d in (("title", "?"), ("model", ""), ("system", ""))}
        if not all(isinstance(v, str) for v in texts.values()):
            raise ValueError("title, model and system must be text")
        try:
            messages = [Message(**m) for m in raw.get("messages", [])]
        except TypeError as exc:  # a message that is not an object, or has other keys
            raise ValueError(f"a message has another shape ({exc})") from exc
        if not all(_shown_safely(m) for m in messages):
            raise ValueError("a message has another shape")
        return cls(conversation_id, texts["title"], texts["model"], texts["system"], messages)


def _shown_safely(m: Message) -> bool:
    """What the chat screen reads of a message has the types it expects."""
    runs_ok = isinstance(m.runs, list) and all(
        isinstance(r, list) and len(r) == 2 and all(isinstance(x, int) for x in r) for r in m.runs
    )
    return m.role in ("user", "assistant") and isinstance(m.content, str) and isinstance(m.stop_reason, str) and runs_ok


class HistoryStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root or home_dir() / "history"

    def path(self, conversation_id: str) -> Path:
        return self.root / f"{check_name(conversation_id, 'conversation id')}.json"

    def save(self, conversation: Conversation) -> None:
        # Not durable (no fsync): it would slow every batch, and surviving a power cut is not
        # promised here; a killed process still leaves the old file or the new one.
        path = self.path(conversation.id)
        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(asdict(conversation), ensure_ascii=False, indent=1), durable=False)

    def load(self, conversation_id: str) -> Conversation:
        """One saved conversation; a missing or damaged file is a one-line LocalspecError."""
        path = self.path(conversation_id)
        try:
            return Conversation.from_dict(json.loads(path.read_text(encoding="utf-8")), conversation_id)
        except (OSError, ValueError) as exc:
            raise LocalspecError(f"cannot open the conversation in {path}: {exc}") from exc

    def list(self) -> list[Conversation]:
        """Saved conversations, most recently written first; files that are not one are skipped."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.glob("*.json"):
            try:
                found.append((path.stat().st_mtime, self.load(path.stem)))
            except (OSError, LocalspecError):  # removed meanwhile, damaged, or not a valid id
                continue
        return [conversation for _, conversation in sorted(found, key=lambda f: f[0], reverse=True)]


def title_for(prompt: str) -> str:
    line = prompt.strip().splitlines()[0] if prompt.strip() else "New chat"
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"
