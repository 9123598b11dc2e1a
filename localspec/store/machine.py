"""What decides whether a pair can run on this machine: tokenizer compatibility, free memory,
and the inputs of `--proposer auto`.

- check_tokenizers: a draft's guesses must mean the same tokens to the target.
- check_eagle_head: a published head is only valid on the target revision it was trained on.
- free_memory: bytes free for weights and caches on the device generation runs on.
- OthersLoad / free_cores / fit_threads: the cores other programs keep busy or leave free, and the thread pool sized to them.
- takes_gguf: whether `pull` takes a model's 4-bit GGUF from the hub rather than its 16-bit files.
- situation: what is downloaded, the free memory and the local history (history.py), i.e.
  the facts proposer_catalog.rank_proposers weighs for `--proposer auto`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import psutil
import torch

from localspec.store import loading, paths
from localspec.store.history import load_history
from localspec.store.progress import print_notice
from localspec.store.registry import EagleHead, ModelEntry, Registry

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


def usable_cores() -> int:
    """Cores this process may run on (its affinity where the OS says, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


THREADS = torch.get_num_threads()
"""The thread pool torch sized at start (one per physical core, or the user's OMP_NUM_THREADS):
the most fit_threads gives back on a quiet machine."""


class OthersLoad:
    """The cores other processes kept busy, on average, from this object's making to a `cores()`
    call: the machine's busy time (user, system, interrupts; a hypervisor's steal is not another
    program here) less this process's own."""

    def __init__(self) -> None:
        self.started, self.busy, self.own = time.monotonic(), _machine_busy(), _own_busy()

    def cores(self) -> float:
        wall = time.monotonic() - self.started
        others = (_machine_busy() - self.busy) - (_own_busy() - self.own)
        # the counters tick every 10 ms: over a shorter wall one tick would read as a whole busy core
        return max(0.0, others) / max(wall, 0.1)


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return sum(getattr(t, field, 0.0) for field in ("user", "nice", "system", "irq", "softirq"))


def _own_busy() -> float:
    t = psutil.Process().cpu_times()
    return t.user + t.system


def free_cores(sample_seconds: float = 0.2, load: OthersLoad | None = None) -> int:
    """Of THREADS, the cores other processes leave free now (over a short sample, or over `load`'s
    time when one is given, which then costs no wait), in whole cores (at least one)."""
    if load is None:
        load = OthersLoad()
        time.sleep(sample_seconds)
    others = load.cores() * THREADS / max(usable_cores(), THREADS)
    return max(1, THREADS - round(others))


def fit_threads(say: Callable[[str], None] = print_notice, load: OthersLoad | None = None) -> int:
    """Size the CPU thread pool (torch's, which the compiled kernels share) to the free cores, so
    that localspec's threads do not spin against another program's on a busy machine; call it
    before loading (the calibration is keyed by the thread count) and between turns (with `load`
    begun when the last turn ended: what other programs did meanwhile). Says so when it changes
    the count; returns the threads now."""
    threads = free_cores(load=load)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        say(f"other work keeps {THREADS - threads} of {THREADS} cores busy: localspec runs on {threads} thread(s)"
            if threads < THREADS else f"the machine is quiet again: localspec runs on {threads} threads")
    return threads


def takes_gguf(entry: ModelEntry) -> str:
    """Why `pull` should fetch the entry's 4-bit GGUF rather than its 16-bit files, or "" when
    the 16-bit files are the better choice: on a CPU the kernel multiplies the file's own 4-bit
    numbers (the 16-bit files would be re-quantized, and are 3x the download); on a GPU or MPS,
    where the 16-bit weights would not fit."""
    device = loading.pick_device()
    if device.type == "cpu":
        return "on a CPU localspec runs the file's own 4-bit weights"
    need, free = 1.2 * entry.memory_needed(), free_memory(device)
    if need > free:
        return f"its 16-bit weights need about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB are free on {device.type}"
    return ""


def situation(registry: Registry, model: str) -> dict:
    """Keyword arguments of proposer_catalog.rank_proposers describing this machine now."""
    return {
        # a model with an offline mirror is fetched and verified on first use like the embedded
        # default target, so its draft counts as at hand: the default pair works out of the box
        "downloaded": {
            name for name, entry in registry.models.items() if entry.mirror is not None or paths.is_downloaded(entry)
        },
        "memory": free_memory(loading.pick_device()),
        "history": load_history(model),
    }
