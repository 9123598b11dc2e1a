"""A model straight from its GGUF file(s), with the file's own numbers, in little more than the
file's memory.

`GGUFSource` memory-maps the file (or every part of a split set, `-00001-of-0000N.gguf`) with the
gguf package's reader and parses only the header: a hostile file (truncated, garbage, a tensor
that lies about its size or offset) is one `LocalspecError` line, and the file is only ever read.

`build_model` makes the transformers model on the meta device and fills it one tensor at a time:
- w4a8 (x86 CPUs): 4-bit tensors (Q4_0/Q4_1/Q4_K) into the kernel's 4-bit blocks, 5- and 6-bit
  ones (Q5_*/Q6_K) into its 6-bit blocks, Q8_0 into its 8-bit ones, each with the file's own scales and mins
  (`gguf_blocks`); float tensors and other types float32 (the gguf package's de-quantizer);
- int4 (GPUs, MPS, CPUs without the kernel): 4-bit tensors as `Int4Linear` with their own numbers,
  the rest bf16 (more bits than the file has, never fewer);
- none: every tensor de-quantized to the asked dtype, one at a time;
- int8 / w8a8 / nf4: as none in bf16, then quantized layer by layer as for any model.
The token embedding keeps the file's rows and de-quantizes those a pass looks up (`GGUFEmbedding`).
No float copy of the model exists at any time, and the kernel blocks are stored once beside the
model's cache (`blocks_file`) so that later loads memory-map them instead of re-laying the file.

Architectures: the dense decoders whose tensors transformers' GGUF reader maps one to one
(`ARCHITECTURES`); any other is refused in one line naming it.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from localspec.base.errors import LocalspecError, first_line
from localspec.base.files import write_text_atomic
from localspec.runtime import quant as quantization
from localspec.store.gguf_blocks import block_bits, decode

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType
    from transformers import PretrainedConfig, PreTrainedModel

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
"""GGUF architecture -> transformers model type, for the dense decoders this loader fills."""
_PERMUTED = {"llama"}
"""Architectures whose q/k rows llama.cpp's converter interleaved for its rotary layout."""
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<total>\d{5})\.gguf$")


