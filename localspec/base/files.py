"""The rules for files localspec writes and the names it builds paths from, in one place. No torch.

- check_name: registry model names, mirror file names and chat ids become path components, so
  they match a strict pattern (no separator, no "..", no leading dot) before any path is built.
- inside: whether a path lies strictly inside a folder once links are resolved (checked before
  deleting it).
- write_text_atomic: readers see the old text or the new, never half of it; each call has its own
  temporary name, so two processes never write the same temporary file.
- locked: an exclusive lock around a read-modify-write of a file two processes may share
  (calibration, pairing history, the user registry); update_json_object is that round for a
  JSON object, read_json_object its reader ({} for a missing or damaged file).
- work_dir: a folder of this process's own for a long write (a download, a conversion); what a
  killed process left of its own is removed by the next one.
- hold / remove_unless_held: a reader holds a finished cache (a shared lock on its marker file)
  for as long as it reads it; a cleanup removes only what nobody holds.

Locks come from portalocker, so that the same rules hold on POSIX (flock) and Windows (LockFileEx);
nothing here needs a POSIX-only module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import portalocker
import psutil
from portalocker import LockFlags

from localspec.base.errors import LocalspecError

if os.name == "nt":
    # Every lock through LockFileEx (portalocker's Win32Locker, pywin32 from its win32 extra):
    # portalocker's default Windows locker waits for an exclusive lock through msvcrt.locking, which
    # gives up after ten seconds, and a download holds its model's lock for minutes.
    from portalocker.portalocker import Win32Locker

    _WINDOWS_LOCKER = Win32Locker()
    _lock, _unlock = _WINDOWS_LOCKER.lock, _WINDOWS_LOCKER.unlock
else:
    _lock, _unlock = portalocker.lock, portalocker.unlock  # its POSIX default: flock

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")
"""A name that is one path component: starts with a letter or digit, then letters, digits, . _ + -."""


def check_name(name: object, what: str) -> str:
    """`name` if it can be used as a single path component; otherwise a one-line error naming it."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or ".." in name:
        raise LocalspecError(
            f"{what} {name!r} is not a valid name (letters, digits and . _ + - only, starting with a letter "
            "or digit, no '..')"
        )
    return name


def inside(path: Path, root: Path) -> bool:
    """Whether `path` lies strictly inside `root` (never `root` itself) once links are resolved."""
    resolved, base = path.resolve(), root.resolve()
    return resolved != base and resolved.is_relative_to(base)


def write_text_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    """Replace `path` with `text`: a reader or a killed process sees the old file or the new one.

    durable=True also syncs the file and its folder, so the new text survives a power cut; the
    chat history, saved after every streamed batch, skips that cost.
    """
    write_atomic(path, lambda out: out.write(text.encode("utf-8")), durable=durable)


def write_atomic(path: Path, write: Callable[[BinaryIO], object], *, durable: bool = True) -> None:
    """Replace `path` with what `write` writes to the open (binary) file it is given, atomically
    as in write_text_atomic."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            write(out)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:  # disk full, Ctrl-C: no temporary left behind, the previous file intact
        Path(tmp).unlink(missing_ok=True)
        raise
    # Windows cannot open a folder to sync it: there the rename is as durable as the file system makes it
    if durable and os.name != "nt":
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def work_dir(parent: Path, prefix: str) -> Path:
    """A new folder in `parent` named `prefix` + this process id; folders of that prefix whose
    process has ended (killed mid-write: a GB-sized download or conversion) are removed first."""
    for old in parent.glob(f"{prefix}*"):
        pid = old.name[len(prefix):].split(".")[0]
        # psutil rather than os.kill(pid, 0): on Windows that signal number is a Ctrl-C sent to the process
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.", dir=parent))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for `path` (on `path`.lock beside it) until the block ends.

    The lock file is never deleted: removing it while another process waits on it would let a
    third process lock a new file and both proceed. The OS drops the lock if the holder dies.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        _lock(handle, LockFlags.EXCLUSIVE)
        try:
            yield
        finally:
            _unlock(handle)


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; {} when the file is missing, damaged or holds another shape."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_json_object(path: Path, change: Callable[[dict], None]) -> None:
    """Apply `change` to the file's object under its lock, so another process's save made meanwhile
    is kept, and write it back atomically, so a crash never leaves half a file. A damaged file is
    replaced, not added to."""
    with locked(path):
        data = read_json_object(path)
        change(data)
        write_text_atomic(path, json.dumps(data, indent=1))


def hold(marker: Path) -> BinaryIO | None:
    """A shared hold on what `marker` vouches for (a finished cache folder's marker file, or a file
    itself): while the returned file stays open, `remove_unless_held` leaves it alone. The OS
    drops the hold when the file is closed or the process ends. None when `marker` does not exist
    (never finished, or removed, also while this call waited for a removal under way)."""
    try:
        handle = open(marker, "rb")
    except (FileNotFoundError, NotADirectoryError):
        return None
    _lock(handle, LockFlags.SHARED)  # waits only while a removal is under way
    try:
        still_there = os.path.samestat(os.fstat(handle.fileno()), os.stat(marker))
    except OSError:
        still_there = False
    if not still_there:
        handle.close()
        return None
    return handle


def remove_unless_held(path: Path, marker: Path, root: Path) -> bool:
    """Delete `path` (a folder or a file strictly inside `root`) unless a reader holds `marker` (see
    `hold`); True if it was removed. The marker goes first, so that nobody can hold what is left
    while it is removed. A folder is removed under its `locked` lock, so that no finished copy is
    moved into place meanwhile; a folder without its marker (unfinished, or half removed by a
    killed cleanup) cannot be held and is removed."""
    if not inside(path, root):
        raise LocalspecError(f"refusing to remove {path}: it is not inside {root}")
    with locked(path) if path.is_dir() else contextlib.nullcontext():
        if not _remove_marker_unless_held(marker):
            return False
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return True


def _remove_marker_unless_held(marker: Path) -> bool:
    """Delete `marker` unless a reader holds it; True once it is gone (or was never there)."""
    try:
        handle = open(marker, "rb")
    except FileNotFoundError:
        return True
    with handle:
        try:
            _lock(handle, LockFlags.EXCLUSIVE | LockFlags.NON_BLOCKING)
        except portalocker.AlreadyLocked:
            return False
        if os.name != "nt":
            # under the lock: a reader waiting for its hold meanwhile finds the marker gone
            marker.unlink()
            return True
    # Windows deletes no file that is open, so the marker goes once closed: a reader that opened it
    # meanwhile (its hold about to be granted) makes the deletion fail, and nothing is removed
    try:
        marker.unlink(missing_ok=True)
    except PermissionError:
        return False
    return True


def size_on_disk(path: Path) -> int:
    """Bytes of a file, or of every file in a folder (links not followed)."""
    if not path.is_dir():
        return path.stat().st_size if path.is_file() else 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
