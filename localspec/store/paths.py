"""Where localspec keeps a model's files on this machine, and whether they are there. Each
download or copy is vouched for by a marker written last, so a folder without one is unfinished.

Layout under home_dir():
    models/<name>/hub/                        the hub files; `complete` (holding the revision)
                                              is written once all of them were verified
    models/<name>/<file>                      the joined, verified GGUF
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
    (<sha12>: of the mirror's GGUF; the hub revision for a model without one)
"""

from __future__ import annotations

from pathlib import Path

from localspec.base.config import home_dir
from localspec.base.files import write_text_atomic
from localspec.store.registry import MirrorSource, ModelEntry

COMPLETE = "complete"
"""The marker a download or copy gets last: without it the folder is unfinished."""


def model_dir(entry: ModelEntry) -> Path:
    return home_dir() / "models" / entry.name


def hub_dir(entry: ModelEntry) -> Path:
    return model_dir(entry) / "hub"


def hub_snapshot(entry: ModelEntry) -> Path | None:
    """The verified hub download of the entry's pinned revision, if there is one."""
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
    tag = entry.mirror.sha256 if entry.mirror is not None else entry.revision
    return home_dir() / "converted" / f"{entry.name}-{tag[:12]}"


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
    if hub_snapshot(entry) is not None:
        return True
    mirror = entry.mirror
    if mirror is None:
        return False
    target = model_dir(entry) / mirror.file
    return trusted(target, target.with_name(target.name + ".sha256"), mirror)


def local_paths(entry: ModelEntry) -> list[Path]:
    """Every file or folder localspec keeps for this model (downloads and converted caches)."""
    # the user's own file is theirs: only localspec's copies of it are listed (a hub file it fetched is its own)
    own = entry.gguf is not None and not entry.gguf.resolve().is_relative_to(model_dir(entry).resolve())
    return [p for p in (() if own else (model_dir(entry),)) + (converted_root(entry),) if p.exists()]


def trusted(target: Path, marker: Path, mirror: MirrorSource) -> bool:
    """Whether the file on disk was verified before; re-hashing a GB on every start is too slow."""
    try:
        if target.stat().st_size != mirror.size:
            return False
        return marker.read_text(encoding="utf-8").strip() == mirror.sha256
    except OSError:
        return False
