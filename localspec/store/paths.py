"""Where localspec keeps a model's files on this machine, and whether they are there. Each
download or copy is vouched for by a marker written last, so a folder without one is unfinished.

Layout under home_dir():
    models/<name>/hub/                        the hub files; `complete` (holding the revision)
                                              is written once all of them were verified
    models/<name>/gguf/                       an entry's 4-bit GGUF from the hub (its gguf_hub), or a
                                              hub GGUF given as --model; `complete` (the revision and
                                              the file's name) is written once all parts were verified
    models/<name>/<file>                      the joined, verified GGUF of the PyPI mirror
    models/<name>/<file>.sha256               written only after the GGUF was verified
    converted/<name>-<sha12>/gguf/            from a GGUF: header.json (its parsed header), tokenizer/
                                              (built from its metadata), the w4a8 kernel's blocks
                                              laid out from its tensors (w4a8-blocks-v4-<stamp>.pt)
    converted/<name>-<sha12>/<quant>/         a quantized copy of a hub download (int4-g32, int8):
                                              model.safetensors, config, tokenizer files,
                                              quant_layout.json and `complete`, written last; read
                                              memory-mapped; beside it the kernel layout a run packs
    converted/<name>-file/gguf/               the same as gguf/ for the user's own GGUF file,
                                              which stays where it is (never moved or deleted)
    converted/<name>-folder-<stamp12>/<quant>/  a quantized copy of the user's own safetensors
                                              folder (<stamp12>: of its weight files' names, sizes
                                              and times, so a changed folder gets a new copy)
    (<sha12>: of the mirror's GGUF; the hub revision for a model without one)
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from localspec.base.config import home_dir
from localspec.base.files import write_text_atomic
from localspec.store.registry import MirrorSource, ModelEntry

COMPLETE = "complete"
"""The marker a download or copy gets last: without it the folder is unfinished."""


def model_dir(entry: ModelEntry) -> Path:
    return model_folder(entry.name)


def model_folder(name: str) -> Path:
    """What localspec downloads for the model registered as `name`."""
    return home_dir() / "models" / name


def hub_dir(entry: ModelEntry) -> Path:
    return model_dir(entry) / "hub"


def hub_gguf_dir(name: str) -> Path:
    """Where a hub GGUF of the model registered as `name` is fetched to."""
    return model_folder(name) / "gguf"


def fetched_gguf(entry: ModelEntry) -> Path | None:
    """The entry's GGUF fetched from the hub (its gguf_hub), once every part was verified."""
    folder = hub_gguf_dir(entry.name)
    try:
        _revision, file = (folder / COMPLETE).read_text(encoding="utf-8").split()
    except (OSError, ValueError):
        return None
    return folder / file if (folder / file).is_file() else None


def mark_fetched_gguf(folder: Path, revision: str, file: str) -> None:
    """Vouch for a hub GGUF in `folder`: call only after every part was verified."""
    write_text_atomic(folder / COMPLETE, f"{revision} {file}\n")


def hub_snapshot(entry: ModelEntry) -> Path | None:
    """The verified hub download of the entry's pinned revision, or the user's own folder of
    safetensors (read as a download is), if there is one."""
    if entry.folder is not None:
        return entry.folder if (entry.folder / "config.json").is_file() else None
    if entry.gguf is not None:
        return None
    folder = hub_dir(entry)
    try:
        return folder if (folder / COMPLETE).read_text(encoding="utf-8").strip() == entry.revision else None
    except OSError:
        return None


def mark_hub_snapshot(entry: ModelEntry) -> Path:
    """Vouch for the hub download of the pinned revision: call only after every file was verified."""
    write_text_atomic(hub_dir(entry) / COMPLETE, entry.revision + "\n")
    return hub_dir(entry)


def converted_root(entry: ModelEntry) -> Path:
    """The folder of the entry's converted copies: named by its GGUF's hash, or by its hub revision."""
    if entry.gguf is not None:
        return own_file_root(entry.name)
    if entry.folder is not None:
        return home_dir() / "converted" / f"{entry.name}-folder-{_folder_stamp(entry.folder)}"
    tag = entry.mirror.sha256 if entry.mirror is not None else entry.revision
    return home_dir() / "converted" / f"{entry.name}-{tag[:12]}"


def _folder_stamp(folder: Path) -> str:
    """12 hex digits that change when the folder's config or weights change."""
    seen = []
    for path in sorted([folder / "config.json", *folder.glob("*.safetensors")]):
        try:
            stat = path.stat()
        except OSError:
            continue
        seen.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(seen).encode()).hexdigest()[:12]


def own_file_root(name: str) -> Path:
    """The converted copies of the user's own GGUF registered as `name` (its header, tokenizer and
    kernel blocks; the file itself stays where the user keeps it)."""
    return home_dir() / "converted" / f"{name}-file"


def gguf_cache(entry: ModelEntry) -> Path:
    """What a load from the entry's GGUF keeps: header.json, tokenizer/, the w4a8 kernel's blocks."""
    return converted_root(entry) / "gguf"


def is_downloaded(entry: ModelEntry) -> bool:
    """Whether load_model can run without fetching anything."""
    if entry.gguf is not None:
        return entry.gguf.is_file()
    if hub_snapshot(entry) is not None or fetched_gguf(entry) is not None:
        return True
    mirror = entry.mirror
    if mirror is None:
        return False
    target = model_dir(entry) / mirror.file
    return trusted(target, target.with_name(target.name + ".sha256"), mirror)


def local_paths(entry: ModelEntry) -> list[Path]:
    """Every file or folder localspec keeps for this model (downloads and converted caches)."""
    # the user's own file or folder is theirs: only localspec's copies of it are listed (a hub file it fetched is its own)
    own = entry.own is not None and not entry.own.resolve().is_relative_to(model_dir(entry).resolve())
    return [p for p in (() if own else (model_dir(entry),)) + (converted_root(entry),) if p.exists()]


def trusted(target: Path, marker: Path, mirror: MirrorSource) -> bool:
    """Whether the file on disk was verified before; re-hashing a GB on every start is too slow."""
    try:
        if target.stat().st_size != mirror.size:
            return False
        return marker.read_text(encoding="utf-8").strip() == mirror.sha256
    except OSError:
        return False
