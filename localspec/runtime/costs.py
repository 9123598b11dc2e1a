"""Measured costs of a target pass per width and of a draft step, and the draft length they imply.

On a CPU a verify pass of several tokens is not free (fp32) or nearly free (bf16 with AMX); on a
GPU it is nearly free up to tens of tokens. So nothing here is a constant: a short calibration
times real passes on this machine (`time_forward`, through the `TargetPass` generation uses;
store/measurements.py keeps what it measured), and the draft policy (core/policy.py) sizes each
pass's draft on these numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from localspec.kernels.cpu_w8a8 import wait_for_packing
from localspec.runtime.target_pass import PREFILL_CHUNK, TargetPass

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
CONTEXTS = (128, 1024)
"""Cached tokens the pass costs are measured after: the row-exact attention's cost grows with the
context, so the cost model interpolates (and extrapolates) between these."""
CALIBRATION_PREFIX = CONTEXTS[0]


def _interpolate(points: dict[int, float], x: float) -> float:
    """Linear between measured points, flat below the first, the last slope (never negative) beyond."""
    pts = sorted(points.items())
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + max(y1 - y0, 0.0) * (x - x1) / (x1 - x0)


@dataclass
class CostModel:
    verify_seconds: dict[int, float]
    """Seconds of one target pass over `width` new tokens, at the calibrated widths (after the
    shortest calibrated context)."""
    draft_step_seconds: float = 0.0
    """Seconds of one draft-model step (0 for lookups, whose cost is negligible)."""
    by_context: dict[int, dict[int, float]] = field(default_factory=dict)
    """The same curve at each calibrated context length (cached tokens), when measured at several."""
    context: int = 0
    """The context the engine's next pass runs at (it moves this as the conversation grows)."""

    def verify(self, width: int) -> float:
        """Cost of a pass of any width at `context`: linear between calibrated widths and beyond the
        last, then between calibrated context lengths."""
        if len(self.by_context) < 2:
            return _interpolate(self.verify_seconds, width)
        return _interpolate({c: _interpolate(curve, width) for c, curve in self.by_context.items()}, self.context)


QUIET_SPREAD, QUIET_SLACK = 0.3, 1e-3
"""Repeated passes agree when each width's median sample is within this fraction of its best (or
this many seconds, for passes so short that timer jitter is the spread): beyond it the machine was
busy with something else, and the costs say more about that than about the pass
(measurements.measured_curves then keeps them for the run only). 0.3: on a quiet 2-core VM the
1.5B's passes wander 2-21% (median over best, nothing else running), and the best of four is what
the costs take; a busy loop beside them is told by the other processes' load, not by the spread."""


def time_forward(model: torch.nn.Module, widths: tuple[int, ...], repeats: int = 4, context: int = CALIBRATION_PREFIX,
                 target: TargetPass | None = None) -> dict[int, float]:
    """Best-of-`repeats` seconds of one pass over `width` new tokens after `context` cached ones."""
    return {width: min(samples) for width, samples in time_passes(model, widths, repeats, context, target).items()}


def agree(samples: dict[int, list[float]]) -> bool:
    """Whether repeated passes of each width took about the same time (see QUIET_SPREAD)."""
    return all(sorted(s)[len(s) // 2] - min(s) <= max(QUIET_SPREAD * min(s), QUIET_SLACK) for s in samples.values())


@torch.inference_mode()
def time_passes(model: torch.nn.Module, widths: tuple[int, ...], repeats: int = 4, context: int = CALIBRATION_PREFIX,
                target: TargetPass | None = None) -> dict[int, list[float]]:
    """`repeats` timings (seconds) of one pass over `width` new tokens after `context` cached ones,
    through `target`, by default the `TargetPass` generation makes for `model` (attention, weights,
    CUDA graphs where they replay): the pass generation runs.

    Widths are measured in interleaved rounds, so a burst of other work on the machine spoils one
    sample of each width rather than every sample of one.
    """
    wait_for_packing(model)
    target = TargetPass(model) if target is None else target
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=gen)  # (1, context)
    kv = target.new_cache(context + max(widths))
    for start in range(0, context, PREFILL_CHUNK):  # as a prompt is prefilled: the memory of a long one, no more
        end = min(context, start + PREFILL_CHUNK)
        target(kv, prefix[:, start:end], torch.arange(start, end)[None], logit_rows=1)
    samples: dict[int, list[float]] = {width: [] for width in widths}
    for round_ in range(repeats + 1):  # round 0 is a warm-up
        for width in widths:
            ids = torch.randint(0, vocab, (1, width), generator=gen).to(target.device)  # (1, W)
            positions = torch.arange(context, context + width, device=target.device)[None]  # (1, W)
            _sync(target.device)
            start = time.perf_counter()
            target(kv, ids, positions, logit_rows=width)
            _sync(target.device)
            if round_:
                samples[width].append(time.perf_counter() - start)
            kv.truncate(context)
    return samples


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def cost_model(curves: dict[int, dict[int, float]], draft_step_seconds: float = 0.0) -> CostModel:
    return CostModel(curves[min(curves)], draft_step_seconds, dict(curves))
