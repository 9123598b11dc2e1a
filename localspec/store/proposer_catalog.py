"""The proposers localspec runs, in one table, and the `--proposer auto` choice among them.

Each `ProposerKind` says what a proposer needs (a draft model, an EAGLE head), whether it drafts
trees, whether it can run for a target on this machine (and if not, why, in one line) and how to
build it. The CLI's option choices, `--proposer auto`, the chat UI's proposer switch, `bench` and
the pairing wizard all read this table, so a proposer added here is offered everywhere.

To add a proposer: write it under localspec/proposers/ (the `Proposer` interface in base.py), then
add one `ProposerKind` to KINDS; `choose_proposer` decides where auto ranks it.

No torch here: the CLI builds its choices and the chat UI its menu before the weights load. The
factories therefore import their proposer's module when called; those are the only function-level
imports in this file, and they are there for start-up time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from localspec.base.config import SpecConfig, eagle_head_dir, has_eagle_head
from localspec.base.errors import LocalspecError, first_line
from localspec.store.measurements import Measured, pair_key
from localspec.store.registry import ModelEntry, Registry, load_registry

if TYPE_CHECKING:
    from localspec.runtime.costs import CostModel
    from localspec.store.loading import LoadedModel
    from localspec.core.proposers.base import Proposer

MIN_HISTORY_TOKENS = 200
"""Fewer generated tokens than this say too little about a pair's speed to overrule the order."""


@dataclass(frozen=True)
class ProposerKind:
    name: str
    about: str
    """One line: where the guesses come from (shown in `--help`)."""
    build: Callable[[SpecConfig, LoadedModel, LoadedModel | None, CostModel], Proposer | None]
    """(spec, target, draft, costs) -> the proposer (None: plain decoding)."""
    draft_model: bool = False
    """Drafts with a registered draft model, loaded beside the target."""
    head: bool = False
    """Drafts with an EAGLE head trained for the target on this machine."""
    trees: bool = False
    """Drafts a tree of candidates (several per position), not one chain."""


def _no_proposer(spec, target, draft, costs) -> None:
    return None


def _build_ngram(spec, target, draft, costs) -> Proposer:
    from localspec.core.proposers.ngram import NgramProposer

    return NgramProposer(spec.ngram_min, spec.ngram_max)


def _build_draft(spec, target, draft, costs) -> Proposer:
    from localspec.core.proposers.draft_model import DraftModelProposer

    if draft is None:
        raise LocalspecError("the draft proposer needs a draft model")
    return DraftModelProposer(draft.model)


def _build_eagle(spec, target, draft, costs) -> Proposer:
    """The EAGLE head trained for this target on this machine, checked against it strictly."""
    import torch

    from localspec.core.proposers.eagle import EagleProposer
    from localspec.core.proposers.eagle_head import build_head, load_head

    entry = load_registry().get(target.name)
    if why_not := unavailable("eagle", entry):
        raise LocalspecError(f"{why_not} or use --proposer draft/ngram")
    folder = eagle_head_dir(target.name)
    try:
        checkpoint = load_head(folder, target.model.config)
        head = build_head(checkpoint, target.model, torch.float32).to(target.device)
    except LocalspecError as exc:
        raise LocalspecError(f"the EAGLE head in {folder} cannot be used for {target.name}: {exc}") from exc
    except Exception as exc:  # a damaged file (truncated safetensors, config.json of another shape)
        raise LocalspecError(
            f"the EAGLE head in {folder} is damaged ({first_line(exc)}); train it again with `{train_command(entry)}`"
        ) from exc
    return EagleProposer(head, target.model, costs, top_k=spec.tree_top_k, nodes=spec.tree_nodes, depth=spec.tree_depth)


KINDS: dict[str, ProposerKind] = {
    kind.name: kind
    for kind in (
        ProposerKind("eagle", "an EAGLE head trained here drafts a tree from the target's own hidden states",
                     _build_eagle, head=True, trees=True),
        ProposerKind("draft", "a small model with the target's tokenizer drafts a chain", _build_draft, draft_model=True),
        ProposerKind("ngram", "prompt lookup: what followed the text's latest suffix earlier on", _build_ngram),
        ProposerKind("none", "plain decoding, one token per target pass", _no_proposer),
    )
}
"""Every proposer, in the order `--proposer auto` prefers them when nothing was measured."""
CHOICES = ("auto", *KINDS)
"""What --proposer accepts."""


def kind(name: str) -> ProposerKind:
    if name not in KINDS:
        raise LocalspecError(f"--proposer must be one of {', '.join(CHOICES)}, got {name!r}")
    return KINDS[name]


def unavailable(name: str, entry: ModelEntry) -> str | None:
    """None when proposer `name` can run for `entry` on this machine; otherwise why not, in one line."""
    needs = kind(name)
    if needs.draft_model and not entry.drafts:
        return f"{entry.name} has no registered draft model"
    if needs.head and not has_eagle_head(entry.name):
        return f"no EAGLE head for {entry.name} on this machine ({eagle_head_dir(entry.name)}); train one with `{train_command(entry)}`"
    return None


def available(entry: ModelEntry) -> list[str]:
    """The proposers that can run for `entry` here, in KINDS' order."""
    return [name for name in KINDS if unavailable(name, entry) is None]


def build(name: str, spec: SpecConfig, target: LoadedModel, draft: LoadedModel | None, costs: CostModel) -> Proposer | None:
    return kind(name).build(spec, target, draft, costs)


