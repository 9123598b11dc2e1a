"""A model's tokenizer, read from a saved copy; one built from byte-identical files is reused (a
draft shares its target's), and the tokenizer alone comes from whichever local copy is cheapest
to read, the GGUF last."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from localspec.base.errors import LocalspecError
from localspec.base.files import hold
from localspec.store.gguf_mirror import ensure_gguf
from localspec.store.paths import COMPLETE, converted_dirs, hub_snapshot
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
    """Only the tokenizer of a model, from whichever local copy is cheapest to read.

    Falls back to the GGUF (fetching it from the mirror if needed): parsing a GGUF for its
    tokenizer alone takes seconds, not the minute a full conversion does.
    """
    from transformers import AutoTokenizer

    snapshot = hub_snapshot(entry)
    try:
        if snapshot is not None:
            return saved_tokenizer(snapshot)
        for folder in converted_dirs(entry):
            held = hold(folder / COMPLETE)
            if held is not None:  # else removed since it was listed
                with held:
                    return saved_tokenizer(folder)
        gguf = ensure_gguf(entry, progress=progress)
        with transformers_quiet():
            return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError) as exc:
        raise LocalspecError(f"cannot read the tokenizer of {entry.name!r}: {exc}") from exc
