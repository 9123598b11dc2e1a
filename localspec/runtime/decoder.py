"""The target's decode and verify passes written out as one plain function (gpt-fast style).

transformers' forward of a Llama-family model does per layer what one pass needs once or not at
all: keyword plumbing through four levels of modules, output records, mask construction, the
attention interface lookup. On the 2-core VM with the bandwidth-bound w4a8 kernel, leaving that
out took a one-token pass of the 1.5B model from 78 to 71 ms (about 1 ms of a 16-token pass); the
small torch ops that remain (norms, rotary, SiLU) are ~5 ms of a one-token pass.

`lean_forward` computes the same layers with the same modules (so quantized linears, the
embedding's float32 hook and the norms' hooks, which EAGLE's feature taps use, all run as before)
and the same row-exact attention, for the passes generation makes many of: batch 1, at most
`ROW_BY_ROW_UP_TO` new tokens, a model whose layers pass `unsupported_reason`. Which pass runs
when is decided in one place, `target_pass.TargetPass`; transformers' own forward takes the rest
(a long prefill, another architecture) and is the reference the tests compare against.

On CUDA (with Triton) a pass reads where its rows stand from a `RowTable` on the device, built once
per pass: the new keys and values go to the cache at the table's slots and one Triton launch per
layer computes every row's attention, so the pass has fixed shapes and addresses and
localspec/runtime/graphs.py can capture it as a CUDA graph (giving it a table of its own, copied into).
"""

from __future__ import annotations

import functools
import sys

import torch

from localspec.base.config import home_dir
from localspec.kernels.cpu_rows import RowsKernel, cpu_rows, fast_norms, takes_rotary
from localspec.runtime.attention import RowPlan, RowTable, exact_attention, rows_on_device, table_attention
from localspec.runtime.kv import extend_to

PLAIN_ROTARY = ("transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
                "transformers.models.mistral.modeling_mistral")
"""Modules whose apply_rotary_pos_emb is the plain half-rotation `cpu_rows.rotary_` computes."""


@functools.cache
def _rows() -> RowsKernel | None:
    return cpu_rows(home_dir() / "kernels")


def use_cpu_rows(model: torch.nn.Module) -> None:
    """A CPU model's norms computed by the row kernel (kernels/cpu_rows.py); nothing where it
    cannot be built. For a loaded model, before its first pass: its numbers are then the same on
    every path and in every pass (a reference computed before the swap would differ in rounding)."""
    if next(model.parameters()).device.type == "cpu" and (kernel := _rows()) is not None:
        fast_norms(model, kernel)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `lean_forward` cannot run this model (None: it can). A structural check: the layers
    must be the plain pre-norm Llama block (q/k/v/o projections, RoPE, full attention; the MLP is
    called as the module it is)."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(model, "lm_head") or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return f"{type(model).__name__} is not a decoder with model.layers, rotary_emb and lm_head"
    config = model.config
    layer_types = getattr(config, "layer_types", None)
    if any(kind != "full_attention" for kind in layer_types or ()) or (
            layer_types is None and getattr(config, "sliding_window", None) is not None):
        return "layers with sliding-window attention"
    for layer in base.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [attention, mlp, getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        if any(part is None for part in parts):
            return f"{type(layer).__name__} is not a pre-norm attention + MLP block"
        if not all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
            return f"{type(attention).__name__} has no plain q/k/v/o projections"
        if not hasattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb"):
            return f"{type(attention).__name__}'s module has no apply_rotary_pos_emb"
        if hasattr(attention, "q_norm") or hasattr(attention, "k_norm"):
            return f"{type(attention).__name__} normalises queries and keys"
    return None


def lean_forward(model: torch.nn.Module, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, logits_to_keep: int = 0, row_plan: RowPlan | None = None,
                 table: RowTable | None = None) -> torch.Tensor:
    """input_ids (1, T) new tokens after the cache's entries -> logits (1, keep or T, V).

    position_ids (1, T) default to the positions after the cache; attention_mask (1, 1, T, S) bool
    or additive, only for tree passes, read once here (a `row_plan` from the engine saves even that).
    `table`: the rows' places on the device, given by a caller that moves the cache's lengths
    itself (a CUDA graph); on CUDA one is built here otherwise."""
    base = model.model
    t = input_ids.shape[1]
    past = cache.get_seq_length()
    if position_ids is None:
        position_ids = torch.arange(past, past + t, device=input_ids.device)[None]  # (1, T)
    if row_plan is None and attention_mask is not None:
        row_plan = RowPlan.from_mask(attention_mask[0, 0])
    built = table is None and rows_on_device(input_ids.device)
    if built:
        table = RowTable.build(past, t, row_plan, input_ids.device)
    hidden = base.embed_tokens(input_ids)  # (1, T, Hd)
    cos, sin = base.rotary_emb(hidden, position_ids)  # (1, T, D) each
    for index, layer in enumerate(base.layers):
        hidden = hidden + _attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, cache, index, row_plan,
                                     table, past + t)
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))  # (1, T, Hd)
    if built:
        extend_to(cache, past + t)
    hidden = base.norm(hidden)  # (1, T, Hd)
    kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden  # (1, keep, Hd)
    return model.lm_head(kept)  # (1, keep, V)


def _attention(attention, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, index: int,
               row_plan: RowPlan | None, table: RowTable | None, end: int) -> torch.Tensor:
    """One layer's attention block: normed (1, T, Hd) -> (1, T, Hd), the new keys/values written to
    the cache (at the table's slots, below `end`, when there is a table)."""
    t, d = normed.shape[1], attention.head_dim
    query = attention.q_proj(normed).view(1, t, -1, d).transpose(1, 2)  # (1, H, T, D)
    key = attention.k_proj(normed).view(1, t, -1, d).transpose(1, 2)  # (1, Hkv, T, D)
    value = attention.v_proj(normed).view(1, t, -1, d).transpose(1, 2)  # (1, Hkv, T, D)
    module = type(attention).__module__
    rows = _rows() if module in PLAIN_ROTARY and not torch.is_grad_enabled() else None
    if rows is not None and takes_rotary(query, cos) and takes_rotary(key, cos):
        rows.rotary_(query, cos, sin)  # in place, the bits of the model's own function
        rows.rotary_(key, cos, sin)
    else:  # the model's own rotary function, the one its transformers forward applies
        query, key = sys.modules[module].apply_rotary_pos_emb(query, key, cos, sin)
    if table is not None:
        keys, values = cache.update(key, value, index, slots=table.slots, end=end)  # (1, Hkv, capacity, D) buffers
        out = table_attention(query, keys, values, table, attention.scaling)
    else:
        keys, values = cache.update(key, value, index)  # (1, Hkv, S, D) views of the cache
        out, _ = exact_attention(attention, query, keys, values, None, scaling=attention.scaling, row_plan=row_plan)
    return attention.o_proj(out.reshape(1, t, -1))  # out (1, T, H, D) -> (1, T, Hd)