def train_command(entry: ModelEntry) -> str:
    """The command that makes this target's EAGLE head here, with its registered recipe."""
    recipe = next((h.train for h in entry.eagle_heads if h.train), "")
    return f"localspec train-eagle --target {entry.name}{' ' + recipe if recipe else ''}"


# --- automatic proposer choice -----------------------------------------------------------------


class Choice(NamedTuple):
    proposer: str
    reason: str
    """One line, shown to the user (stderr, the UI, --json)."""
    draft: str | None = None
    """The draft model's registry name when the proposer drafts with a model."""


def registered_draft(entry: ModelEntry) -> str:
    """The draft `--proposer draft` loads: the one a saved pairing chose, else the first registered."""
    if not entry.drafts:
        raise LocalspecError(f"{entry.name} has no registered draft model; try --proposer ngram")
    return entry.paired.draft if entry.paired and entry.paired.draft in entry.drafts else entry.drafts[0]


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def choose_proposer(
    requested: str,
    entry: ModelEntry,
    registry: Registry | None = None,
    *,
    downloaded: set[str] | None = None,
    memory: int | None = None,
    history: dict[str, Measured] | None = None,
    head_error: str | None = None,
) -> Choice:
    """Resolve --proposer into a concrete proposer, with the one-line reason shown to the user.

    An explicit proposer that cannot run for this target is a one-line error. For auto the order
    is EAGLE head > draft model > n-gram > none. A candidate is passed over when it is not
    downloaded, does not fit in `memory` (bytes free for weights and caches)
    beside the target, or was measured slower than plain decoding on this machine (`history`,
    keyed by pair_key); the EAGLE head also when a draft was measured faster here, or when it
    could not be loaded (`head_error`, the reason). A saved
    `localspec pair` result comes first, being a measurement itself. Unknown facts (None) exclude
    nothing.
    """
    history = history or {}
    if requested != "auto":
        why_not = unavailable(requested, entry)
        if why_not:
            raise LocalspecError(f"{why_not}; try --proposer ngram")
        draft = registered_draft(entry) if kind(requested).draft_model else None
        return Choice(requested, f"--proposer {requested} was asked for", draft)

    def have(name: str) -> bool:
        return downloaded is None or name in downloaded

    def known(key: str) -> Measured | None:
        seen = history.get(key)
        return seen if seen and seen.tokens >= MIN_HISTORY_TOKENS else None

    def slow(key: str) -> Measured | None:
        seen = known(key)
        return seen if seen and seen.speedup < 1.0 else None

    def fits(draft: ModelEntry) -> bool:
        return memory is None or entry.memory_with(draft) <= memory

    skipped: list[str] = []
    paired = entry.paired
    if paired and paired.proposer in KINDS and not slow(pair_key(paired.proposer, paired.draft)):
        usable = unavailable(paired.proposer, entry) is None and (paired.draft is None or (
            registry is not None and paired.draft in registry.models
            and have(paired.draft) and fits(registry.models[paired.draft])
        ))
        if usable:
            what = f"draft {paired.draft}" if paired.draft else paired.proposer
            return Choice(
                paired.proposer,
                f"{what} won `localspec pair` here ({paired.tokens_per_second:.1f} tok/s, {paired.speedup:.2f}x plain)",
                paired.draft,
            )

    if head_error is not None:
        skipped.append(f"the EAGLE head here cannot be loaded: {head_error}")
    elif has_eagle_head(entry.name):
        eagle = known("eagle")
        # a draft measured faster here wins over the head (heads trained on a small machine can be weak)
        rivals = [(m.speedup, name) for name in entry.drafts if (m := known(pair_key("draft", name))) and have(name)]
        rival = max(rivals, default=None)
        if eagle and eagle.speedup < 1.0:
            skipped.append(f"the EAGLE head measured {eagle.speedup:.2f}x plain here")
        elif eagle and rival and rival[0] > eagle.speedup:
            skipped.append(f"the EAGLE head measured {eagle.speedup:.2f}x plain here, draft {rival[1]} {rival[0]:.2f}x")
        else:
            return Choice("eagle", _with_skipped(f"an EAGLE head trained for {entry.name} is on this machine ({eagle_head_dir(entry.name)})", skipped))
    elif entry.eagle_heads:
        skipped.append(f"no EAGLE head on this machine ({train_command(entry)})")

    for name in entry.drafts:
        draft = registry.models.get(name) if registry is not None else None
        measured = slow(pair_key("draft", name))
        if not have(name):
            skipped.append(f"draft {name} is not downloaded (localspec pull {name})")
        elif draft is not None and not fits(draft):
            need = entry.memory_with(draft)
            skipped.append(f"draft {name} does not fit beside the target ({_gb(need)} needed, {_gb(memory)} free)")
        elif measured:
            skipped.append(f"draft {name} measured {measured.speedup:.2f}x plain here")
        else:
            return Choice("draft", _with_skipped(f"draft {name} has the same tokenizer and fits", skipped), name)
    if not entry.drafts:
        skipped.append("no registered draft")

    measured = slow("ngram")
    if measured is None:
        return Choice("ngram", _with_skipped("prompt lookup needs no extra model", skipped))
    skipped.append(f"prompt lookup measured {measured.speedup:.2f}x plain here")
    return Choice("none", _with_skipped("plain decoding", skipped))


def _with_skipped(reason: str, skipped: list[str]) -> str:
    return f"{reason} ({'; '.join(skipped)})" if skipped else reason
