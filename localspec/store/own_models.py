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

from localspec.base.errors import LocalspecError, first_line
from localspec.base.files import check_name
from localspec.store.paths import hub_gguf_dir, model_folder, own_file_root
from localspec.store.registry import HUB_GGUF_FILE, HUB_GGUF_QUANT, load_registry, save_user_model


def is_path(reference: str) -> bool:
    """Whether a --model value names a file or folder rather than a registry entry."""
    return reference.lower().endswith(".gguf") or os.sep in reference or reference.startswith(".")


def resolve(reference: str | None, name: str | None = None) -> str | None:
    """The registry name for a --model / --draft value: a registered name as it is; a GGUF path,
    a folder of safetensors, or a hub file `org/repo/file.gguf` or `org/repo:QUANT` (fetched
    once), registered (once) and its entry's name."""
    if reference is None:
        return None
    local = Path(os.path.expanduser(reference))
    if not local.exists() and (HUB_GGUF_QUANT.fullmatch(reference)
                               or (HUB_GGUF_FILE.fullmatch(reference) and not reference.startswith((".", "/", "~")))):
        return _register_hub_file(reference, name)
    if not is_path(reference):
        return reference
    path = Path(os.path.abspath(local))
    shown = str(path).encode("utf-8", "backslashreplace").decode("utf-8")
    if not path.exists():
        raise LocalspecError(f"no such file or folder: {shown}")
    text = str(path)
    try:
        text.encode("utf-8")  # bytes that are not UTF-8 come back from the OS as lone surrogates
    except UnicodeEncodeError:
        raise LocalspecError(f"{shown}: the path is not valid UTF-8, which the model registry cannot record; "
                             "rename it or link it from a UTF-8 path") from None
    registry = load_registry()
    for entry in registry.models.values():
        if entry.own is not None and str(entry.own) == text and (name is None or name == entry.name):
            return entry.name
    name = check_name(name, "--name") if name is not None else derived_name(path)
    registered = registry.models.get(name)
    # a name may move to another file (or folder) of the same kind, never take over any other entry
    if registered is not None and (registered.own is None or (registered.folder is not None) != path.is_dir()):
        raise LocalspecError(f"{name!r} is already a model of the registry; choose another with --name")
    if path.is_dir():
        body = folder_body(path, shown)
    else:
        from localspec.store.gguf_model import GGUFSource

        body = entry_body(GGUFSource(path, own_file_root(name) / "gguf" / "header.json"), text)
    save_user_model(name, body)
    return name


def _register_hub_file(reference: str, name: str | None) -> str:
    registry = load_registry()
    for entry in registry.models.values():  # registered before: no need to ask the hub
        if entry.gguf is not None and entry.gguf_hub == reference and (name is None or name == entry.name) \
                and entry.gguf.is_file():
            return entry.name
    from localspec.store.gguf_model import GGUFSource
    from localspec.store.hub import fetch_gguf, hub_gguf

    repo, file = hub_gguf(reference)
    name = check_name(name, "--name") if name is not None else derived_name(Path(file))
    if name in registry.models:
        raise LocalspecError(f"{name!r} is already a model of the registry; choose another with --name")
    path, revision = fetch_gguf(name, repo, file, folder=hub_gguf_dir(name))
    try:
        source = GGUFSource(path, own_file_root(name) / "gguf" / "header.json")
        body = entry_body(source, str(path), f"from {repo}")
    except LocalspecError:  # a download that is no model: nothing of it stays
        shutil.rmtree(model_folder(name), ignore_errors=True)
        shutil.rmtree(own_file_root(name), ignore_errors=True)
        raise
    save_user_model(name, {**body, "hub_repo": repo, "revision": revision, "gguf_hub": reference})
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
    elements = sum(math.prod(t.shape) for t in source.tensors.values())
    from gguf import LlamaFileType

    try:
        kind = LlamaFileType(int(source.field("general.file_type"))).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        kind = "GGUF"
    return {
        "display": f"{Path(path).name} ({kind}, {whose})",
        "arch": source.arch, "gguf": path,
        "params": round(elements / 1e9, 3), "size": source.size, "kv_per_token": kv_per_token(config),
    }


def kv_per_token(config) -> int:
    """Cached values per token: 2 (keys, values) x layers x kv heads x head dim."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim


def folder_body(path: Path, shown: str) -> dict:
    """The registry fields of a folder of Hugging Face safetensors (config.json, the weights, the
    tokenizer files), from its config and the weights' headers; anything it lacks is one line."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    weights = sorted(path.glob("*.safetensors"))
    if not (path / "config.json").is_file():
        raise LocalspecError(f"{shown} is a folder without config.json; localspec reads a folder of Hugging Face "
                             "safetensors (config.json, *.safetensors, tokenizer files) or a .gguf file")
    if not weights:
        pickles = " (it has PyTorch .bin files, which can run code when loaded: convert them to safetensors)" \
            if any(path.glob("*.bin")) else ""
        raise LocalspecError(f"{shown} has no .safetensors weights{pickles}")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise LocalspecError(f"{shown} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:
        raise LocalspecError(f"{shown}/config.json cannot be read: {first_line(exc)}") from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise LocalspecError(f"{shown}: architecture {config.model_type!r} is not a causal language model "
                             "transformers can run")
    from safetensors import SafetensorError, safe_open

    elements = 0
    for file in weights:
        try:
            with safe_open(file, "pt") as tensors:
                elements += sum(math.prod(tensors.get_slice(k).get_shape()) for k in tensors.keys())
        except (OSError, SafetensorError) as exc:
            raise LocalspecError(f"{file.name} in {shown} is not a readable safetensors file ({first_line(exc)})") from None
    return {
        "display": f"{path.name} (safetensors, your folder)", "arch": config.model_type, "folder": str(path),
        "params": round(elements / 1e9, 3), "size": sum(f.stat().st_size for f in weights),
        "kv_per_token": kv_per_token(config),
    }
