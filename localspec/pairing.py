"""Which drafts may pair with a target, what this machine offers, and the `localspec pair` wizard.

- check_tokenizers: a draft's guesses must mean the same tokens to the target.
- situation: what is downloaded, the free memory and the local history, i.e. the inputs of
  registry.choose_proposer for `--proposer auto`.
- history: measured speed and acceptance per target and proposer (and draft) on this machine,
  added to after each generation by whoever ran it (record_generation).
- pair: detect the hardware, offer targets that fit, download the target and its compatible
  drafts, measure every candidate proposer on a few prompts, save the winner to the user registry.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from localspec import hub, loading
from localspec.config import SpecConfig, home_dir
from localspec.errors import LocalspecError
from localspec.files import locked, write_text_atomic
from localspec.registry import (
    EagleHead,
    Measured,
    ModelEntry,
    Registry,
    load_registry,
    pair_key,
    read_user_registry,
    user_registry_path,
)
from localspec.stats import GenerationStats

PAIR_PROMPTS = 3
"""Prompts measured per candidate (from the bench set unless the user gives a file)."""

# A template is recognised by the marker that opens a turn.
_TEMPLATE_MARKERS = {
    "chatml": "<|im_start|>",
    "llama3": "<|start_header_id|>",
    "gemma": "<start_of_turn>",
    "mistral": "[INST]",
}


# --- compatibility ------------------------------------------------------------------------------


def template_family(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # several named templates
        template = "\n".join(template.values())
    if not template:
        return "none"
    return next((family for family, marker in _TEMPLATE_MARKERS.items() if marker in template), "other")


def check_tokenizers(target_name: str, target, draft_name: str, draft) -> str | None:
    """None when `draft` may propose tokens for `target`; otherwise what differs, in one line.

    Padding is not a difference: models often pad their embedding past the tokenizer (Qwen's
    151936 vs 152064 rows), and rows no real token maps to are never proposed.
    """
    problems = []
    target_ids, draft_ids = _real_tokens(target), _real_tokens(draft)
    shared = sorted(set(target_ids) & set(draft_ids))
    differ = [i for i in shared if target_ids[i] != draft_ids[i]]
    if differ:
        i = differ[0]
        problems.append(
            f"{len(differ)} of {len(shared)} shared token ids map to different tokens "
            f"(id {i} is {target_ids[i]!r} in {target_name}, {draft_ids[i]!r} in {draft_name})"
        )
    for name, ids, other in ((target_name, target_ids, draft_ids), (draft_name, draft_ids, target_ids)):
        only = sorted(set(ids) - set(other))
        if only:
            problems.append(f"{name} has {len(only)} token ids the other lacks ({only[0]}..{only[-1]})")
    target_special, draft_special = _special_tokens(target), _special_tokens(draft)
    if target_special != draft_special:
        diff = sorted(t for t, _ in target_special ^ draft_special)
        problems.append(f"special tokens differ ({', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''})")
    families = template_family(target), template_family(draft)
    if families[0] != families[1]:
        problems.append(f"chat templates differ ({families[0]} vs {families[1]})")
    if not problems:
        return None
    return f"{draft_name} cannot draft for {target_name}: " + "; ".join(problems)


def _real_tokens(tokenizer) -> dict[int, str]:
    """id -> token, without the "[PAD<id>]" fillers a GGUF tokenizer gives the embedding's padding rows."""
    return {i: token for token, i in tokenizer.get_vocab().items() if token != f"[PAD{i}]"}


def _special_tokens(tokenizer) -> set[tuple[str, int]]:
    """The named special tokens (eos, pad, ...) and every added token flagged special, with ids."""
    named = {(t, tokenizer.convert_tokens_to_ids(t)) for t in tokenizer.all_special_tokens}
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return named | {(str(t), i) for i, t in added.items() if getattr(t, "special", False)}


def check_eagle_head(entry: ModelEntry, head: EagleHead) -> str | None:
    """None when the head was trained on the target revision the registry pins."""
    if head.target_revision != entry.revision:
        return (
            f"EAGLE head {head.repo} was trained on {entry.hub_repo} at {head.target_revision[:12]}, "
            f"the registry pins {entry.revision[:12]}"
        )
    return None


# --- this machine ------------------------------------------------------------------------------


