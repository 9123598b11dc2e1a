"""From a model name and options to a ready Engine: load, choose proposer and dtype, calibrate.

The CLI, the benchmark and the UI all start here; the engine itself knows nothing of registries,
files or dtype choices.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import psutil
import torch

from localspec.runtime import quant as quantization
from localspec.store import proposer_catalog
from localspec.core import policy
from localspec.base.config import SpecConfig
from localspec.runtime.costs import CostModel, WIDTHS, cost_model
from localspec.runtime.decoder import use_exact_pass
from localspec.core.engine import Engine
from localspec.base.errors import LocalspecError, first_line, is_out_of_memory
from localspec.store.loading import (
    LoadedModel, discard_unused, hub_snapshot, load_model, pick_device, release_memory,
)
from localspec.store.machine import check_tokenizers, situation
from localspec.store.measurements import (
    draft_format_key, dtype_key, load_calibration, measured_costs, measured_curves, save_calibration,
)
from localspec.store.proposer_catalog import choose_proposer, registered_draft
from localspec.store.registry import ModelEntry, Registry, load_registry
from localspec.kernels.cpu_linear import (
    PackedLinear, linear_bytes, pack_linears, packing_supported, set_wide_from, unpack_linears,
)
from localspec.kernels.cpu_w8a8 import w8a8_supported, wait_for_packing

PACKING_MEMORY_MARGIN = 1 << 30
"""Free memory to leave beside the packed weight copies."""
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ASSUMED_ACCEPTANCE = 0.7
"""Acceptance used to compare dtypes before any generation has been seen."""


@dataclass
class Session:
    """Everything loaded for one target/proposer pair."""

    entry: ModelEntry
    target: LoadedModel
    draft: LoadedModel | None
    engine: Engine
    proposer: str
    reason: str
    dtype_reason: str


def notice(message: str, quiet: bool = False) -> None:
    if not quiet:
        print(f"localspec: {message}", file=sys.stderr, flush=True)


def fast_verify_path(target: LoadedModel, widths=WIDTHS) -> dict[int, dict[int, float]]:
    """Measure the target's pass cost per context length and width, with prepacked weights for
    wide passes when that measures faster and memory allows; returns the cost curves of the path
    now in place."""
    if target.verify_costs is None:
        target.verify_costs = _choose_verify_path(target, widths)
    return target.verify_costs


def _choose_verify_path(target: LoadedModel, widths) -> dict[int, dict[int, float]]:
    plain = measured_curves(target.name, target.model, widths)
    if target.device.type != "cpu" or not packing_supported():
        return plain
    if psutil.virtual_memory().available < linear_bytes(target.model) + PACKING_MEMORY_MARGIN:
        return plain
    pack_linears(target.model, wide_from=2)
    packed = measured_curves(target.name, target.model, widths)
    # the packed path from the narrowest width from which it wins at every wider width and context
    wide_from = next((w for w in widths if w >= 2 and all(packed[c][v] < plain[c][v] for c in plain for v in widths if v >= w)), None)
    if wide_from is None:
        unpack_linears(target.model)
        return plain
    set_wide_from(target.model, wide_from)
    return {c: {w: plain[c][w] if w < wide_from else packed[c][w] for w in widths} for c in plain}


def costs_for(target: LoadedModel, draft: LoadedModel | None, widths=WIDTHS) -> CostModel:
    """The costs of the passes generation runs: the target with the attention the engine gives it."""
    use_exact_pass(target.model)
    verify = fast_verify_path(target, widths)
    if draft is not None:
        use_exact_pass(draft.model)  # as `DraftModelProposer` runs it
    step = measured_costs(draft.name, draft.model, (1,))[1] if draft is not None else 0.0
    return cost_model(verify, step)


def _best_rate(costs: CostModel, proposer: str, max_len: int) -> float:
    return policy.best_rate(costs, ASSUMED_ACCEPTANCE, 0 if proposer == "none" else max_len)


def draft_pays(costs: CostModel, max_len: int) -> bool:
    """Whether a draft model, at its measured step cost, beats plain decoding at the assumed
    acceptance: a target made fast (the w4a8 kernel) can leave a draft too dear to be worth it."""
    return policy.draft_model_pays(costs, ASSUMED_ACCEPTANCE, max_len)


def choose_dtype(
    entry: ModelEntry, draft_entry: ModelEntry | None, proposer: str, spec: SpecConfig, device: torch.device, quiet: bool
) -> tuple[torch.dtype, str]:
    """The compute dtype: bf16/fp16 on accelerators; on a CPU whichever the measurement favours."""
    if device.type == "cuda":
        # a card that only emulates bf16 (before Ampere) runs it far slower than fp16
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        return dtype, f"{dtype} on CUDA"
    if device.type == "mps":
        return torch.float16, "float16 on MPS"
    key = dtype_key(entry.name, draft_entry.name if draft_entry else None, proposer)
    cached = load_calibration(key)
    if cached.get("dtype") in DTYPE_NAMES:
        return DTYPE_NAMES[cached["dtype"]], str(cached.get("reason", ""))
    notice(f"measuring float32 vs bfloat16 for {entry.name} on this CPU (once)", quiet)
    rates = {}
    for name in ("float32", "bfloat16"):
        target = load_model(entry, DTYPE_NAMES[name], device=device, progress=not quiet)
        draft = load_model(draft_entry, DTYPE_NAMES[name], device=device, progress=not quiet) if draft_entry else None
        rates[name] = _best_rate(costs_for(target, draft), proposer, spec.max_draft_len)
        del target, draft
    best = max(rates, key=rates.get)
    reason = "measured " + ", ".join(f"{n} {r:.2f} tok/s" for n, r in rates.items()) + f" -> {best}"
    save_calibration(key, {"dtype": best, "reason": reason})
    return DTYPE_NAMES[best], reason


def make_engine(target: LoadedModel, draft: LoadedModel | None, proposer: str, spec: SpecConfig, reason: str) -> Engine:
    """An engine over already-loaded weights (the benchmark builds several over the same ones)."""
    costs = costs_for(target, draft if proposer_catalog.kind(proposer).draft_model else None)
    return Engine(
        target.model, target.tokenizer, proposer_catalog.build(proposer, spec, target, draft, costs), spec=spec,
        costs=costs, context_len=target.context_len, proposer_reason=reason,
    )


def release_engine(engine: Engine) -> None:
    """Detach what the engine's proposer attached to the target (an EAGLE head's feature hooks),
    before another engine runs on the same weights."""
    if engine.proposer is not None:
        engine.proposer.close()


def choose_quant(entry: ModelEntry, wanted: str, device: torch.device, dtype: str = "auto") -> tuple[str, str]:
    """The target's weight format and why: as asked; else an explicit --dtype keeps its float
    weights (the model the user asked for), quantized only when they do not fit in memory; else,
    when the published weights are 4-bit anyway (re-packing Q4 GGUF in groups of 32 keeps them),
    w4a8 on a CPU that builds its kernel, since it reads 5 bits per weight and its verify passes
    stay cheap as they widen; else w8a8 on a CPU that multiplies int8 exactly (VNNI/AMX) when it
    fits; else 4-bit for a 4-bit source on a CPU; else the least quantization that fits in memory
    (on MPS 16-bit where it fits: int4 runs its de-quantizing reference there)."""
    if wanted != "auto":
        return wanted, f"--quant {wanted}"
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else psutil.virtual_memory().available
    if dtype != "auto":
        return _fit_in_memory(entry, device, free, DTYPE_NAMES[dtype].itemsize, f"--dtype {dtype}")
    source = (entry.mirror.file if entry.mirror and hub_snapshot(entry) is None else "").lower()
    four_bit = any(tag in source for tag in ("q4_", "q4.", "-q4", "iq4"))
    if device.type == "cpu" and four_bit and (kernel := _w4a8_kernel_name()):
        return "w4a8", (f"the published weights are 4-bit, and localspec's {kernel} kernel multiplies them with "
                        "int8 activations: 5 bits read per weight, and a verify pass of a few tokens costs about "
                        "what one token does")
    if device.type == "cpu" and w8a8_supported() and 1.6 * entry.params * 1e9 < free:
        return "w8a8", ("this CPU multiplies int8 exactly (VNNI), so a 16-token verify pass costs about 2x "
                        "a one-token pass (int4: 5x)")
    if four_bit and device.type == "cpu":
        return "int4", "the published weights are 4-bit (GGUF Q4), int4 keeps them and reads a quarter of bf16's bytes"
    return _fit_in_memory(entry, device, free, 2, "16-bit")


def _fit_in_memory(entry: ModelEntry, device: torch.device, free: int, bytes_per_weight: int, what: str) -> tuple[str, str]:
    """Float weights of `bytes_per_weight` when they fit in `free` bytes, else the least
    quantization that does; `what` names those float weights in the reason."""
    weights = bytes_per_weight * entry.params * 1e9
    if weights * 1.2 < free:
        slow_int4 = " (int4 has no fast kernel on MPS: it would de-quantize every weight on every pass)" if device.type == "mps" else ""
        return "none", f"{what} weights fit in memory" + slow_int4
    too_big = f"{what} weights ({weights / 1e9:.1f} GB) do not fit in {free / 1e9:.1f} GB free"
    if device.type == "mps":
        return "int4", too_big
    if 1.2 * entry.params * 1e9 < free:  # int8: a byte per weight
        return "int8", too_big
    return ("nf4" if device.type == "cuda" else "int4"), f"even 8-bit weights do not fit in {free / 1e9:.1f} GB free"


def _w4a8_kernel_name() -> str | None:
    """The w4a8 kernel's instruction set, or None (said once) when it cannot be built here."""
    try:
        return quantization.w4a8_kernel().name
    except LocalspecError as exc:
        _say_once(f"{exc}; using another weight format")
        return None


