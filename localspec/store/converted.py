"""What every copy under converted/ shares, and a hub download read as it is: a copy is staged
beside its folder and renamed in once finished, its weights are written by hand, and one that
cannot be read is removed so that the next load makes it again. (A GGUF is never converted: it is
streamed, gguf_model.)"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator

import torch

from localspec.base.errors import LocalspecError, first_line, is_out_of_memory
from localspec.base.files import locked, work_dir
from localspec.store.paths import COMPLETE
from localspec.store.progress import say
from localspec.store.registry import ModelEntry
from localspec.store.tokenizers import saved_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WEIGHTS = "model.safetensors"
"""The weights file of every copy."""

@dataclass
class Weights:
    """A model read from one of the caches, what it read there, and the holds on that."""

    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    files: tuple[Path, ...] = ()
    holds: list[BinaryIO] = field(default_factory=list)
    cold: bool = False


def load_snapshot(entry: ModelEntry, path: Path, dtype: torch.dtype | str):
    """(model, tokenizer) from a verified hub download or the user's own folder (`dtype` "auto":
    the files' own); unlike a cache it is never deleted here."""
    try:
        return _from_pretrained(entry, path, dtype)
    except LocalspecError:
        raise
    except Exception as exc:
        if entry.folder is not None:
            raise LocalspecError(f"cannot load {entry.name!r} from your folder {path}: {first_line(exc)}") from exc
        raise LocalspecError(
            f"cannot load the download of {entry.name!r} in {path} ({first_line(exc)}); "
            f"`localspec rm {entry.name}` and pull it again"
        ) from exc


def _from_pretrained(entry: ModelEntry, path: Path, dtype: torch.dtype | str):
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = saved_tokenizer(path)
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    except Exception as exc:
        # Running out of memory says nothing about the files: the caller must not discard them.
        if is_out_of_memory(exc):
            raise LocalspecError(
                f"not enough memory to load {entry.name} in {str(dtype).removeprefix('torch.')} weights: {exc}"
            ) from exc
        raise
    # A missing tensor is not an error to transformers (it initialises it randomly), but it
    # is to us: the output would silently be garbage.
    bad = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    if bad or info.get("error_msgs"):
        raise ValueError(f"weights do not match the model: {bad or info['error_msgs']}")
    return model, tokenizer


@contextlib.contextmanager
def staging(final: Path) -> Iterator[Path]:
    """A fresh dir beside `final`; renamed onto it with a `complete` marker if the body succeeds.

    On any failure (disk full, Ctrl-C, a bad conversion) the staging dir is removed, so
    whatever was at `final` before is left as it was.
    """
    from safetensors import SafetensorError

    tmp = None
    try:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = work_dir(final.parent, f".{final.name}.")
            yield tmp
            (tmp / COMPLETE).write_text("ok\n", encoding="utf-8")
            # Another process converting the same model may have finished first and be reading
            # its copy now: a finished copy is kept (ours is dropped), only a broken one replaced.
            with locked(final):
                if not (final / COMPLETE).is_file():
                    if final.exists():
                        shutil.rmtree(final)
                    os.replace(tmp, final)
        # safetensors reports a full disk as its own error type, not OSError.
        except (OSError, SafetensorError) as exc:
            raise LocalspecError(f"could not write the converted model to {final}: {exc}") from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_cache(model, tokenizer, out_dir: Path) -> None:
    from safetensors.torch import save_file

    # A GGUF-loaded model refuses save_pretrained, so the weights are written by hand.
    # safetensors rejects tensors that share memory. Tied weights (lm_head sharing
    # embed_tokens) are the same view twice: only the first name is kept, and
    # config.tie_word_embeddings re-ties them on load. Any other sharing gets its own copy.
    tensors = {}
    views: set[tuple] = set()
    storages: set[int] = set()
    for key, tensor in model.state_dict().items():
        storage = tensor.untyped_storage().data_ptr()
        view = (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if view in views:
            continue
        views.add(view)
        tensor = tensor.detach()
        tensors[key] = tensor.clone() if storage in storages else tensor.contiguous()
        storages.add(storage)
    save_file(tensors, str(out_dir / WEIGHTS), metadata={"format": "pt"})

    config = copy.deepcopy(model.config)
    # The GGUF loader marks the config as GGUF-quantized; the copy holds plain tensors, and
    # keeping the mark would send the next load looking for a .gguf file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = model.dtype
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def discard_unreadable(entry: ModelEntry, path: Path, exc: Exception, progress: bool, then: str) -> None:
    """Remove a cache that failed to load (truncated file, half-deleted dir, ...) so that the caller
    makes it again instead of failing on every start. Held or not: no one can load it any more, and
    a model loaded before the damage keeps what it read (a removed file's data stays while open)."""
    say(progress, f"the copy of {entry.name} in {path} is unreadable ({first_line(exc)}); {then}")
    shutil.rmtree(path, ignore_errors=True)
