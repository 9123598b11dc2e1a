"""From a model name and options to a ready Engine: load, choose proposer and dtype, calibrate.

The CLI, the benchmark and the UI all start here; the engine itself knows nothing of registries,
files or dtype choices. `open_session` walks the catalog's ranked candidates once, top to bottom:
a candidate that cannot be opened (a head that fails to load, a draft out of memory, under auto a
draft whose measured step cannot pay) gives way to the next, keeping the weights the next one can
run on. `Session.switch_proposer` builds another engine on the weights in hand (the chat's
proposer switch, the pairing wizard), with the same draft loading, checks and cleanup.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil
import torch

from localspec.base import timings
from localspec.base.config import SpecConfig
from localspec.base.errors import LocalspecError, first_line, is_out_of_memory
from localspec.base.reasons import Reason
from localspec.core import policy
from localspec.core.engine import Engine
from localspec.core.stats import GenerationStats
from localspec.runtime import quant as quantization
from localspec.runtime.costs import CostModel, WIDTHS, cost_model
from localspec.store import proposer_catalog
from localspec.store.cleanup import discard_unused
from localspec.store.loading import LoadedModel, load_model, pick_device, release_memory
from localspec.store.machine import OthersLoad, check_tokenizers, fit_threads, situation
from localspec.store.history import record_generation
from localspec.store.paths import fetched_gguf, hub_snapshot
from localspec.store.measurements import (
    QUIET_OTHERS, draft_format_key, dtype_key, forget_pass_costs, load_calibration, measured_costs, measured_curves,
    save_calibration,
)
from localspec.store.proposer_catalog import Candidate, rank_proposers, registered_draft
from localspec.store.registry import ModelEntry, Registry, load_registry
from localspec.kernels.cpu_linear import (
    PackedLinear, linear_bytes, pack_linears, packs, set_wide_from, unpack_linears,
)
from localspec.kernels.cpu_w8a8 import w8a8_supported, wait_for_packing

PACKING_MEMORY_MARGIN = 1 << 30
"""Free memory to leave beside the packed weight copies."""
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ASSUMED_ACCEPTANCE = 0.7
"""Acceptance used to compare dtypes before any generation has been seen."""
STALE_COSTS = 1.4
"""How far (either way) an answer's own verify passes may run from their calibrated times (CPU)
before the calibration is taken as stale and measured again next start. On a quiet 2-core VM the
1.5B's passes wander up to ~20% around their calibrated best (costs.QUIET_SPREAD), and a pass here
also carries its acceptance rule and commit, a few percent more."""
STALE_AFTER_PASSES = 16
"""Fewest passes an answer must have for its times to judge the calibration."""
IDLE_FOR_THREADS = 1.0
"""Seconds between turns over which other programs' load is worth re-sizing the thread pool for
(a shorter gap: the count fitted at the start stands)."""


class DraftCannotPay(LocalspecError):
    """Under auto, a draft whose measured step cannot beat plain decoding (the message says by how much)."""

    def __init__(self, why: Reason) -> None:
        super().__init__(why)
        self.why = why


@dataclass
class Session:
    """The weights loaded for one target (and its draft), and the engine running on them now."""

    entry: ModelEntry
    registry: Registry
    target: LoadedModel
    draft: LoadedModel | None
    dtype_reason: Reason
    """Why the target computes in its dtype and weight format."""
    quiet: bool = True
    engine: Engine | None = None
    proposer: str = "none"
    reason: Reason = Reason("", "")
    """Why this proposer, in one line."""
    calibrated_threads: int = field(default_factory=torch.get_num_threads)
    """The thread count the engine's pass costs were measured at."""
    _idle: OthersLoad = field(default_factory=OthersLoad)
    """Other programs' load since the last answer ended (or the session opened)."""
    _turn: OthersLoad | None = None
    """Other programs' load since this answer began."""

    @property
    def weights_choice(self) -> Reason:
        """The target's weight format and device, and why: in short "w4a8 · file's own 4/6/8-bit ·
        AVX2 kernel · cpu"."""
        device = self.target.device.type
        return Reason(f"weights: {self.dtype_reason}, on {device}", f"{self.dtype_reason.short} · {device}")

    @property
    def proposer_choice(self) -> Reason:
        """The proposer running now, and why: in short "draft qwen2.5-coder-0.5b · same tokenizer, fits"."""
        drafts_with_model = self.draft is not None and proposer_catalog.kind(self.proposer).draft_model
        name = f"{self.proposer} {self.draft.name}" if drafts_with_model else self.proposer
        return Reason(f"{self.proposer} proposer: {self.reason}", f"{name} · {self.reason.short}")

    @property
    def summary(self) -> str:
        """What a person reads first (the CLI's first line, the server's ready line): the weights
        and the proposer, each in a few words."""
        return f"{self.weights_choice.short}; {self.proposer_choice.short}"

    def record(self, stats: GenerationStats) -> None:
        """Keep a finished answer's figures in this machine's history, under the running pair, and
        measure the pass costs again next start if the answer's own times say they went stale."""
        record_generation(self.entry.name, self.proposer, stats, self.draft.name if self.draft else None)
        turn, self._turn, self._idle = self._turn, None, OthersLoad()
        if self.engine is None or self.target.device.type != "cpu" or turn is None or turn.cores() >= QUIET_OTHERS:
            return  # a busy machine's answer says more about the other work than about the calibration
        if torch.get_num_threads() != self.calibrated_threads:
            return  # the costs are those of another thread count: of course they differ
        if stats.passes < STALE_AFTER_PASSES or stats.expected_verify_seconds <= 0 or stats.verify_seconds <= 0:
            return
        ratio = stats.verify_seconds / stats.expected_verify_seconds
        if max(ratio, 1 / ratio) > STALE_COSTS:
            forget_pass_costs(self.target.name, self.target.model)
            notice(f"{self.target.name}'s passes took {ratio:.2f}x their calibrated time on a quiet machine: "
                   "its pass costs are measured again next start", self.quiet)

    def begin_turn(self) -> None:
        """Before an answer (the engine calls it): the thread pool re-sized to the cores other
        programs left free since the last answer, and this answer's look at their load begun."""
        if self.target.device.type == "cpu" and time.monotonic() - self._idle.started >= IDLE_FOR_THREADS:
            before = torch.get_num_threads()
            now = fit_threads(lambda line: notice(line, self.quiet), self._idle)
            if now != before and now != self.calibrated_threads:
                notice(f"the pass costs were measured on {self.calibrated_threads} threads: drafts are sized on them "
                       "until the next start", self.quiet)
        self._turn = OthersLoad()

    def details(self) -> dict:
        """What a report says about the running pair, as JSON-ready data (the CLI's `--json`, and
        what the resident engine tells its clients, which print it as an in-process run would)."""
        weights, proposer = self.weights_choice, self.proposer_choice
        return {
            "model": self.entry.name, "proposer": self.proposer, "reason": str(self.reason),
            "draft": self.draft.name if self.draft else None,
            "dtype": str(self.target.dtype).removeprefix("torch."), "device": self.target.device.type,
            "target_weights": describe_weights(self.target),
            "draft_weights": describe_weights(self.draft) if self.draft else None,
            "dtype_reason": str(self.dtype_reason), "summary": self.summary,
            "weights_choice": str(weights), "weights_short": weights.short,
            "proposer_choice": str(proposer), "proposer_short": proposer.short,
        }

    def switch_proposer(
        self, proposer: str, spec: SpecConfig, reason: Reason,
        status: Callable[[str], None] | None = None, draft_must_pay: bool = False,
    ) -> Engine:
        """An engine for `proposer` on the weights in hand; the old engine's proposer is closed
        once the new one is built, so a failure leaves the old engine working. A proposer that
        drafts with a model gets the registered draft loaded beside the target when none is here,
        as opening loads it (its measured format, the tokenizer check, the unused copies removed).
        With `draft_must_pay`, a draft whose measured step cannot pay is refused (DraftCannotPay).
        `status` hears each stage (the chat's loading screen)."""
        status = status or (lambda stage: None)
        needs_draft = proposer_catalog.kind(proposer).draft_model
        if needs_draft and self.draft is None:
            draft_entry = draft_entry_for(self.registry, self.entry)
            status(f"loading draft model {draft_entry.name}")
            # the draft alone, at the target's dtype: the target stays as it is
            draft = load_draft(draft_entry, self.target.dtype, self.target.device, spec, self.quiet)
            wait_for_packing(draft.model)
            check_pair(self.entry, self.target, draft_entry, draft)
            discard_unused(self.target, draft)
            self.draft = draft
        status("measuring pass costs (cached after the first time)")
        draft = self.draft if needs_draft else None
        costs = costs_for(self.target, draft)
        if draft_must_pay and draft is not None and not draft_pays(costs, spec.max_draft_len):
            step = f"{costs.draft_step_seconds * 1e3:.0f} ms"
            raise DraftCannotPay(Reason(
                f"the draft's measured step ({step}) against the target's one-token pass "
                f"({costs.verify(1) * 1e3:.0f} ms) cannot beat plain decoding by {policy.DRAFT_MARGIN - 1:.0%} "
                f"even at {ASSUMED_ACCEPTANCE:.0%} acceptance",
                f"draft too slow here: {step} a step",
            ))
        engine = make_engine(self.target, draft, proposer, spec, reason, costs)
        engine.before_turn = self.begin_turn
        self.close()
        self.engine, self.proposer, self.reason = engine, proposer, reason
        return engine

    def close(self) -> None:
        """Detach what the engine's proposer attached to the target (an EAGLE head's feature
        hooks), before another engine runs on the same weights."""
        if self.engine is not None and self.engine.proposer is not None:
            self.engine.proposer.close()
        self.engine = None


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
    if target.device.type != "cpu" or not packs(target.dtype):  # nothing to pack: no second measurement
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
    """The costs of the passes generation runs (timed through the `TargetPass` the engine and the
    draft proposer run)."""
    with timings.phase("calibration"):
        verify = fast_verify_path(target, widths)
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
) -> tuple[torch.dtype, Reason]:
    """The compute dtype: bf16/fp16 on accelerators; on a CPU whichever the measurement favours."""
    if device.type == "cuda":
        # a card that only emulates bf16 (before Ampere) runs it far slower than fp16
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, Reason("bfloat16, which this card computes natively", "bfloat16")
        return torch.float16, Reason("float16: this card only emulates bfloat16, far slower", "float16")
    if device.type == "mps":
        return torch.float16, Reason("float16, MPS's fast dtype", "float16")
    key = dtype_key(entry.name, draft_entry.name if draft_entry else None, proposer)
    cached = load_calibration(key)
    if cached.get("dtype") in DTYPE_NAMES:
        return DTYPE_NAMES[cached["dtype"]], _measured(cached["dtype"], str(cached.get("reason", "")))
    notice(f"measuring float32 vs bfloat16 for {entry.name} on this CPU (once)", quiet)
    rates = {}
    for name in ("float32", "bfloat16"):
        target = load_model(entry, DTYPE_NAMES[name], device=device, progress=not quiet)
        draft = load_model(draft_entry, DTYPE_NAMES[name], device=device, progress=not quiet) if draft_entry else None
        rates[name] = _best_rate(costs_for(target, draft), proposer, spec.max_draft_len)
        del target, draft
    best = max(rates, key=rates.get)
    reason = _measured(best, "measured " + ", ".join(f"{n} {r:.2f} tok/s" for n, r in rates.items()) + f" -> {best}")
    save_calibration(key, {"dtype": best, "reason": reason})
    return DTYPE_NAMES[best], reason


