"""`localspec pair`: measure every proposer that can run for a target here and keep the fastest.

Detect the hardware, offer targets that fit, download the target and its compatible drafts,
measure each proposer in the catalog that can run (plain decoding, prompt lookup, an EAGLE head
trained here, each compatible draft) on a few prompts, and save the winner to the user registry,
where `--proposer auto` finds it. Sits on top: it loads and runs models like `bench` does.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from localspec.apps.bench import load_prompts, localspec_answer, machine_info
from localspec.base.config import SpecConfig
from localspec.base.errors import LocalspecError
from localspec.base.reasons import Reason
from localspec.core.policy import best_draft_len
from localspec.store import hub, loading, paths, proposer_catalog, tokenizers
from localspec.store.machine import check_eagle_head, check_tokenizers, free_memory
from localspec.store.history import pair_key, record_generation
from localspec.store.registry import ModelEntry, Registry, fitting_targets, load_registry, save_user_model, user_registry_path
from localspec.store.session import Session, load_models

PAIR_PROMPTS = 3
"""Prompts measured per candidate (from the bench set unless the user gives a file)."""


# --- the wizard --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    proposer: str
    draft: str | None
    tokens_per_second: float
    acceptance: float
    draft_len: int


def pair(
    target: str | None,
    *,
    prompts_file: str | None = None,
    max_new_tokens: int = 64,
    dtype: str = "auto",
    offline: bool = False,
    say: Callable[[str], None] = lambda line: print(f"localspec: {line}", file=sys.stderr, flush=True),
    ask: Callable[[str], str] | None = None,
) -> Candidate:
    """The wizard; `ask` (None: not interactive) picks a target when none is named."""
    registry = load_registry()
    device = loading.pick_device()
    memory = free_memory(device)
    info = machine_info()
    say(f"hardware: {info.get('gpu') or info['cpu']} ({device.type}), {memory / 1e9:.1f} GB free")
    entry = _pick_target(registry, target, memory, say, ask)
    prompts = load_prompts(prompts_file)[:PAIR_PROMPTS]

    # what runs on the target alone (plain decoding, prompt lookup, a head trained here), then each draft
    alone = []
    for name, kind in reversed(proposer_catalog.KINDS.items()):  # plain decoding first: the baseline
        why_not = proposer_catalog.unavailable(name, entry)
        if why_not is None and not kind.draft_model:
            alone.append(name)
        elif why_not is not None and kind.head:
            say(f"{name}: {why_not}; skipped")
            for head in entry.eagle_heads:
                if head.repo:  # published heads are listed, localspec runs the ones trained here
                    say(f"  published EAGLE head {head.repo}: {check_eagle_head(entry, head) or 'matches the target'}")
    _ensure_downloaded(entry, offline)
    drafts = []
    for name in entry.drafts:
        draft = registry.get(name)
        need = entry.memory_with(draft)
        if need > memory:
            say(f"draft {name}: needs {need / 1e9:.1f} GB beside the target, {memory / 1e9:.1f} GB free; skipped")
            continue
        _ensure_downloaded(draft, offline)
        refused = check_tokenizers(entry.name, tokenizers.load_tokenizer(entry), name, tokenizers.load_tokenizer(draft))
        if refused:
            say(f"{refused}; skipped")
            continue
        drafts.append(draft)

    spec = SpecConfig(history=False)  # measured on the prompts alone; the wizard's answers are not the user's
    results: list[Candidate] = []
    drafting = [name for name, kind in proposer_catalog.KINDS.items() if kind.draft_model]
    for draft_entry, proposers in [(None, alone), *((d, drafting) for d in drafts)]:
        session = Session(entry, registry, *load_models(entry, draft_entry, proposers[-1], dtype, spec, quiet=True))
        for proposer in proposers:
            engine = session.switch_proposer(proposer, spec, Reason("measured by localspec pair", "being measured"))
            results.append(_measure(engine, entry.name, proposer, draft_entry, prompts, max_new_tokens, spec, say))
        session.close()  # an EAGLE head's hooks must not stay on the target for the next pair
        del session, engine  # before the next draft's load: two targets may not fit

    best = max(results, key=lambda c: c.tokens_per_second)
    plain = next(c for c in results if c.proposer == "none").tokens_per_second
    speedup = best.tokens_per_second / plain if plain > 0 else 0.0
    save_pairing(entry.name, best, speedup)
    say(f"winner for {entry.name}: {pair_key(best.proposer, best.draft)} at {best.tokens_per_second:.2f} tok/s "
        f"({speedup:.2f}x plain), draft length {best.draft_len}; saved to {user_registry_path()}")
    return best


def _ensure_downloaded(entry: ModelEntry, offline: bool) -> None:
    # any local copy will do: measuring needs weights, not the hub's copy in particular
    if not paths.is_downloaded(entry):
        hub.pull(entry, offline=offline)


def _pick_target(registry: Registry, target: str | None, memory: int, say, ask) -> ModelEntry:
    if target is not None:
        entry = registry.get(target)
        if entry.memory_needed() > memory:
            raise LocalspecError(
                f"{entry.name} needs about {entry.memory_needed() / 1e9:.1f} GB, {memory / 1e9:.1f} GB are free"
            )
        return entry
    fits = fitting_targets(registry, memory)
    if not fits:
        raise LocalspecError(f"no registered model fits in the {memory / 1e9:.1f} GB free")
    for i, e in enumerate(fits, 1):
        mark = "downloaded" if paths.is_downloaded(e) else f"{e.size / 1e9:.1f} GB to download"
        say(f"  {i}. {e.name:22} {e.params:5.2f}B  {mark}")
    if ask is None:
        raise LocalspecError(f"name a target: localspec pair NAME (fits here: {', '.join(e.name for e in fits)})")
    answer = ask(f"target [1-{len(fits)}]: ").strip()
    if answer.isdigit() and 1 <= int(answer) <= len(fits):
        return fits[int(answer) - 1]
    return registry.get(answer)


def _measure(engine, model: str, proposer: str, draft: ModelEntry | None, prompts, max_new: int, spec, say) -> Candidate:
    draft_name = draft.name if draft else None
    localspec_answer(engine, prompts[0]["prompt"], 8)  # warm-up, excluded
    tokens = seconds = drafted = accepted = 0
    for prompt in prompts:
        engine.forget()  # each prompt from scratch, as in the benchmark
        _, stats = localspec_answer(engine, prompt["prompt"], max_new)
        record_generation(model, proposer, stats, draft_name)
        tokens += max(stats.new_tokens - 1, 0)
        seconds += stats.decode_seconds
        drafted += stats.drafted
        accepted += stats.accepted
    rate = tokens / seconds if seconds > 0 else 0.0
    acceptance = accepted / drafted if drafted else 0.0
    draft_len = best_draft_len(engine.costs, acceptance, spec.max_draft_len) if proposer != "none" else 0
    say(f"  {pair_key(proposer, draft_name):28} {rate:6.2f} tok/s, acceptance {acceptance:.0%}, best draft length {draft_len}")
    return Candidate(proposer, draft_name, rate, acceptance, draft_len)


def save_pairing(model: str, best: Candidate, speedup: float) -> None:
    """Write the winner into the user registry, keeping every setting in it (comments are not kept)."""
    paired = {
        "proposer": best.proposer, "draft_len": best.draft_len,
        "tokens_per_second": round(best.tokens_per_second, 3),
        "speedup": round(speedup, 3),
        "measured": time.strftime("%Y-%m-%d"),
    }
    if best.draft:
        paired["draft"] = best.draft
    save_user_model(model, {"paired": paired})  # a user edit or another `pair` saved meanwhile is kept