@functools.cache
def _say_once(message: str) -> None:
    notice(message)


def load_models(
    entry: ModelEntry, draft_entry: ModelEntry | None, proposer: str, dtype: str, spec: SpecConfig, quiet: bool
) -> tuple[LoadedModel, LoadedModel | None, str]:
    """Target (and draft) at the requested or measured dtype and weight format; returns them and
    why that dtype / format."""
    if dtype not in ("auto", *DTYPE_NAMES):
        raise LocalspecError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    device = pick_device()
    quant, quant_reason = choose_quant(entry, spec.quant, device, dtype)
    if quant != "none":
        torch_dtype = quantization.compute_dtype(quant)
        how = {"w8a8": "int8 weights and activations, float32 between them",
               "w4a8": "int4 weights and int8 activations, float32 between them"}.get(quant, f"{quant} weights, bfloat16 activations")
        dtype_reason = f"{how} ({quant_reason})"
    elif dtype == "auto":
        torch_dtype, dtype_reason = choose_dtype(entry, draft_entry, proposer, spec, device, quiet)
    else:
        torch_dtype, dtype_reason = DTYPE_NAMES[dtype], f"--dtype {dtype}"
    target = load_model(entry, torch_dtype, quant=quant, device=device, progress=not quiet)
    draft = load_draft(draft_entry, torch_dtype, device, spec, quiet) if draft_entry else None
    # w8a8 packing ran behind the draft's load; generation waits for it, so that the speed guard
    # and the measured history see the steady state
    for loaded in (target, draft):
        if loaded is not None:
            wait_for_packing(loaded.model)
    if draft is not None:
        refused = check_tokenizers(entry.name, target.tokenizer, draft_entry.name, draft.tokenizer)
        if refused:
            raise LocalspecError(f"{refused}; the draft proposer cannot pair them (try --proposer ngram)")
    discard_unused(target, draft)  # the copies of other formats (measured ones included) go
    return target, draft, dtype_reason