def _measured(dtype: str, figures: str) -> Reason:
    """The reason for a dtype the measurement chose (`figures`: what it measured, as the
    calibration keeps it)."""
    return Reason(figures, f"{dtype} · measured faster here")


def make_engine(
    target: LoadedModel, draft: LoadedModel | None, proposer: str, spec: SpecConfig, reason: str,
    costs: CostModel | None = None,
) -> Engine:
    """An engine over already-loaded weights (the benchmark builds several over the same ones);
    `costs` when they were measured for this pair already."""
    costs = costs or costs_for(target, draft if proposer_catalog.kind(proposer).draft_model else None)
    built = proposer_catalog.build(proposer, spec, target, draft, costs)
    # a model proposer carries suffix decoding's guesses (this conversation, earlier ones, --context)
    carried = proposer_catalog.suffix_lookup(spec, target) if built is not None and built.has_model and spec.lookup else None
    return Engine(
        target.model, target.tokenizer, built, spec=spec,
        costs=costs, context_len=target.context_len, proposer_reason=reason, lookup=carried,
    )


def reads_gguf(entry: ModelEntry) -> bool:
    """Whether the entry loads from a GGUF (the user's own, one fetched from the hub, or the
    mirror's): no download of 16-bit files here."""
    return hub_snapshot(entry) is None and (entry.gguf is not None or entry.mirror is not None
                                            or fetched_gguf(entry) is not None)


