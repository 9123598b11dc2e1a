"""Where localspec keeps a model's files on this machine, and whether they are there. Each
download or copy is vouched for by a marker written last, so a folder without one is unfinished.

Layout under home_dir():
    models/<name>/hub/                        the hub files; `complete` (holding the revision)
                                              is written once all of them were verified
    models/<name>/<file>                      the joined, verified GGUF
    models/<name>/<file>.sha256               written only after the GGUF was verified
    converted/<name>-<sha12>/<dtype>/         model.safetensors, config.json, tokenizer files,
                                              and `complete`, written last
    converted/<name>-<sha12>/<quant>/         the same for a quantized copy (int4-g32, int8)
                                              plus quant_layout.json; read memory-mapped; beside
                                              it the kernel layout a run packs from it (w4a8
                                              blocks, torch's int4 layout)
    (<sha12>: of the GGUF; the hub revision for a model without one)
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
    tag = entry.mirror.sha256 if entry.mirror is not None else entry.revision
    return home_dir() / "converted" / f"{entry.name}-{tag[:12]}"


def converted_dirs(entry: ModelEntry) -> list[Path]:
    """Finished converted caches of the entry, any format, float32 first."""
    if entry.mirror is None:
        return []
    root = converted_root(entry)
    return sorted((p.parent for p in root.glob(f"*/{COMPLETE}")), key=lambda p: p.name != "float32")


def is_downloaded(entry: ModelEntry) -> bool:
    """Whether load_model can run without fetching anything."""
    if hub_snapshot(entry) is not None or converted_dirs(entry):
        return True
    mirror = entry.mirror
    if mirror is None:
        return False
    target = model_dir(entry) / mirror.file
    return trusted(target, target.with_name(target.name + ".sha256"), mirror)


def local_paths(entry: ModelEntry) -> list[Path]:
    """Every file or folder localspec keeps for this model (downloads and converted caches)."""
    return [p for p in (model_dir(entry), converted_root(entry)) if p.exists()]


def trusted(target: Path, marker: Path, mirror: MirrorSource) -> bool:
    """Whether the file on disk was verified before; re-hashing a GB on every start is too slow."""
    try:
        if target.stat().st_size != mirror.size:
            return False
        return marker.read_text(encoding="utf-8").strip() == mirror.sha256
    except OSError:
        return False
