"""What stays on disk: only the formats a run uses. A float32 copy is 4 bytes a weight (7 GB for
1.5B, from a 1.1 GB GGUF), so once a run's models are loaded `discard_unused` removes the copies
and kernel layouts of those models that the run does not read; a later run that asks for one makes
it again. Downloads stay, and so does whatever a model loaded in any process holds (files.hold)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from localspec.base.config import home_dir
from localspec.base.files import remove_unless_held, size_on_disk
from localspec.store.loading import LoadedModel
from localspec.store.paths import COMPLETE
from localspec.store.quantized import KERNEL_LAYOUTS


def discard_unused(*models: LoadedModel | None) -> int:
    """Remove from these models' converted copies what none of them reads: float copies a
    quantized run does not need, formats measured and not chosen, kernel layouts of another format
    or of an older version. Call it once a run's models are loaded. Downloads stay, and so does
    whatever a model loaded anywhere holds (files.hold); a later run that needs a removed copy
    makes it again. Returns the bytes freed."""
    used: dict[Path, set[Path]] = {}
    for loaded in models:
        if loaded is not None and loaded.cache_root is not None:
            used.setdefault(loaded.cache_root, set()).update(loaded.cache_files)
    freed = 0
    for root, files in used.items():
        for path, marker in _unused(root, files):
            size = size_on_disk(path)
            if remove_unless_held(path, marker, home_dir() / "converted"):
                freed += size
    return freed


def _unused(root: Path, used: set[Path]) -> Iterator[tuple[Path, Path]]:
    """(path, the marker whose holders keep it) of each copy in `root` and each kernel layout beside
    a copy in use that `used` does not name."""
    if not root.is_dir():
        return
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue  # lock files, and writes in progress (files.work_dir; swept by the next writer)
        if folder not in used:
            yield folder, folder / COMPLETE
            continue
        for pattern in KERNEL_LAYOUTS:
            for layout in sorted(folder.glob(pattern)):
                if layout not in used:
                    yield layout, layout