def choose_quant(entry: ModelEntry, wanted: str, device: torch.device, dtype: str = "auto") -> tuple[str, Reason]:
    """The target's weight format and why: as asked; else an explicit --dtype keeps its float
    weights (the model the user asked for), quantized only when they do not fit in memory; else,
    for a GGUF, the file's own numbers: w4a8 on a CPU that builds its kernel (its verify passes
    stay cheap as they widen), else int4 (on MPS, which has no int4 kernel, 16-bit where it
    fits); for a hub download, w8a8 on a CPU that multiplies int8
    exactly (VNNI/AMX) when it fits; else the least quantization that fits in memory (on MPS
    16-bit where it fits: int4 runs its de-quantizing reference there)."""
    if wanted != "auto":
        return wanted, Reason(f"--quant {wanted}", "asked for")
    free = torch.cuda.mem_get_info()[0] if device.type == "cuda" else psutil.virtual_memory().available
    if dtype != "auto":
        return _fit_in_memory(entry, device, free, DTYPE_NAMES[dtype].itemsize, f"--dtype {dtype}")
    from_gguf = reads_gguf(entry)
    if from_gguf and device.type == "cpu" and (kernel := _w4a8_kernel_name()):
        widening = ("a verify pass of a few tokens costs about what one token does" if "VNNI" in kernel else
                    "a verify pass costs more as it widens on AVX2 (4 tokens about 1.7x one), which the draft sizes follow")
        return "w4a8", Reason(
            f"the file's own 4-, 6- and 8-bit weights, multiplied with int8 activations by localspec's {kernel} "
            f"kernel: {widening}", f"file's own 4/6/8-bit · {kernel} kernel")
    if from_gguf and device.type != "mps":  # MPS has no int4 kernel: 16-bit where it fits, below
        return "int4", Reason("the file's own 4-bit weights (its wider ones in bf16): nothing re-quantized",
                              "file's own 4-bit")
    if device.type == "cpu" and w8a8_supported() and 1.6 * entry.params * 1e9 < free:
        return "w8a8", Reason("this CPU multiplies int8 exactly (VNNI), so a 16-token verify pass costs about 2x "
                              "a one-token pass (int4: 5x)", "exact int8 on this CPU")
    return _fit_in_memory(entry, device, free, 2, "16-bit")