def gguf_parts(path: Path) -> list[Path]:
    """Every file of the set `path` belongs to: itself, or the N parts of a split set."""
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    total = int(match["total"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{total:05d}.gguf") for i in range(1, total + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise LocalspecError(f"{path.name} is part of a split GGUF whose part(s) {', '.join(missing)} are missing")
    return parts


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int
    shape: tuple[int, ...]  # transformers' order: (rows, ..., inputs)
    part: int
    offset: int  # from the start of the part's file
    nbytes: int


class GGUFSource:
    """The header of one model's GGUF file(s); tensors stay in the memory-mapped files.

    The gguf package's reader parses a header in seconds (13 s for a 150k-token vocabulary), so
    what a load needs of it (the scalar fields, each tensor's type, shape and place) is kept in
    `index` (JSON, beside the model's cache) and read from there while the files are unchanged
    (same sizes and modification times)."""

    def __init__(self, path: Path, index: Path | None = None) -> None:
        self.paths = gguf_parts(Path(path))
        self.stamps = [[p.stat().st_size, p.stat().st_mtime_ns] for p in self.paths]
        """Each file's size and modification time: what the index and the kernel blocks are keyed by."""
        header = _read_index(index, self.stamps) if index is not None else None
        if header is None:
            header = self._parse(self.stamps)
            if index is not None:
                try:
                    index.parent.mkdir(parents=True, exist_ok=True)
                    write_text_atomic(index, json.dumps(header))
                except OSError:
                    pass  # a read-only home: the next load parses the header again
        self.fields: dict = header["fields"]
        self.tensors = {t[0]: TensorInfo(t[0], t[1], tuple(t[2]), t[3], t[4], t[5]) for t in header["tensors"]}
        self._maps: dict[int, np.memmap] = {}
        self.arch = self.fields.get("general.architecture")
        if not isinstance(self.arch, str):
            raise LocalspecError(f"{_shown(self.paths[0])} names no architecture (general.architecture)")
        if self.arch not in ARCHITECTURES:
            raise LocalspecError(
                f"{_shown(self.paths[0])}: architecture {self.arch!r} is not supported by localspec's GGUF loader "
                f"(supported: {', '.join(sorted(ARCHITECTURES))})")
        for name in ("token_embd.weight", "blk.0.attn_q.weight"):
            if name not in self.tensors:
                raise LocalspecError(f"{_shown(self.paths[0])} has no tensor {name!r}: not a complete {self.arch} model")

    def _parse(self, stamps: list[list[int]]) -> dict:
        from gguf import GGUFReader

        fields, tensors = {}, []
        for part, (path, (size, _)) in enumerate(zip(self.paths, stamps)):
            try:
                reader = GGUFReader(path, "r")
                for key, field in reader.fields.items():
                    if part == 0 and (len(field.data) <= 1 or key.startswith("general.")) and not key.startswith("tokenizer.ggml.tokens"):
                        value = field.contents()
                        if isinstance(value, (str, int, float, bool)) or (isinstance(value, list) and len(value) <= 64):
                            fields[key] = value
                for t in reader.tensors:
                    if t.data_offset + t.n_bytes > size:
                        raise ValueError(f"tensor {t.name} lies past the end of the file")
                    shape = [int(x) for x in reversed(t.shape.tolist())]
                    tensors.append([t.name, int(t.tensor_type), shape, part, int(t.data_offset), int(t.n_bytes)])
            except Exception as exc:  # the reader raises whatever numpy or struct meets in a bad file
                raise LocalspecError(f"{_shown(path)} is not a readable GGUF file ({first_line(exc)})") from None
        return {"stamps": stamps, "fields": fields, "tensors": tensors}

    @property
    def size(self) -> int:
        return sum(size for size, _ in self.stamps)

    def field(self, key: str, default=None):
        return self.fields.get(key, default)

    def config(self) -> "PretrainedConfig":
        """The transformers config the header describes (transformers' own key mapping)."""
        from transformers import AutoConfig
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        model_type = ARCHITECTURES[self.arch]
        values = {}
        for key, name in GGUF_CONFIG_MAPPING[self.arch].items():
            value = self.field(f"{self.arch}.{key}")
            if name is not None and value is not None:
                values[name] = value
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
            value = self.field(f"tokenizer.ggml.{key}")  # what the file does not state stays unset, not transformers' default
            values[name] = int(value) if value is not None else None
        values["vocab_size"] = int(self.tensors["token_embd.weight"].shape[0])
        values["tie_word_embeddings"] = "output.weight" not in self.tensors
        if "rope_theta" in values:
            values["rope_parameters"] = {"rope_type": "default", "rope_theta": float(values.pop("rope_theta"))}
        try:
            return AutoConfig.for_model(model_type, **values)
        except Exception as exc:
            raise LocalspecError(f"{_shown(self.paths[0])}: its header does not describe a {model_type} model ({first_line(exc)})") from None

    def qtype(self, name: str) -> "GGMLQuantizationType":
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensors[name].qtype)

    def raw(self, name: str) -> torch.Tensor:
        """(rows, bytes per row) uint8: the tensor as stored, a view of the mapped file."""
        info = self.tensors[name]
        if info.part not in self._maps:
            self._maps[info.part] = np.memmap(self.paths[info.part], dtype=np.uint8, mode="r")
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        data = self._maps[info.part][info.offset : info.offset + info.nbytes].reshape(rows, -1)
        with warnings.catch_warnings():  # read-only by design: nothing here writes to a file's tensor
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)

    def release(self, name: str | None = None) -> None:
        """Drop the pages of a tensor (None: of every file) from this process's memory; they stay
        in the page cache and a later read faults them in again. A tensor laid out into the
        kernel's blocks is not read again, and keeping its pages would hold the model twice."""
        if name is None:
            spans = [(part, 0, len(mapped)) for part, mapped in self._maps.items()]
        else:
            info = self.tensors[name]
            spans = [(info.part, info.offset, info.nbytes)] if info.part in self._maps else []
        for part, offset, nbytes in spans:
            start = offset // mmap.PAGESIZE * mmap.PAGESIZE
            try:
                self._maps[part]._mmap.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
            except (AttributeError, OSError, ValueError):
                pass  # no madvise here: the pages stay until the kernel wants them

    def dense(self, name: str) -> torch.Tensor:
        """The tensor de-quantized by the gguf package (float32), in transformers' shape."""
        from gguf.quants import dequantize

        values = dequantize(self.raw(name).numpy(), self.qtype(name))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.tensors[name].shape)


def _read_index(index: Path, stamps: list[list[int]]) -> dict | None:
    try:
        header = json.loads(index.read_text(encoding="utf-8"))
        return header if header.get("stamps") == stamps else None
    except (OSError, ValueError, AttributeError):
        return None


def _shown(path: Path) -> str:
    """A path for a message: bytes that are not UTF-8 shown escaped rather than breaking the line."""
    return str(path).encode("utf-8", "backslashreplace").decode("utf-8")


