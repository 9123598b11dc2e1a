"""Measured costs of a target pass per width and of a draft step, and the draft length they imply.

On a CPU a verify pass of several tokens is not free (fp32) or nearly free (bf16 with AMX); on a
GPU it is nearly free up to tens of tokens. So nothing here is a constant: a short calibration
times real forward passes on this machine (cached per model, dtype, device and thread count), and
each pass picks the draft length with the best expected tokens per second for the acceptance seen
so far.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from localspec.config import home_dir
from localspec.kv import KVCache
from localspec_kernels.cpu_w8a8 import wait_for_packing

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
CALIBRATION_PREFIX = 128


@dataclass
class CostModel:
    verify_seconds: dict[int, float]
    """Seconds of one target pass over `width` new tokens, at the calibrated widths."""
    draft_step_seconds: float = 0.0
    """Seconds of one draft-model step (0 for lookups, whose cost is negligible)."""

    def verify(self, width: int) -> float:
        """Cost of a pass of any width, linear between calibrated widths and beyond the last."""
        points = sorted(self.verify_seconds.items())
        if width <= points[0][0]:
            return points[0][1]
        for (w0, t0), (w1, t1) in zip(points, points[1:]):
            if width <= w1:
                return t0 + (t1 - t0) * (width - w0) / (w1 - w0)
        (w0, t0), (w1, t1) = points[-2], points[-1]
        return t1 + max(t1 - t0, 0.0) * (width - w1) / (w1 - w0)

    def expected_rate(self, acceptance: float, draft_len: int, free: bool = False) -> float:
        """Expected tokens per second with this draft length (i.i.d. acceptance per position);
        `free`: the guesses cost no draft steps (a lookup riding along a model proposer)."""
        a = min(max(acceptance, 0.0), 0.999)
        tokens = (1.0 - a ** (draft_len + 1)) / (1.0 - a)
        steps = 0.0 if free else draft_len * self.draft_step_seconds
        return tokens / (steps + self.verify(draft_len + 1))

    def best_draft_len(self, acceptance: float, max_len: int, free: bool = False) -> int:
        return max(range(max_len + 1), key=lambda g: self.expected_rate(acceptance, g, free))


class AcceptanceTracker:
    """Per-token acceptance probability, an exponentially decayed estimate over recent passes.

    A pass that accepted k of g drafted tokens saw k successes and, when k < g, one failure.
    A pass without a draft says nothing new, so the estimate drifts back towards the prior: after a
    bad stretch that made drafting look useless, the policy tries again a little later instead of
    never drafting again.
    """

    def __init__(self, prior: float = 0.6, weight: float = 3.0, decay: float = 0.9) -> None:
        self.prior = prior
        self.weight = weight
        self.successes = prior * weight
        self.trials = weight
        self.decay = decay

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self.successes = self.decay * self.successes + (1 - self.decay) * self.prior * self.weight
            self.trials = self.decay * self.trials + (1 - self.decay) * self.weight
            return
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + (1 if accepted < drafted else 0)

    @property
    def rate(self) -> float:
        return self.successes / self.trials


@torch.inference_mode()
def time_forward(model: torch.nn.Module, widths: tuple[int, ...], repeats: int = 4) -> dict[int, float]:
    """Best-of-`repeats` seconds of one forward over `width` new tokens after a fixed prefix.

    Widths are measured in interleaved rounds, so a burst of other work on the machine spoils one
    sample of each width rather than every sample of one.
    """
    wait_for_packing(model)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, CALIBRATION_PREFIX), generator=gen).to(device)
    kv = KVCache()
    model(input_ids=prefix, cache=kv.cache, use_cache=True, logits_to_keep=1)
    best = {width: float("inf") for width in widths}
    for round_ in range(repeats + 1):  # round 0 is a warm-up
        for width in widths:
            ids = torch.randint(0, vocab, (1, width), generator=gen).to(device)
            pos = torch.arange(CALIBRATION_PREFIX, CALIBRATION_PREFIX + width, device=device)[None]
            _sync(device)
            start = time.perf_counter()
            model(input_ids=ids, position_ids=pos, cache=kv.cache, use_cache=True)
            _sync(device)
            if round_:
                best[width] = min(best[width], time.perf_counter() - start)
            kv.truncate(CALIBRATION_PREFIX)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def calibration_key(name: str, model: torch.nn.Module) -> str:
    """What decides a pass's cost: model, dtype, device, threads, torch, and any fast-path layers
    (prepacked or int8 weights) swapped into it."""
    param = next(model.parameters())
    fast_paths = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("localspec_kernels")})
    variant = f"|{'+'.join(fast_paths)}" if fast_paths else ""
    return f"{name}{variant}|{param.dtype}|{param.device.type}|threads={torch.get_num_threads()}|torch={torch.__version__}"


def _calibration_file():
    return home_dir() / "calibration.json"


def load_calibrations() -> dict:
    try:
        return json.loads(_calibration_file().read_text())
    except (OSError, ValueError):
        return {}


def save_calibration(key: str, value: dict) -> None:
    """Atomic write, so a crash never leaves a half-written file that would be thrown away."""
    from localspec.files import locked, write_text_atomic

    path = _calibration_file()
    try:
        with locked(path):  # another process's measurement, saved meanwhile, is kept
            data = load_calibrations()
            data = data if isinstance(data, dict) else {}  # a damaged file is replaced, not added to
            data[key] = value
            write_text_atomic(path, json.dumps(data, indent=1))
    except OSError:
        pass  # a calibration that cannot be saved is measured again next time


def measured_costs(name: str, model: torch.nn.Module, widths: tuple[int, ...] = WIDTHS) -> dict[int, float]:
    """Calibrated pass costs of a model (cached on disk after the first measurement)."""
    key = calibration_key(name, model)
    cached = load_calibrations().get(key)
    if cached and all(str(w) in cached for w in widths):
        return {w: cached[str(w)] for w in widths}
    costs = time_forward(model, widths)
    save_calibration(key, {str(w): s for w, s in costs.items()})
    return costs


class SpeedGuard:
    """The kill switch: when speculative passes measure slower than plain decoding would be (the
    calibrated one-token pass), speculation pauses for a while, then is tried again.

    The cost model already drafts less as acceptance falls; this catches what it cannot see, such
    as a draft model slowed by other work on the machine.
    """

    def __init__(self, plain_seconds: float, window: int = 16, pause: int = 16, margin: float = 0.85) -> None:
        # a pass also pays for the loop around the forward, which the calibration leaves out: only
        # a clear loss (below `margin` of plain decoding's rate) switches speculation off
        self.plain_rate = margin / plain_seconds
        self.window = window
        self.pause = pause
        self.recent: list[tuple[int, float]] = []  # (tokens committed, seconds) of speculative passes
        self.paused_for = 0

    @property
    def allows(self) -> bool:
        return self.paused_for == 0

    def record(self, drafted: int, tokens: int, seconds: float) -> str:
        """Account one pass; returns a notice when speculation is switched off, else ''."""
        if self.paused_for:
            self.paused_for -= 1
            return ""
        if drafted == 0:
            return ""
        self.recent = [*self.recent, (tokens, seconds)][-self.window :]
        if len(self.recent) < self.window:
            return ""
        rate = sum(t for t, _ in self.recent) / sum(s for _, s in self.recent)
        if rate >= self.plain_rate:
            return ""
        self.recent = []
        self.paused_for = self.pause
        return (
            f"speculation paused: {rate:.1f} tok/s over the last {self.window} passes, clearly below plain "
            f"decoding; trying again in {self.pause} passes"
        )