def _fit_in_memory(entry: ModelEntry, device: torch.device, free: int, bytes_per_weight: int, what: str) -> tuple[str, Reason]:
    """Float weights of `bytes_per_weight` when they fit in `free` bytes, else the least
    quantization that does; `what` names those float weights in the reason."""
    weights = bytes_per_weight * entry.params * 1e9
    if weights * 1.2 < free:
        slow_int4 = " (int4 has no fast kernel on MPS: it would de-quantize every weight on every pass)" if device.type == "mps" else ""
        return "none", Reason(f"{what} weights fit in memory" + slow_int4, "fits in memory")
    too_big = Reason(f"{what} weights ({weights / 1e9:.1f} GB) do not fit in {free / 1e9:.1f} GB free",
                     f"{what} weights do not fit")
    if device.type == "mps":
        return "int4", too_big
    if 1.2 * entry.params * 1e9 < free:  # int8: a byte per weight
        return "int8", too_big
    return ("nf4" if device.type == "cuda" else "int4"), Reason(f"even 8-bit weights do not fit in {free / 1e9:.1f} GB free",
                                                               "8-bit weights do not fit")


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
) -> tuple[LoadedModel, LoadedModel | None, Reason]:
    """Target (and draft) at the requested or measured dtype and weight format; returns them and
    why that dtype / format."""
    if dtype not in ("auto", *DTYPE_NAMES):
        raise LocalspecError(f"--dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    with timings.phase("target_load"):  # the weight format's choice too: it builds the w4a8 kernel on first use
        device = pick_device()
        quant, quant_reason = choose_quant(entry, spec.quant, device, dtype)
        if quant != "none":
            torch_dtype = quantization.compute_dtype(quant)
            how = {"w8a8": "int8 weights and activations, float32 between them",
                   "w4a8": "4-, 6- and 8-bit weights (as the file has them) and int8 activations, float32 between them"}.get(quant, f"{quant} weights, bfloat16 activations")
            dtype_reason = Reason(f"{how} ({quant_reason})", f"{quant} · {quant_reason.short}")
        elif dtype == "auto":
            torch_dtype, dtype_reason = choose_dtype(entry, draft_entry, proposer, spec, device, quiet)
        else:
            torch_dtype, dtype_reason = DTYPE_NAMES[dtype], Reason(f"--dtype {dtype}", dtype)
        target = load_model(entry, torch_dtype, quant=quant, device=device, progress=not quiet)
    with timings.phase("draft_load"):
        draft = load_draft(draft_entry, torch_dtype, device, spec, quiet) if draft_entry else None
    # w8a8 packing ran behind the draft's load; generation waits for it, so that the speed guard
    # and the measured history see the steady state
    for loaded in (target, draft):
        if loaded is not None:
            wait_for_packing(loaded.model)
    if draft is not None:
        with timings.phase("draft_load"):
            check_pair(entry, target, draft_entry, draft)
    discard_unused(target, draft)  # the copies of other formats (measured ones included) go
    return target, draft, dtype_reason


def check_pair(entry: ModelEntry, target: LoadedModel, draft_entry: ModelEntry, draft: LoadedModel) -> None:
    """Refuse a draft whose tokens do not mean the same to the target, saying what differs."""
    refused = check_tokenizers(entry.name, target.tokenizer, draft_entry.name, draft.tokenizer)
    if refused:
        raise LocalspecError(f"{refused}; the draft proposer cannot pair them (try --proposer ngram)")


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
    on this machine (decided once, then remembered). Only the guesses change, never the output.
    A GGUF draft runs as its target does, in the format streamed from its file (w4a8 where the
    kernel builds, else int4): the others would hold a float copy of it first, which is what the
    first run's memory cannot afford."""
    if spec.draft_quant != "auto":
        quant = spec.draft_quant
    elif device.type != "cpu":
        quant = "none"
    elif reads_gguf(entry):
        quant = choose_quant(entry, "auto", device)[0]
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
) -> Session:
    """Load and calibrate the first of the catalog's candidates that opens. One that cannot be
    opened gives way to the next: a notice says why at once, and the reason of the one opened
    names it among those passed over. The weights in hand stay for a next candidate that runs on
    them (the target alone, or the same pair); the last candidate's failure is the user's to see."""
    with timings.phase("registry"):
        registry = registry or load_registry()
        entry = registry.get(model)
        spec = spec or SpecConfig(proposer=proposer)
        if pick_device().type == "cpu":  # before any pass is timed: a calibration holds for its thread count
            fit_threads(lambda line: notice(line, quiet))
        ranked = rank_proposers(proposer, entry, registry, **situation(registry, entry.name))
    held: Session | None = None
    refused: list[tuple[Candidate, Reason]] = []

    def open_candidate(candidate: Candidate) -> Session:
        nonlocal held
        if held is not None and candidate.draft != (held.draft.name if held.draft else None):
            if candidate.draft is None:
                held.draft = None  # the target alone runs this one
            else:
                held = None  # another pair: the weights in hand go before its load
            release_memory()
        if held is None:
            draft_entry = registry.get(candidate.draft) if candidate.draft else None
            held = Session(entry, registry, *load_models(entry, draft_entry, candidate.proposer, dtype, spec, quiet), quiet)
        held.switch_proposer(candidate.proposer, spec, candidate.reason_after(refused), draft_must_pay=proposer == "auto")
        return held

    for candidate, then in zip(ranked, ranked[1:]):
        try:
            return open_candidate(candidate)
        except Exception as exc:
            why = _why_passed_over(exc, candidate)
            if why is None:
                raise
        notice(f"{why}; using {then.title} instead", quiet)
        refused.append((candidate, why))
        # out of the except block, the traceback no longer holds a failed load's weights: collect
        # them before the next load, or two targets would have to fit at once
        release_memory()
    return open_candidate(ranked[-1])


def _why_passed_over(exc: Exception, candidate: Candidate) -> Reason | None:
    """Why `candidate` gives way to the next one, in one line; None when `exc` is the user's to see."""
    if isinstance(exc, DraftCannotPay):
        return exc.why
    memory_short = is_out_of_memory(exc) or (isinstance(exc, LocalspecError) and "memory" in str(exc))
    if candidate.draft is not None and memory_short:
        return Reason(f"the draft {candidate.draft} did not fit in memory ({first_line(exc)})",
                      f"draft {candidate.draft} did not fit in memory")
    if proposer_catalog.kind(candidate.proposer).head and isinstance(exc, LocalspecError):
        return Reason(f"the EAGLE head here cannot be loaded: {first_line(exc)}", "EAGLE head here cannot be loaded")
    return None