class GGUFEmbedding(torch.nn.Module):
    """The token embedding as the file stores it: a lookup de-quantizes only the rows it reads
    (the gguf package's de-quantizer), so the vocabulary's table costs its file size, not float32."""

    def __init__(self, raw: torch.Tensor, qtype, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.raw, self.qtype = raw, qtype  # (V, bytes per row) uint8, memory-mapped
        self.num_embeddings, self.embedding_dim, self.dtype = raw.shape[0], embedding_dim, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (...) -> (..., H)
        values = self._rows(ids.reshape(-1).cpu())  # (T, H) float32
        return values.reshape(*ids.shape, self.embedding_dim).to(device=ids.device, dtype=self.dtype)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        raw = self.raw[ids].numpy()  # (T, bytes per row)
        return torch.from_numpy(dequantize(raw, self.qtype).astype(np.float32, copy=False))

    def dense_weight(self) -> torch.Tensor:
        """The whole (V, H) table in float32 (a new tensor)."""
        return self._rows(torch.arange(self.num_embeddings))

    @property
    def weight(self) -> torch.Tensor:
        """What code that reads `.weight` for a dtype or device sees (not the numbers: dense_weight)."""
        return torch.empty(0, dtype=self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} rows from the file"


def blocks_file(source: GGUFSource, folder: Path) -> Path:
    """Where the w4a8 kernel's blocks of this file are kept: named by the files' sizes and times, so
    a changed file is laid out again (cleanup removes the stale one)."""
    stamp = hashlib.sha256(json.dumps(source.stamps).encode()).hexdigest()
    return folder / quantization.W4A8_LAYOUT.replace(".pt", f"-{stamp[:12]}.pt")


def build_model(source: GGUFSource, quant: str, dtype: torch.dtype, blocks_file: Path | None) -> "PreTrainedModel":
    """The model of `source` in the weight format `quant` (see the module docstring)."""
    from accelerate import init_empty_weights
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = source.config()
    streamed = quant if quant in ("w4a8", "int4") else "none"
    float_dtype = torch.float32 if streamed == "w4a8" else quantization.COMPUTE_DTYPE if streamed == "int4" else \
        (dtype if quant == "none" else quantization.COMPUTE_DTYPE)
    with init_empty_weights(include_buffers=False):  # parameters on meta; computed buffers (rotary) real
        model = AutoModelForCausalLM.from_config(config, dtype=float_dtype)
    arch = {name: key for key, name in MODEL_ARCH_NAMES.items()}[source.arch]
    names = get_tensor_name_map(arch, config.num_hidden_layers)

    def file_name(module_name: str, suffix: str) -> str | None:
        base = names.get_name(module_name)
        return f"{base}.{suffix}" if base is not None and f"{base}.{suffix}" in source.tensors else None

    blocks: dict[str, quantization.BlockSource] = {}
    for module_name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Embedding):
            _fill_embedding(model, module_name, module, source, file_name(module_name, "weight"), streamed, float_dtype)
        elif isinstance(module, torch.nn.Linear):
            weight_name = file_name(module_name, "weight")
            if weight_name is None and module_name == "lm_head" and config.tie_word_embeddings:
                weight_name = "token_embd.weight"
            if weight_name is None:
                raise LocalspecError(f"{_shown(source.paths[0])} has no tensor for {module_name}")
            rows = _row_order(source, config, weight_name, module.out_features)
            bias_name = file_name(module_name, "bias")
            bias = None if bias_name is None else _rows(source.dense(bias_name), rows)
            bits = block_bits(source.qtype(weight_name))
            if streamed == "w4a8" and bits is not None:
                blocks[module_name] = quantization.BlockSource(
                    module.in_features, module.out_features, bits, bias,
                    lambda w=weight_name, r=rows: _pack(source, w, r))
            elif streamed == "int4" and bits == 4:
                quantization.replace_module(model, module_name, _int4_linear(_affine(source, weight_name, rows), bias, float_dtype))
            else:
                _assign(module, "weight", _rows(source.dense(weight_name), rows).to(float_dtype))
                if bias is not None:
                    _assign(module, "bias", bias.to(float_dtype))
        else:
            for param_name, _ in list(module.named_parameters(recurse=False)):
                tensor_name = file_name(module_name, param_name)
                if tensor_name is None:
                    raise LocalspecError(f"{_shown(source.paths[0])} has no tensor for {module_name}.{param_name}")
                _assign(module, param_name, source.dense(tensor_name).to(float_dtype))
    if "rope_freqs.weight" in source.tensors:  # llama 3's long-context frequencies, stored as divisors
        _divide_rotary_frequencies(model, source.dense("rope_freqs.weight"))
    if streamed == "w4a8":
        quantization.install_w4a8(model, blocks, blocks_file)
    elif quant in ("int8", "w8a8"):
        quantization.quantize_model(model, "int8", torch.device("cpu"))
        if quant == "w8a8":
            quantization.quantize_activations(model)
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise LocalspecError(f"{_shown(source.paths[0])} left {len(still_meta)} tensors unfilled, first {still_meta[0]}")
    model.generation_config = GenerationConfig.from_model_config(config)
    source.release()
    return model.eval().requires_grad_(False)


