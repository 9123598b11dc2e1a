"""One pass of a model over new tokens after its cache, and the one place that decides how it runs.

Generation makes many short passes (decode steps, verify passes, a draft model's steps) and a few
long ones (a prompt's chunks). A `TargetPass` is built once per model user: the engine for the
target, `DraftModelProposer` for its draft, `costs.time_forward` for the calibration, so the pass
that is timed is the pass that runs. It tries, in this order:

1. a CUDA graph replay (`graphs.GraphRunner`): on a CUDA device, widths 1 to `graphs.MAX_WIDTH`
   that keep every row's logits, a cache that keeps its buffers, a model without Python hooks
   (EAGLE's feature taps turn it off, with a one-line notice);
2. the lean pass (`decoder.lean_forward`): passes of at most `ROW_BY_ROW_UP_TO` new tokens of a
   model whose layers it supports;
3. transformers' forward: long prompt chunks (its attention hands them to SDPA), other
   architectures. It is the reference the other two are tested against, bit for bit.

All three run the row-exact attention (localspec/runtime/attention.py), installed on the model
when its pass is built: each row of a verify pass is computed as the one-token step would be, so
speculation stays token-identical to plain decoding. The norms run as modules on every path, so
hooks on them (EAGLE's taps) see every pass. `name` says which of the three this pass takes, for
the calibration key (store/measurements.py): a change of path is measured again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from localspec.runtime.attention import ROW_BY_ROW_UP_TO, RowPlan, use_exact_attention
from localspec.runtime.decoder import lean_forward, unsupported_reason
from localspec.runtime.graphs import Capture, GraphRunner, capacity, cuda_capture
from localspec.runtime.kv import KVCache


def graph_capture(device: torch.device) -> Capture | None:
    """How passes on this device are recorded for replay: CUDA graphs on CUDA, none elsewhere
    (the CPU tests put `graphs.no_capture` here to run the replay bookkeeping)."""
    return cuda_capture if device.type == "cuda" else None


PREFILL_CHUNK = 512
"""Prompt tokens per prefill pass: bounds the attention scratch memory of long prompts."""


class TargetPass:
    def __init__(self, model: torch.nn.Module, notify: Callable[[str], None] = lambda notice: None) -> None:
        """`notify` hears once, in one line, why graph replays stopped (a capture failed, hooks)."""
        use_exact_attention(model)
        self.model = model
        self.device = next(model.parameters()).device
        self.lean = unsupported_reason(model) is None
        capture = graph_capture(self.device)
        self.graphs = GraphRunner(model, capture) if capture is not None else None
        """None once replays are off (`notify` was told why) or where there are none."""
        self.notify = notify

    @property
    def name(self) -> str:
        """What runs the passes: the attention, then `+lean` and `+graphs` where those paths run."""
        name = self.model.config._attn_implementation
        if self.lean:
            name += "+lean"
        if self.graphs is not None and self.graphs.off is None:
            name += "+graphs"
        return name

    def new_cache(self, context: int) -> KVCache:
        """A cache for a conversation of up to `context` tokens: where passes may replay, its slots
        are made up front (a graph reads and writes fixed buffers); elsewhere it grows as needed."""
        return KVCache(capacity(context) if self.graphs is not None else 0)

    def __call__(self, kv: KVCache, ids: torch.Tensor, positions: torch.Tensor, logit_rows: int,
                 mask: torch.Tensor | None = None, plan: RowPlan | None = None) -> torch.Tensor:
        """ids (1, T) after the cache's entries, at positions (1, T) -> logits (logit_rows, V) of the
        last `logit_rows` rows; the T new entries are written to `kv`. A tree pass gives its mask (1, 1, T,
        past + T) and the same rows as a `plan` made on the host, so no path reads the mask back."""
        if self.graphs is not None:
            logits = self.graphs.run(kv, ids, positions, plan, logit_rows)  # (W, V), or None: a pass for the paths below
            if self.graphs.off:
                self.notify(self.graphs.off)
                self.graphs = None
            if logits is not None:
                return logits
        ids, positions = ids.to(self.device), positions.to(self.device)  # (1, T) each
        mask = None if mask is None else mask.to(self.device)
        if self.lean and ids.shape[1] <= ROW_BY_ROW_UP_TO:
            return lean_forward(self.model, ids, kv.cache, positions, mask, logit_rows, plan)[0]  # (logit_rows, V)
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=kv.cache, use_cache=True,
                         logits_to_keep=logit_rows, row_plan=plan)
        return out.logits[0]  # (logit_rows, V)
