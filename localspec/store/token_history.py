"""What this model wrote and read on this machine, kept for suffix decoding.

One file per model, `home_dir()/written/<model>.npz`: the token ids of each finished conversation
(its prompt and answer, from the CLI, the chat UI and the server alike) as one document, with a
stable id and the time it was last added or offered as a guess. Bounded at `HISTORY_TOKENS`: the
documents offered least recently go first. Every change is made under the file's lock on what is on
disk now (another process may have added meanwhile) and written atomically; a damaged file is set
aside with one notice and the history starts again. Nothing leaves the home; `localspec forget`
removes the files, `--no-history` neither reads nor writes them.

A later turn of a conversation repeats the earlier turn's whole text, so it replaces that turn's
document instead of adding a copy; a conversation already held whole (the same prompt answered the
same way) only counts as used.

Files the user names (`--context PATH...`) join the index for the session, never the file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localspec.base.config import home_dir
from localspec.base.errors import LocalspecError
from localspec.base.files import check_name, locked, write_atomic
from localspec.core.proposers.suffix import SuffixIndex

HISTORY_TOKENS = 1_000_000
"""Most tokens kept per model by default (4 bytes each on disk; about 16 in memory, searched);
$LOCALSPEC_HISTORY_TOKENS changes it (`history_cap`)."""
SETTLE_SHARE = 0.25
SETTLE_MINIMUM = 20_000
"""The fresh index is merged into the settled one once it holds more than SETTLE_SHARE of it (and
of at least SETTLE_MINIMUM tokens): rebuilding the whole index is then paid once per that much text."""
RECENT_CONVERSATIONS = 16
"""How many of the latest documents a new one is compared with (a conversation's previous turn)."""
CONTEXT_FILE_BYTES = 4 << 20
"""Largest file `--context` reads; a folder is walked for text files up to CONTEXT_TOTAL_BYTES."""
CONTEXT_TOTAL_BYTES = 16 << 20


def history_cap() -> int:
    raw = os.environ.get("LOCALSPEC_HISTORY_TOKENS")
    if raw is None:
        return HISTORY_TOKENS
    if not raw.isdigit() or int(raw) < 1:
        raise LocalspecError(f"LOCALSPEC_HISTORY_TOKENS must be a positive number of tokens, got {raw!r}")
    return int(raw)


def history_dir() -> Path:
    """Where the histories live: home_dir()/written, or $LOCALSPEC_HISTORY_DIR (a benchmark's
    replay starts from an empty one)."""
    return Path(os.environ["LOCALSPEC_HISTORY_DIR"]).expanduser() if os.environ.get("LOCALSPEC_HISTORY_DIR") else home_dir() / "written"


@contextlib.contextmanager
def empty_history() -> Iterator[None]:
    """Inside, every history this process and the processes it starts open is a fresh, empty one,
    removed after: a benchmark's prompt answered in an earlier run must not be remembered."""
    before = os.environ.get("LOCALSPEC_HISTORY_DIR")
    with tempfile.TemporaryDirectory(prefix="localspec-history-") as folder:
        os.environ["LOCALSPEC_HISTORY_DIR"] = folder
        try:
            yield
        finally:
            if before is None:
                del os.environ["LOCALSPEC_HISTORY_DIR"]
            else:
                os.environ["LOCALSPEC_HISTORY_DIR"] = before


def history_file(model: str) -> Path:
    return history_dir() / f"{check_name(model, 'model name')}.npz"


@dataclass
class Documents:
    """A history file's content: documents in the order they were added (oldest first)."""

    runs: list[np.ndarray]
    ids: list[int]
    used: list[float]
    next_id: int = 0
    """The id the next document gets: ids are never reused, so a session's offered ids stay true."""

    @classmethod
    def empty(cls) -> Documents:
        return cls([], [], [])

    @property
    def tokens(self) -> int:
        return sum(len(r) for r in self.runs)

    def add(self, tokens: np.ndarray, now: float) -> None:
        """Keep a finished conversation: replacing its previous turn, or only counted as used
        when already held whole."""
        for i in range(len(self.runs) - 1, max(len(self.runs) - RECENT_CONVERSATIONS, 0) - 1, -1):
            held = self.runs[i]
            if len(held) >= len(tokens) and np.array_equal(held[: len(tokens)], tokens):
                self.used[i] = now
                return
            if np.array_equal(tokens[: len(held)], held):
                del self.runs[i], self.ids[i], self.used[i]
                break
        cap = history_cap()
        self.runs.append(tokens[-cap:])
        self.ids.append(self.next_id)
        self.next_id += 1
        self.used.append(now)
        total = self.tokens
        while total > cap:
            oldest = int(np.argmin(self.used))
            total -= len(self.runs[oldest])
            del self.runs[oldest], self.ids[oldest], self.used[oldest]

    def touch(self, ids: set[int], now: float) -> None:
        for i, doc in enumerate(self.ids):
            if doc in ids:
                self.used[i] = now


def read_documents(path: Path, notify: Callable[[str], None]) -> Documents:
    """The file's documents; none when there is no file; a damaged one is set aside (one notice)."""
    if not path.exists():
        return Documents.empty()
    try:
        with np.load(path, allow_pickle=False) as saved:
            tokens, lengths = saved["tokens"].astype(np.int32), saved["lengths"].astype(np.int64)
            ids, used = saved["ids"].astype(np.int64).tolist(), saved["used"].astype(np.float64).tolist()
            next_id = int(saved["next_id"])
        if ((lengths < 0).any() or lengths.sum() != len(tokens) or not (len(lengths) == len(ids) == len(used))
                or (tokens < 0).any() or any(i >= next_id for i in ids)):
            raise ValueError("its parts do not agree")
        return Documents(np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else [], ids, used, next_id)
    except Exception as exc:  # truncated, not an npz, hand-edited: the history is a cache of past text
        damaged = path.with_name(path.name + ".damaged")
        os.replace(path, damaged)
        notify(f"the suffix history {path} was damaged ({type(exc).__name__}); set aside as {damaged.name}, starting a new one")
        return Documents.empty()


def write_documents(path: Path, docs: Documents) -> None:
    tokens = np.concatenate(docs.runs).astype(np.int32) if docs.runs else np.zeros(0, dtype=np.int32)
    arrays = dict(tokens=tokens, lengths=np.array([len(r) for r in docs.runs], dtype=np.int64),
                  ids=np.array(docs.ids, dtype=np.int64), used=np.array(docs.used, dtype=np.float64),
                  next_id=np.array(docs.next_id, dtype=np.int64))
    write_atomic(path, lambda out: np.savez(out, **arrays), durable=False)


class TokenHistory:
    """One model's history on this machine, plus the session's context files, as the indexes the
    suffix proposer searches.

    Two indexes, so that keeping an answer costs what the answer is long, not what the history
    is: the settled one (the history as it was when the session began, and the context files) and
    a fresh one over what was added since, rebuilt with each answer; when the fresh one outgrows
    SETTLE_SHARE of the settled one, both are made one again. A document removed from the file
    (replaced by its conversation's next turn, or evicted) stays searchable until then.
    """

    def __init__(self, model: str, context: Sequence[Sequence[int]] = (), keep: bool = True,
                 notify: Callable[[str], None] = lambda line: None, clock: Callable[[], float] = time.time) -> None:
        self.path = history_file(model)
        self.context = [np.asarray(c, dtype=np.int32) for c in context if len(c)]
        self.keep = keep
        """False (`--no-history`): the file is neither read nor written; the context still counts."""
        self.notify = notify
        self.clock = clock
        self.settled: SuffixIndex | None = None

    def indexes(self) -> list[SuffixIndex]:
        """The indexes to search at the start of a session."""
        docs = read_documents(self.path, self.notify) if self.keep else Documents.empty()
        return [self._settle(docs)]

    def remember(self, tokens: list[int], offered: set[int]) -> list[SuffixIndex] | None:
        """Keep a finished conversation (`offered`: ids of the documents guesses came from since
        the last one); the indexes to search from now on, None when nothing changed."""
        if not self.keep or not tokens:
            return None
        try:
            with locked(self.path):
                docs = read_documents(self.path, self.notify)
                now = self.clock()
                docs.touch(offered, now)
                docs.add(np.asarray(tokens, dtype=np.int32), now)
                write_documents(self.path, docs)
        except OSError as exc:  # a full disk or a read-only home must not end the session
            self.notify(f"could not save the suffix history ({exc.strerror or exc}); answers go on without it")
            return None
        settled = self.settled if self.settled is not None else self._settle(Documents.empty())
        held = set(settled.ids.tolist())
        new = [i for i, doc in enumerate(docs.ids) if doc not in held]  # this session's answers, other processes' too
        if sum(len(docs.runs[i]) for i in new) > SETTLE_SHARE * max(len(settled), SETTLE_MINIMUM):
            return [self._settle(docs)]
        return [settled, SuffixIndex([docs.runs[i] for i in new], [docs.ids[i] for i in new])]

    def _settle(self, docs: Documents) -> SuffixIndex:
        self.settled = SuffixIndex([*docs.runs, *self.context], [*docs.ids, *[-1] * len(self.context)])
        return self.settled


def forget(model: str | None = None) -> list[Path]:
    """Remove the history of `model` (None: of every model); returns the files removed."""
    folder = history_dir()
    # every model's: those with a file, and those whose only file is one set aside as damaged
    names = [model] if model else sorted({p.name.split(".npz")[0] for p in folder.glob("*.npz*")}) if folder.is_dir() else []
    paths = [history_file(name) for name in names]
    removed = []
    for path in paths:
        with locked(path):
            for leftover in (path, path.with_name(path.name + ".damaged")):
                if leftover.exists():
                    leftover.unlink()
                    removed.append(leftover)
    return removed


def context_documents(paths: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """The token ids of the files the user named (`--context`); a folder is walked for text files
    (hidden ones and binaries passed over). Unreadable or missing paths are the user's error."""
    documents: list[list[int]] = []
    total = 0
    for raw in paths:
        root = Path(raw).expanduser()
        if not root.exists():
            raise LocalspecError(f"--context: {raw} does not exist")
        files = [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
        for file in files:
            text = _text_of(file)
            if text is None and root.is_file():
                raise LocalspecError(f"--context: {raw} is not a text file of at most {CONTEXT_FILE_BYTES >> 20} MB")
            if text is None:
                continue
            total += len(text)
            if total > CONTEXT_TOTAL_BYTES:
                raise LocalspecError(f"--context: more than {CONTEXT_TOTAL_BYTES >> 20} MB of text under {raw}; name fewer files")
            documents.append(encode(text))
    return documents


def _text_of(file: Path) -> str | None:
    """A file's text, or None for a binary or an oversized one (a walk passes over those)."""
    try:
        if file.stat().st_size > CONTEXT_FILE_BYTES:
            return None
        data = file.read_bytes()
    except OSError as exc:
        raise LocalspecError(f"--context: cannot read {file} ({exc.strerror or exc})") from exc
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
