"""CUDA graphs of the target's decode and verify passes: one launch replays a whole pass.

At batch 1 a GPU spends most of a pass waiting for Python to launch its ~15 kernels per layer
(gpt-fast's lesson). A CUDA graph records those launches once and replays them with one call, but
only for fixed shapes and fixed addresses. `decoder.lean_forward` gives exactly that when it is
handed a `RowTable`: its tensors have the pass's width as their only size, the keys and values go
to the cache at slots read from the table, and the attention reads each row's visible keys from it
too (kernels/triton_row_attention.py). So a `GraphRunner` keeps, per width (1 to `MAX_WIDTH`), a
static copy of a pass's inputs (ids, positions, table), captures `lean_forward` on them the first
time that width runs, and afterwards copies each pass's inputs in and replays.

Exactness: a replay runs the kernels the eager pass runs, on the same values, so its logits are the
eager pass's bit for bit (tests/test_cuda.py); the eager `lean_forward` stays the reference and the
path for everything the runner does not cover (other devices, wider passes, prefill chunks, a pass
that would not fit the cache); `target_pass.TargetPass` decides, in one place, which passes try a
runner first. The cache must keep its buffers: `TargetPass.new_cache` makes it with
`capacity(context)` slots up front; if a longer conversation grows it anyway, the graphs are
dropped and captured again against the new buffers. A capture that fails turns the runner off,
with a one-line reason for the engine's notices. The capture step is a parameter, so that the CPU
tests run the same bookkeeping with `no_capture` (replaying = calling the same function on the
static inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from localspec.kernels.triton_support import triton_available
from localspec.runtime.attention import RowPlan, RowTable
from localspec.runtime.decoder import lean_forward, unsupported_reason
from localspec.runtime.kv import KVCache, extend_to

MAX_WIDTH = 16
"""Widest pass captured: one-token steps and the usual verify passes. Wider trees are rarer, cost
more in arithmetic than in launches, and each width keeps a (width x vocabulary) output alive."""

CONTEXT = 4096
"""Slots a graph-backed cache is made with (fewer if the model's context is shorter): 117 MB of
keys and values for the 1.5B target in bf16, 537 MB for an 8B."""

Replay = Callable[[], torch.Tensor]
Capture = Callable[[Replay, object], Replay]
"""Records a pass (with a memory pool to share) and returns its replay: `cuda_capture`, `no_capture`."""


def capacity(context: int) -> int:
    """Slots per layer for a cache whose passes are replayed from graphs."""
    return min(context, CONTEXT)


def cuda_capture(step: Replay, pool) -> Replay:
    """Run `step` twice on a side stream (Triton compiles, cuBLAS picks its kernels: nothing lazy
    may happen during a capture), record it, and return the replay, which writes the same output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the server and the chat generate on a worker thread while others go on
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def no_capture(step: Replay, pool) -> Replay:
    """The CPU tests' stand-in: replaying is calling the step on the static inputs."""
    return step


@dataclass
class _Pass:
    """One width's static inputs and its replay."""

    ids: torch.Tensor  # (1, W)
    positions: torch.Tensor  # (1, W)
    table: RowTable  # W rows, seen padded to W
    replay: Replay | None = None  # -> logits (1, W, V)


class GraphRunner:
    def __init__(self, model: torch.nn.Module, capture: Capture = cuda_capture) -> None:
        self.model = model
        self.capture = capture
        self.passes: dict[int, _Pass] = {}
        self.buffers: list[torch.Tensor] = []
        """The cache buffers the captured passes write and read."""
        self.pool = torch.cuda.graph_pool_handle() if capture is cuda_capture else None  # one memory pool for all widths
        self.off: str | None = unavailable_reason(model)
        """Why the runner no longer replays (None while it does)."""

    def run(self, kv: KVCache, ids: torch.Tensor, positions: torch.Tensor, plan: RowPlan | None, logit_rows: int) -> torch.Tensor | None:
        """Logits (W, V) of the pass over ids (1, W) at positions (1, W) after the cache's entries
        (a tree's `plan` says which rows each row sees), with the cache's lengths moved as the
        eager pass moves them; None for a pass to run eagerly: not covered, or the runner just
        turned off (`off` says why)."""
        w, past = ids.shape[1], len(kv)
        buffers = _buffers(kv)
        if (self.off or logit_rows != w or w > MAX_WIDTH or not buffers or past + w > buffers[0].shape[-2]
                or (plan is not None and plan.past != past)):
            return None
        if len(buffers) != len(self.buffers) or any(a is not b for a, b in zip(buffers, self.buffers)):
            self.passes.clear()  # first use, or a long conversation grew the cache: capture again
            self.buffers = buffers
        step = self.passes.get(w) or self._static(w)
        step.ids.copy_(ids, non_blocking=True)
        step.positions.copy_(positions, non_blocking=True)
        step.table.packed.copy_(RowTable.pack(past, w, plan, width=w), non_blocking=True)
        if step.replay is None:
            try:
                step.replay = self.capture(lambda: lean_forward(self.model, step.ids, kv.cache, position_ids=step.positions,
                                                                table=step.table), self.pool)
            except Exception as exc:  # anything the capture cannot record: eager passes from here
                self.off = f"CUDA graphs off, eager passes from here: capturing a {w}-token pass failed ({exc!r})"[:300]
                self.passes.clear()
                return None
            self.passes[w] = step
        logits = step.replay()  # (1, W, V)
        extend_to(kv.cache, past + w)
        return logits[0].clone()  # the static output is overwritten by this width's next replay

    def _static(self, w: int) -> _Pass:
        device = self.buffers[0].device
        with torch.inference_mode(False):  # as the cache's buffers: writable inside and outside inference mode
            ids = torch.zeros(1, w, dtype=torch.long, device=device)
            table = torch.zeros(RowTable.pack(0, w, None).shape, dtype=torch.long, device=device)
            return _Pass(ids, ids.clone(), RowTable(table, w))


def _buffers(kv: KVCache) -> list[torch.Tensor]:
    """The cache's key and value buffers, layer by layer ([] before every layer holds one)."""
    layers = kv.cache.layers
    if not layers or not all(layer.is_initialized for layer in layers):
        return []
    return [buffer for layer in layers for buffer in (layer.key_slots.buffer, layer.value_slots.buffer)]


def unavailable_reason(model: torch.nn.Module) -> str | None:
    """Why this model's passes cannot be replayed from graphs (None: they can)."""
    if (why := unsupported_reason(model)) is not None:
        return f"CUDA graphs off: the lean pass cannot run this model ({why})"
    if not triton_available():
        return "CUDA graphs off: they need the Triton row attention (pip install triton)"
    embedding = model.model.embed_tokens
    for name, module in model.named_modules():
        # a hook is Python that a replay skips; the embedding's float32 cast (quant.py) is a tensor
        # op and is recorded like any other, but EAGLE's feature taps must see every pass
        if (module._forward_hooks or module._forward_pre_hooks) and module is not embedding:
            return f"CUDA graphs off: {name} has Python hooks (EAGLE's feature taps), which a replay would skip"
    return None
