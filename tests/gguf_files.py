"""Small GGUF files written in-process with the gguf package's writer: a transformers model's
tensors under llama.cpp's names (q/k rows interleaved for llama as llama.cpp's converter does),
each in the type asked for. K-quant types have no Python quantizer, so those tensors are random
valid blocks instead of the model's weights (their scales kept to sane fp16 values)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, MODEL_ARCH_NAMES, get_tensor_name_map
from gguf.quants import quantize

K_QUANTS = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}
"""Block bytes, and the byte offsets of each block's fp16 scales, of the K types written as random blocks."""


def random_blocks(qtype: Q, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """(rows, blocks * block bytes) uint8: random codes and scales, each fp16 scale a small normal value."""
    size, scales = K_QUANTS[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for offset in scales:
        data[..., offset : offset + 2] = (rng.standard_normal((rows, blocks, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def write_gguf(model, path: Path, types: dict[str, Q] | None = None, default: Q = Q.F32, tied: bool = False,
               arch: str | None = None) -> Path:
    """Write `model` (a transformers Llama/Qwen2 causal LM) as a GGUF. `types`: a substring of the
    GGUF tensor name -> its type (first match), else `default` for matrices; norms and biases F32.
    `tied`: leave out output.weight (the embedding serves as the output layer)."""
    config = model.config
    arch = arch or config.model_type
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_file_type(1)
    arch_id = {name: key for key, name in MODEL_ARCH_NAMES.items()}[arch]
    names = get_tensor_name_map(arch_id, config.num_hidden_layers)
    for seed, (name, tensor) in enumerate(model.state_dict().items()):
        module, _, suffix = name.rpartition(".")
        base = names.get_name(module)
        assert base is not None, name
        gguf_name = f"{base}.{suffix}"
        if tied and gguf_name == "output.weight":
            continue
        values = tensor.detach().float().numpy()
        if arch == "llama" and gguf_name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
            values = values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)
        qtype = next((t for key, t in (types or {}).items() if key in gguf_name), default) if values.ndim == 2 else Q.F32
        if qtype in K_QUANTS:
            writer.add_tensor(gguf_name, random_blocks(qtype, values.shape[0], values.shape[1] // 256, seed), raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(gguf_name, values.astype(np.float16 if qtype == Q.F16 else np.float32))
        else:
            writer.add_tensor(gguf_name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf_model(arch: str = "llama", hidden: int = 256, layers: int = 2, seed: int = 0):
    """A tiny random model whose widths fit every block type (multiples of 256)."""
    from conftest import tiny_model

    model = tiny_model(arch, seed=seed, vocab=96, layers=layers, hidden=hidden)
    with torch.no_grad():  # a visible bias, so its rows are checked too
        for layer in model.model.layers:
            if layer.self_attn.q_proj.bias is not None:
                layer.self_attn.q_proj.bias.normal_()
    return model
