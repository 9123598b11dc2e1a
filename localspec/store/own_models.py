"""Models the user already has: `--model ./file.gguf` (or a split set's first part) is registered
on first use as an entry of the user's registry overlay, named after the file (`--name` to
choose), and from then on is a model like any other. A hub GGUF, `org/repo/file.gguf` or
`org/repo:Q4_K_M` (the repository's file of that quantization), is fetched once, at the revision
the hub serves then, and registered the same way (`localspec models`, pairings, `rm`, which
removes only localspec's copies, never the file). The file is read in place and never changed.

A name that is not a path is returned as it is: the registry resolves it.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from pathlib import Path

from localspec.base.errors import LocalspecError
from localspec.base.files import check_name
from localspec.store.paths import own_file_root
from localspec.store.registry import load_registry, save_user_model


_HUB_FILE = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)/(?P<file>[\w./-]+\.gguf)$")
_HUB_QUANT = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+:[\w.-]+$")


def is_path(reference: str) -> bool:
    """Whether a --model value names a file rather than a registry entry."""
    return reference.lower().endswith(".gguf") or os.sep in reference or reference.startswith(".")


def resolve(reference: str | None, name: str | None = None) -> str | None:
    """The registry name for a --model / --draft value: a registered name as it is; a GGUF path,
    or a hub file `org/repo/file.gguf` or `org/repo:QUANT` (fetched once), registered (once) and
    its entry's name."""
    if reference is None:
        return None
    local = Path(os.path.expanduser(reference))
    if _HUB_QUANT.match(reference) and not local.exists():
        from localspec.store.hub import quant_file

        repo, quant = reference.split(":")
        return _register_hub_file(repo, quant_file(repo, quant), name)
    if (match := _HUB_FILE.match(reference)) and not local.exists() and not reference.startswith((".", "/", "~")):
        return _register_hub_file(match["repo"], match["file"], name)
    if not is_path(reference):
        return reference
    path = Path(os.path.abspath(local))
    shown = str(path).encode("utf-8", "backslashreplace").decode("utf-8")
    if path.is_dir():
        raise LocalspecError(f"{shown} is a folder; localspec reads a model from its .gguf file (pass the file)")
    if not path.is_file():
        raise LocalspecError(f"no such file: {shown}")
    text = str(path)
    try:
        text.encode("utf-8")  # bytes that are not UTF-8 come back from the OS as lone surrogates
    except UnicodeEncodeError:
        raise LocalspecError(f"{shown}: the path is not valid UTF-8, which the model registry cannot record; "
                             "rename the file or link it from a UTF-8 path") from None
    registry = load_registry()
    for entry in registry.models.values():
        if entry.gguf is not None and str(entry.gguf) == text and (name is None or name == entry.name):
            return entry.name
    name = check_name(name, "--name") if name is not None else derived_name(path)
    if name in registry.models and registry.models[name].gguf is None:
        raise LocalspecError(f"{name!r} is already a model of the registry; choose another with --name")
    from localspec.store.gguf_model import GGUFSource

    source = GGUFSource(path, own_file_root(name) / "gguf" / "header.json")
    save_user_model(name, entry_body(source, text))
    return name


def _register_hub_file(repo: str, file: str, name: str | None) -> str:
    registry = load_registry()
    for entry in registry.models.values():
        if entry.gguf is not None and entry.hub_repo == repo and entry.gguf.name == Path(file).name \
                and (name is None or name == entry.name) and entry.gguf.is_file():
            return entry.name
    name = check_name(name, "--name") if name is not None else derived_name(Path(file))
    if name in registry.models:
        raise LocalspecError(f"{name!r} is already a model of the registry; choose another with --name")
    from localspec.store.gguf_model import GGUFSource
    from localspec.store.hub import fetch_gguf

    path, revision = fetch_gguf(name, repo, file)
    try:
        source = GGUFSource(path, own_file_root(name) / "gguf" / "header.json")
        body = entry_body(source, str(path), f"from {repo}")
    except LocalspecError:  # a download that is no model: nothing of it stays
        shutil.rmtree(path.parents[len(Path(file).parts)], ignore_errors=True)  # models/<name>
        shutil.rmtree(own_file_root(name), ignore_errors=True)
        raise
    save_user_model(name, {**body, "hub_repo": repo, "revision": revision})
    return name


def derived_name(path: Path) -> str:
    """A registry name from a file name: lower case, runs of other characters as '-', the split
    set's part suffix dropped ("Qwen2.5-7B-Instruct-Q4_K_M-00001-of-00002.gguf" -> "qwen2.5-7b-instruct-q4_k_m")."""
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name)
    name = re.sub(r"[^a-z0-9._+-]+", "-", stem.lower()).strip("-.") or "model"
    return check_name(re.sub(r"\.{2,}", ".", name), "a name made from the file name")


def entry_body(source, path: str, whose: str = "your file") -> dict:
    """The registry fields of a GGUF: architecture, size, parameters and cache per token from its header."""
    config = source.config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    elements = sum(math.prod(t.shape) for t in source.tensors.values())
    from gguf import LlamaFileType

    try:
        kind = LlamaFileType(int(source.field("general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        kind = "GGUF"
    return {
        "display": f"{Path(path).name} ({kind}, {whose})",
        "arch": source.arch, "gguf": path,
        "params": round(elements / 1e9, 3), "size": source.size,
        "kv_per_token": 2 * config.num_hidden_layers * kv_heads * head_dim,
    }