def _fill_embedding(model, module_name: str, module: torch.nn.Embedding, source: GGUFSource, tensor_name: str | None,
                    streamed: str, dtype: torch.dtype) -> None:
    if tensor_name is None:
        raise LocalspecError(f"{_shown(source.paths[0])} has no tensor for {module_name}")
    if streamed == "none":
        _assign(module, "weight", source.dense(tensor_name).to(dtype))
    else:
        raw = source.raw(tensor_name)
        quantization.replace_module(model, module_name, GGUFEmbedding(raw, source.qtype(tensor_name), module.embedding_dim, dtype))


def _row_order(source: GGUFSource, config, tensor_name: str, rows: int) -> torch.Tensor | None:
    """For llama-converted q/k weights, the file row each transformers row comes from (llama.cpp's
    converter interleaved the two rotary halves of every head); None elsewhere."""
    if source.arch not in _PERMUTED or not re.search(r"\.attn_[qk]\.", tensor_name):
        return None
    heads = config.num_attention_heads if ".attn_q." in tensor_name else config.num_key_value_heads
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def _rows(tensor: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return tensor if rows is None else tensor[rows]


def _assign(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    current = getattr(module, name)
    if tuple(current.shape) != tuple(value.shape):
        raise LocalspecError(f"a tensor of shape {tuple(value.shape)} where the model needs {tuple(current.shape)} "
                             f"({type(module).__name__}.{name}): the file's header and tensors disagree")
    setattr(module, name, torch.nn.Parameter(value.contiguous(), requires_grad=False))


PACK_ROWS = 2048
"""Rows decoded and packed at a time (a multiple of the kernel's tile): a large tensor's decoded
codes and the decoder's temporaries would otherwise cost several times its blocks."""


def _pack(source: GGUFSource, name: str, rows: torch.Tensor | None) -> torch.Tensor:
    """A tensor's kernel blocks, laid out PACK_ROWS outputs at a time into one buffer (the
    tile-major layout makes the blocks of consecutive row ranges consecutive), then its file pages dropped."""
    from localspec.kernels import cpu_w4a8

    raw, bits = source.raw(name), block_bits(source.qtype(name))
    n = raw.shape[0]
    k = source.tensors[name].shape[-1]
    out = torch.empty(cpu_w4a8.block_bytes(n, k, bits), dtype=torch.uint8)  # (blocks,)
    for start in range(0, n, PACK_ROWS):
        picked = torch.arange(start, min(n, start + PACK_ROWS)) if rows is None else rows[start : start + PACK_ROWS]
        affine = decode(raw[picked], source.qtype(name))
        blocks = cpu_w4a8.pack_codes(affine.codes, affine.scales, affine.mins, bits)
        offset = cpu_w4a8.block_bytes(start, k, bits)
        out[offset : offset + blocks.numel()] = blocks
    source.release(name)
    return out


def _affine(source: GGUFSource, name: str, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, scales, mins) of a tensor in transformers' row order."""
    affine = decode(source.raw(name), source.qtype(name))
    return _rows(affine.codes, rows), _rows(affine.scales, rows), _rows(affine.mins, rows)


def _int4_linear(affine: tuple[torch.Tensor, torch.Tensor, torch.Tensor], bias: torch.Tensor | None, dtype: torch.dtype) -> torch.nn.Module:
    from localspec.kernels.int4_linear import Int4Linear

    codes, scales, mins = affine
    n, k = codes.shape
    layer = Int4Linear(k, n, bias is not None, k // scales.shape[1], dtype)
    layer.packed.copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))
    layer.scales.copy_(scales.to(torch.float16).float())  # as the w4a8 blocks hold them
    layer.mins.copy_(mins.to(torch.float16).float())
    if bias is not None:
        layer.bias.data.copy_(bias.to(dtype))
    return layer


def _divide_rotary_frequencies(model: torch.nn.Module, divisors: torch.Tensor) -> None:
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and inv_freq.shape == divisors.shape:
            module.inv_freq = inv_freq / divisors.to(inv_freq.dtype)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq = module.inv_freq