def describe_weights(loaded: LoadedModel) -> str:
    """How a loaded model computes, for reports: dtype plus any fast path swapped in."""
    parts = [str(loaded.dtype).removeprefix("torch.")]
    if weights := quantization.describe(loaded.model):
        parts.append(weights)
    if any(isinstance(m, PackedLinear) for m in loaded.model.modules()):
        parts.append("prepacked weights for wide passes")
    return ", ".join(parts)


def load_draft(entry: ModelEntry, dtype: torch.dtype, device: torch.device, spec: SpecConfig, quiet: bool) -> LoadedModel:
    """The draft as asked (--draft-quant), or with auto the format whose measured step is fastest
    on this machine (decided once, then remembered). Only the guesses change, never the output."""
    if spec.draft_quant != "auto":
        quant = spec.draft_quant
    elif device.type != "cpu":
        quant = "none"
    else:
        candidates = ("none", "int8", "int4", "w8a8", "w4a8")
        key = draft_format_key(entry.name, dtype, candidates)
        quant = load_calibration(key).get("quant")
        if quant not in candidates:
            notice(f"measuring the draft {entry.name}'s step in each weight format (once)", quiet)
            steps = {}
            for candidate in candidates:
                try:
                    loaded = load_model(entry, dtype, quant=candidate, device=device, progress=not quiet)
                except LocalspecError:
                    continue  # a format this build cannot run
                use_exact_pass(loaded.model)  # as `DraftModelProposer` runs it
                steps[candidate] = measured_costs(loaded.name, loaded.model, (1,))[1]
                del loaded
            quant = min(steps, key=steps.get)
            save_calibration(key, {"quant": quant, "step_seconds": steps})
    return load_model(entry, dtype, quant=quant, device=device, progress=not quiet)


