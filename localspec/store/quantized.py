"""Quantized copies (int4 in groups, int8) of a hub download, made once from its float weights and read
back memory-mapped into a model built on the meta device, so the first run computes with exactly
the weights every later run loads. Beside each copy lies the kernel layout a run packs from it
(w4a8 blocks, torch's int4 CPU layout), made the first time a run needs it."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

from localspec.base.errors import LocalspecError, is_out_of_memory
from localspec.base.files import hold, write_text_atomic
from localspec.runtime import quant as quantization
from localspec.store.converted import WEIGHTS, Weights, discard_unreadable, load_snapshot, staging, write_cache
from localspec.store.paths import COMPLETE, converted_root
from localspec.store.progress import say
from localspec.store.registry import ModelEntry
from localspec.store.tokenizers import saved_tokenizer

_QUANT_LAYOUT = "quant_layout.json"

KERNEL_LAYOUTS = (quantization.W4A8_LAYOUTS, "cpu-layout-torch*.pt")
"""Every name a kernel layout beside a quantized cache has had (other versions, other torch builds)."""


def _quant_dir(entry: ModelEntry, quant: str) -> Path:
    name = f"{quant}-g{quantization.GROUP_SIZE}" if quant == "int4" else quant
    return converted_root(entry) / name


def load_quantized(entry: ModelEntry, run_as: str, snapshot: Path, progress: bool) -> Weights:
    """The quantized cache of the format `run_as` runs on, made on first use from the hub
    download's float32 weights (a GGUF is streamed instead: gguf_model).

    The cache is read back even right after writing it, so the first run computes with exactly
    the weights every later run loads.
    """
    quant = quantization.stored_format(run_as)
    path = _quant_dir(entry, quant)
    weights = _load_quant_cache(entry, path, progress, run_as)
    if weights is None:
        # in the file's own dtype, not float32: each linear is quantized from its float32 copy in
        # turn, which is the same numbers, and a 16-bit 7B then needs 15 GB here rather than 30
        model, tokenizer = load_snapshot(entry, snapshot, "auto")
        say(progress, f"quantizing {entry.name} to {quant} (once)")
        layout = quantization.quantize_model(model, quant, torch.device("cpu"))
        model.to(quantization.COMPUTE_DTYPE)  # what is left in float: norms, embedding, biases
        with staging(path) as tmp:
            write_cache(model, tokenizer, tmp)
            write_text_atomic(tmp / _QUANT_LAYOUT, json.dumps(layout, indent=1) + "\n")
        del model
        gc.collect()
        weights = _load_quant_cache(entry, path, progress, run_as)
        if weights is None:
            raise LocalspecError(f"the quantized copy of {entry.name!r} in {path} is unreadable")
        weights.cold = True
    return weights


def _load_quant_cache(entry: ModelEntry, path: Path, progress: bool, run_as: str) -> Weights | None:
    """The model in a finished quantized cache, held; None if missing (removed if unreadable).

    The model is built on the meta device (no memory, no random init), the quantized modules are
    put in place, and the tensors are adopted straight from the memory-mapped file; then the
    kernel layout of the format it runs as (`run_as`) is read from beside it (packed and stored
    there the first time).
    """
    held = hold(path / COMPLETE)
    if held is None:
        return None
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    layout_file = path / (quantization.W4A8_LAYOUT if run_as == "w4a8" else _cpu_layout_name())
    try:
        layout = json.loads((path / _QUANT_LAYOUT).read_text(encoding="utf-8"))
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=quantization.COMPUTE_DTYPE)
        quantization.install_shells(model, layout)
        state = load_file(str(path / WEIGHTS))
        if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state and "lm_head" not in layout:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        _materialize_buffers(model)
        if run_as == "w4a8":
            quantization.use_w4a8(model, layout_file)
        else:
            quantization.prepare_for_cpu(model, layout_file)
        if (path / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(path)
        tokenizer = saved_tokenizer(path)
    except Exception as exc:
        held.close()
        # the kernel cannot run here (LocalspecError), or the machine is short of memory: the files are fine
        if isinstance(exc, LocalspecError) or is_out_of_memory(exc):
            raise
        discard_unreadable(entry, path, exc, progress, "quantizing it again")
        return None
    holds = [held]
    if (layout_held := hold(layout_file)) is not None:  # absent when the format has no layout
        holds.append(layout_held)
    return Weights(model, tokenizer, (path, layout_file), holds)


def _materialize_buffers(model: torch.nn.Module) -> None:
    """Buffers that are computed, not stored (rotary frequencies), are rebuilt off the meta device."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if "rotary" not in type(module).__name__.lower():
                raise ValueError(f"{name} has buffers that are neither stored nor computable")
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, type(module)(config=model.config))
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"tensors missing from the cache: {missing[:3]}")


def _cpu_layout_name() -> str:
    """The CPU kernels' own weight layout depends on the torch build that made it."""
    return f"cpu-layout-torch{torch.__version__.replace('+', '-')}.pt"