def free_memory(device: torch.device) -> int:
    """Bytes free for weights and caches: the GPU's own memory, else the system's (also MPS's)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def machine_id() -> str:
    return f"{platform.node() or 'this-machine'}/{loading.pick_device().type}"


def situation(registry: Registry, model: str) -> dict:
    """Keyword arguments of registry.choose_proposer describing this machine now."""
    return {
        # a model with an offline mirror is fetched and verified on first use like the embedded
        # default target, so its draft counts as at hand: the default pair works out of the box
        "downloaded": {
            name for name, entry in registry.models.items() if entry.mirror is not None or loading.is_downloaded(entry)
        },
        "memory": free_memory(loading.pick_device()),
        "history": load_history(model),
    }


# --- history -----------------------------------------------------------------------------------


def _history_path():
    return home_dir() / "history.json"


def _read_history() -> dict:
    try:
        data = json.loads(_history_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = None
    # none yet, or damaged: history only refines the choice, it is never required
    return data if isinstance(data, dict) else {}


def load_history(model: str) -> dict[str, Measured]:
    """What was measured for `model` on this machine, by pair_key."""
    machine = _read_history().get(machine_id())
    records = machine.get(model) if isinstance(machine, dict) else None
    return {
        key: Measured(
            tokens=r["tokens"], speedup=r["speedup_tokens"] / r["tokens"],
            acceptance=r["accepted"] / r["drafted"] if r["drafted"] else 0.0,
        )
        for key, r in (records.items() if isinstance(records, dict) else ())
        if _counts(r) and r["tokens"]  # a record hand-edited into another shape is passed over
    }


def record_generation(model: str, proposer: str, stats: GenerationStats, draft: str | None = None) -> None:
    """Add one finished generation to the history (call it after each one)."""
    speedup = stats.measured_speedup
    if stats.new_tokens < 2 or speedup <= 0:  # no decode time, or no calibrated plain cost to compare with
        return
    try:
        with locked(_history_path()):  # two processes finishing at once both count
            data = _read_history()
            record = _history_record(data, model, pair_key(proposer, draft))
            record["generations"] += 1
            record["tokens"] += stats.new_tokens
            record["speedup_tokens"] += speedup * stats.new_tokens
            record["drafted"] += stats.drafted
            record["accepted"] += stats.accepted
            write_text_atomic(_history_path(), json.dumps(data, indent=1))
    except OSError:
        pass  # a history that cannot be saved only costs a less informed choice later


_COUNTS = {"generations": 0, "tokens": 0, "speedup_tokens": 0.0, "drafted": 0, "accepted": 0}


def _history_record(data: dict, model: str, key: str) -> dict:
    """The counters of one pair in `data`, made anew where a hand edit left another shape."""
    machine = data.get(machine_id())
    machine = data[machine_id()] = machine if isinstance(machine, dict) else {}
    records = machine.get(model)
    records = machine[model] = records if isinstance(records, dict) else {}
    record = records.get(key)
    records[key] = record if _counts(record) else dict(_COUNTS)
    return records[key]


def _counts(record: object) -> bool:
    """Whether a history record holds every counter, as a number."""
    return isinstance(record, dict) and all(
        isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool) for k in _COUNTS
    )


# --- the wizard --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    proposer: str
    draft: str | None
    tokens_per_second: float
    acceptance: float
    draft_len: int


def fitting_targets(registry: Registry, memory: int) -> list[ModelEntry]:
    """Models that fit in `memory` with a KV cache, largest first."""
    fits = [e for e in registry.models.values() if e.memory_needed() <= memory]
    return sorted(fits, key=lambda e: -e.params)


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
    # session and bench import this module (for --proposer auto), so they are imported here
    from localspec.bench import load_prompts, machine_info
    from localspec.session import load_models, make_engine

    registry = load_registry()
    device = loading.pick_device()
    memory = free_memory(device)
    info = machine_info()
    say(f"hardware: {info.get('gpu') or info['cpu']} ({device.type}), {memory / 1e9:.1f} GB free")
    entry = _pick_target(registry, target, memory, say, ask)
    prompts = load_prompts(prompts_file)[:PAIR_PROMPTS]

    for head in entry.eagle_heads:
        say(f"EAGLE head {head.repo}: {check_eagle_head(entry, head) or 'matches the target'}; not implemented yet, skipped")
    _ensure_downloaded(entry, offline)
    drafts = []
    for name in entry.drafts:
        draft = registry.get(name)
        need = entry.memory_with(draft)
        if need > memory:
            say(f"draft {name}: needs {need / 1e9:.1f} GB beside the target, {memory / 1e9:.1f} GB free; skipped")
            continue
        _ensure_downloaded(draft, offline)
        refused = check_tokenizers(entry.name, loading.load_tokenizer(entry), name, loading.load_tokenizer(draft))
        if refused:
            say(f"{refused}; skipped")
            continue
        drafts.append(draft)

    spec = SpecConfig()
    results: list[Candidate] = []
    for draft_entry in [None, *drafts]:
        proposers = ("draft",) if draft_entry else ("none", "ngram")
        target_model, draft_model, _ = load_models(
            entry, draft_entry, proposers[-1], dtype, spec, quiet=True
        )
        for proposer in proposers:
            engine = make_engine(target_model, draft_model, proposer, spec, "measured by localspec pair")
            results.append(_measure(engine, entry.name, proposer, draft_entry, prompts, max_new_tokens, spec, say))
        del target_model, draft_model, engine  # before the next draft's load: two targets may not fit

    best = max(results, key=lambda c: c.tokens_per_second)
    plain = next(c for c in results if c.proposer == "none").tokens_per_second
    speedup = best.tokens_per_second / plain if plain > 0 else 0.0
    save_pairing(entry.name, best, speedup)
    say(f"winner for {entry.name}: {pair_key(best.proposer, best.draft)} at {best.tokens_per_second:.2f} tok/s "
        f"({speedup:.2f}x plain), draft length {best.draft_len}; saved to {user_registry_path()}")
    return best


def _ensure_downloaded(entry: ModelEntry, offline: bool) -> None:
    # any local copy will do: measuring needs weights, not the hub's copy in particular
    if not loading.is_downloaded(entry):
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
        mark = "downloaded" if loading.is_downloaded(e) else f"{e.size / 1e9:.1f} GB to download"
        say(f"  {i}. {e.name:22} {e.params:5.2f}B  {mark}")
    if ask is None:
        raise LocalspecError(f"name a target: localspec pair NAME (fits here: {', '.join(e.name for e in fits)})")
    answer = ask(f"target [1-{len(fits)}]: ").strip()
    if answer.isdigit() and 1 <= int(answer) <= len(fits):
        return fits[int(answer) - 1]
    return registry.get(answer)


def _measure(engine, model: str, proposer: str, draft: ModelEntry | None, prompts, max_new: int, spec, say) -> Candidate:
    from localspec.bench import run_localspec

    draft_name = draft.name if draft else None
    run_localspec(engine, prompts[0]["prompt"], 8)  # warm-up, excluded
    tokens = seconds = drafted = accepted = 0
    for prompt in prompts:
        engine.forget()  # each prompt from scratch, as in the benchmark
        run_localspec(engine, prompt["prompt"], max_new)
        stats = engine.stats
        record_generation(model, proposer, stats, draft_name)
        tokens += max(stats.new_tokens - 1, 0)
        seconds += stats.decode_seconds
        drafted += stats.drafted
        accepted += stats.accepted
    rate = tokens / seconds if seconds > 0 else 0.0
    acceptance = accepted / drafted if drafted else 0.0
    draft_len = engine.costs.best_draft_len(acceptance, spec.max_draft_len) if proposer != "none" else 0
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
    path = user_registry_path()
    try:
        with locked(path):  # a user edit or another `pair` saved meanwhile is kept
            data = read_user_registry()
            data.setdefault("models", {}).setdefault(model, {})["paired"] = paired
            write_text_atomic(path, to_toml(data))
    except OSError as exc:
        raise LocalspecError(f"could not save the pairing to {path}: {exc}") from exc
    load_registry()  # what was written must load: fail here, not at the next `run`


def to_toml(data: dict) -> str:
    """The subset of TOML the registry uses (tables, arrays of tables, strings, numbers, lists)."""
    lines: list[str] = []

    def key(k: str) -> str:
        return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # JSON string escapes are valid TOML basic-string escapes
        return "[" + ", ".join(value(x) for x in v) + "]"

    def table(path: list[str], body: dict, header: str | None) -> None:
        if header:
            lines.extend(["", header])
        for k, v in body.items():
            if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict)):
                lines.append(f"{key(k)} = {value(v)}")
        for k, v in body.items():
            sub = [*path, key(k)]
            if isinstance(v, dict):
                table(sub, v, f"[{'.'.join(sub)}]")
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    table(sub, item, f"[[{'.'.join(sub)}]]")

    table([], data, None)
    return "\n".join(lines).lstrip("\n") + "\n"