def draft_entry_for(registry: Registry, entry: ModelEntry) -> ModelEntry:
    return registry.get(registered_draft(entry))


def open_session(
    model: str | None = None,
    proposer: str = "auto",
    dtype: str = "auto",
    spec: SpecConfig | None = None,
    quiet: bool = False,
    registry: Registry | None = None,
    head_error: str | None = None,
) -> Session:
    """Load and calibrate; `head_error` (set by the retry below) says why auto must pass over the EAGLE head."""
    registry = registry or load_registry()
    entry = registry.get(model)
    spec = spec or SpecConfig(proposer=proposer)
    requested = proposer
    proposer, reason, draft_name = choose_proposer(
        proposer, entry, registry, head_error=head_error, **situation(registry, entry.name)
    )
    draft_entry = registry.get(draft_name) if draft_name else None
    short = None
    try:
        target, draft, dtype_reason = load_models(entry, draft_entry, proposer, dtype, spec, quiet)
    except Exception as exc:
        memory_short = is_out_of_memory(exc) or (isinstance(exc, LocalspecError) and "memory" in str(exc))
        if draft_entry is None or not memory_short:
            raise
        short = first_line(exc)
    if short is not None:
        # Out of the except block, the traceback no longer holds the first attempt's target:
        # collect it before the retry, or two targets would have to fit at once.
        release_memory()
        # the draft is what did not fit (the target alone is loaded next): go on with prompt lookup
        proposer = "ngram"
        reason = f"the draft {draft_entry.name} did not fit in memory ({short}); using prompt lookup instead"
        notice(reason, quiet)
        draft_entry = None
        target, draft, dtype_reason = load_models(entry, None, proposer, dtype, spec, quiet)
    try:
        engine = make_engine(target, draft, proposer, spec, reason)
    except LocalspecError as exc:
        if requested != "auto" or proposer != "eagle" or head_error is not None:  # retried once at most
            raise
        head_error = first_line(exc)
    else:
        if requested == "auto" and proposer == "draft" and not draft_pays(engine.costs, spec.max_draft_len):
            costs = engine.costs
            reason = (f"the draft's measured step ({costs.draft_step_seconds * 1e3:.0f} ms) against the target's "
                      f"one-token pass ({costs.verify(1) * 1e3:.0f} ms) cannot beat plain decoding even at "
                      f"{ASSUMED_ACCEPTANCE:.0%} acceptance; using prompt lookup instead")
            notice(reason, quiet)
            del engine, draft
            release_memory()
            proposer, draft = "ngram", None
            engine = make_engine(target, None, proposer, spec, reason)
        return Session(entry, target, draft, engine, proposer, reason, dtype_reason)
    # auto picked a head that cannot be loaded: choose again without it (the reason says why)
    del target, draft
    release_memory()
    return open_session(model, requested, dtype, spec, quiet, registry, head_error=head_error)
