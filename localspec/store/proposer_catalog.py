"""The proposers localspec runs, in one table, and the ranked candidates `--proposer auto` walks.

Each `ProposerKind` says what a proposer needs (a draft model, an EAGLE head), whether it drafts
trees, whether it can run for a target on this machine (and if not, why, in one line) and how to
build it. The CLI's option choices, `--proposer auto`, the chat UI's proposer switch, `bench` and
the pairing wizard all read this table, so a proposer added here is offered everywhere.

To add a proposer: write it under localspec/proposers/ (the `Proposer` interface in base.py), then
add one `ProposerKind` to KINDS; `rank_proposers` decides where auto ranks it.

No torch here: the CLI builds its choices and the chat UI its menu before the weights load. The
factories therefore import their proposer's module when called; those are the only function-level
imports in this file, and they are there for start-up time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from localspec.base.config import SpecConfig, eagle_head_dir, has_eagle_head
from localspec.base.errors import LocalspecError, first_line
from localspec.base.reasons import Reason
from localspec.store.history import Measured, pair_key
from localspec.store.registry import ModelEntry, Registry, load_registry

if TYPE_CHECKING:
    from localspec.core.proposers.base import Proposer
    from localspec.runtime.costs import CostModel
    from localspec.store.loading import LoadedModel

MIN_HISTORY_TOKENS = 200
"""Fewer generated tokens than this say too little about a pair's speed to overrule the order."""


@dataclass(frozen=True)
class ProposerKind:
    name: str
    about: str
    """One line: where the guesses come from (shown in `--help`)."""
    title: str
    """What a notice calls it ("using prompt lookup instead")."""
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


def _build_suffix(spec, target, draft, costs) -> Proposer:
    return suffix_lookup(spec, target)


def suffix_lookup(spec: SpecConfig, target: LoadedModel) -> Proposer:
    """Suffix decoding over this conversation, this model's earlier ones here (unless
    `--no-history`) and the `--context` files: the suffix proposer, and the lookup a model
    proposer carries."""
    import sys

    from localspec.core.proposers.suffix import SuffixProposer
    from localspec.store.token_history import TokenHistory, context_documents

    context = context_documents(spec.context, target.tokenizer.encode) if spec.context else []
    history = TokenHistory(target.name, context, keep=spec.history,
                           notify=lambda line: print(f"localspec: {line}", file=sys.stderr))
    return SuffixProposer(history.indexes(), history.remember)


def _build_draft(spec, target, draft, costs) -> Proposer:
    from localspec.core.proposers.draft_model import DraftModelProposer

    if draft is None:
        raise LocalspecError("the draft proposer needs a draft model")
    return DraftModelProposer(draft.model)


def _build_eagle(spec, target, draft, costs) -> Proposer:
    """The EAGLE head trained for this target on this machine (the ranking saw it there), checked
    against the target strictly."""
    import torch

    from localspec.core.proposers.eagle import EagleProposer
    from localspec.core.proposers.eagle_head import build_head, load_head

    folder = eagle_head_dir(target.name)
    try:
        checkpoint = load_head(folder, target.model.config)
        head = build_head(checkpoint, target.model, torch.float32).to(target.device)
    except LocalspecError as exc:
        raise LocalspecError(f"the EAGLE head in {folder} cannot be used for {target.name}: {exc}") from exc
    except Exception as exc:  # a damaged file (truncated safetensors, config.json of another shape)
        raise LocalspecError(
            f"the EAGLE head in {folder} is damaged ({first_line(exc)}); "
            f"train it again with `{train_command(load_registry().get(target.name))}`"
        ) from exc
    return EagleProposer(head, target.model, top_k=spec.tree_top_k, nodes=spec.tree_nodes, depth=spec.tree_depth)


KINDS: dict[str, ProposerKind] = {
    kind.name: kind
    for kind in (
        ProposerKind("eagle", "an EAGLE head trained here drafts a tree from the target's own hidden states",
                     "the EAGLE head", _build_eagle, head=True, trees=True),
        ProposerKind("draft", "a small model with the target's tokenizer drafts a chain", "the draft model",
                     _build_draft, draft_model=True),
        ProposerKind("suffix", "suffix decoding: a tree of what followed the text's latest suffix in this "
                     "conversation, earlier ones here and --context files", "suffix decoding", _build_suffix, trees=True),
        ProposerKind("ngram", "prompt lookup: what followed the text's latest suffix earlier on", "prompt lookup",
                     _build_ngram),
        ProposerKind("none", "plain decoding, one token per target pass", "plain decoding", _no_proposer),
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


# --- the ranking ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """One proposer (and draft) worth opening, where it ranks, and why those above it were left out."""

    proposer: str
    about: Reason
    """Why this proposer, on its own terms (one line)."""
    draft: str | None = None
    """The draft model's registry name when the proposer drafts with a model."""
    passed_over: tuple[Reason, ...] = ()
    """Why each proposer ranked above this one was left out of the ranking, in rank order."""

    @property
    def reason(self) -> Reason:
        """Why this one, and why not those above it (one line, shown on stderr, in the UI, in --json)."""
        return self.reason_after([])

    def reason_after(self, refused: list[tuple[Candidate, Reason]]) -> Reason:
        """The reason once the candidates in `refused`, ranked above this one, could not be opened:
        in full, each one's why among the passed-over ones, at its place in the ranking. In short,
        the candidate's own few words; but a proposer that needs nothing beside the target (prompt
        lookup, plain decoding) runs because those above it could not, so the nearest of them
        says why instead."""
        said = list(self.passed_over)
        for earlier, why in reversed(refused):  # the latest first, so the earlier places stay put
            said.insert(len(earlier.passed_over), why)
        if not said:
            return self.about
        needs = KINDS[self.proposer]
        stands_in = not (needs.draft_model or needs.head)
        return Reason(f"{self.about} ({'; '.join(said)})", said[-1].short if stands_in else self.about.short)

    @property
    def title(self) -> str:
        """What it is called when it takes over from a candidate that could not be opened."""
        return f"draft {self.draft}" if self.draft else KINDS[self.proposer].title


def registered_draft(entry: ModelEntry) -> str:
    """The draft `--proposer draft` loads: the one a saved pairing chose, else the first registered."""
    if not entry.drafts:
        raise LocalspecError(f"{entry.name} has no registered draft model; try --proposer ngram")
    return entry.paired.draft if entry.paired and entry.paired.draft in entry.drafts else entry.drafts[0]


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


PROMPT_LOOKUP = Reason("prompt lookup needs no extra model", "needs no extra model")
SUFFIX_DECODING = Reason("suffix decoding needs no extra model and remembers earlier answers here",
                         "needs no extra model")


def rank_proposers(
    requested: str,
    entry: ModelEntry,
    registry: Registry | None = None,
    *,
    downloaded: set[str] | None = None,
    memory: int | None = None,
    history: dict[str, Measured] | None = None,
) -> list[Candidate]:
    """Resolve --proposer into the candidates to open, best first; the session opens the first
    that loads and passes over the others (a head that fails to load, a draft that does not fit
    in memory or, under auto, one whose measured step cannot pay).

    An explicit proposer that cannot run for this target is a one-line error; asked for, it is
    the one candidate, except that a draft model gives way to suffix decoding when it does not fit
    in memory. For auto the order is EAGLE head > draft model > suffix decoding > n-gram > none. A proposer is left
    out when it is not downloaded, does not fit in `memory` (bytes free for weights and caches)
    beside the target, or was measured slower than plain decoding on this machine (`history`,
    keyed by pair_key); the EAGLE head also when a draft was measured faster here. A saved
    `localspec pair` result ranks first, being a measurement itself. Unknown facts (None) exclude
    nothing. The ranking reaches prompt lookup or plain decoding, which always open.
    """
    history = history or {}
    if requested != "auto":
        why_not = unavailable(requested, entry)
        if why_not:
            raise LocalspecError(f"{why_not}; try --proposer ngram")
        asked = Candidate(requested, Reason(f"--proposer {requested} was asked for", "asked for"),
                          registered_draft(entry) if kind(requested).draft_model else None)
        return [asked, Candidate("suffix", SUFFIX_DECODING)] if asked.draft else [asked]

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

    ranked: list[Candidate] = []
    skipped: list[Reason] = []

    def rank(proposer: str, about: Reason, draft: str | None = None) -> None:
        if all((c.proposer, c.draft) != (proposer, draft) for c in ranked):  # a saved pairing is not ranked twice
            ranked.append(Candidate(proposer, about, draft, tuple(skipped)))

    paired = entry.paired
    if paired and paired.proposer in KINDS and not slow(pair_key(paired.proposer, paired.draft)):
        usable = unavailable(paired.proposer, entry) is None and (paired.draft is None or (
            registry is not None and paired.draft in registry.models
            and have(paired.draft) and fits(registry.models[paired.draft])
        ))
        if usable:
            what = f"draft {paired.draft}" if paired.draft else paired.proposer
            rank(paired.proposer, Reason(
                f"{what} won `localspec pair` here ({paired.tokens_per_second:.1f} tok/s, {paired.speedup:.2f}x plain)",
                f"won localspec pair here, {paired.speedup:.2f}x plain"), paired.draft)

    if has_eagle_head(entry.name):
        eagle = known("eagle")
        # a draft measured faster here wins over the head (heads trained on a small machine can be weak)
        rivals = [(m.speedup, name) for name in entry.drafts if (m := known(pair_key("draft", name))) and have(name)]
        rival = max(rivals, default=None)
        if eagle and eagle.speedup < 1.0:
            skipped.append(Reason(f"the EAGLE head measured {eagle.speedup:.2f}x plain here",
                                  f"EAGLE head measured {eagle.speedup:.2f}x plain"))
        elif eagle and rival and rival[0] > eagle.speedup:
            skipped.append(Reason(f"the EAGLE head measured {eagle.speedup:.2f}x plain here, draft {rival[1]} {rival[0]:.2f}x",
                                  f"EAGLE head {eagle.speedup:.2f}x plain, draft {rival[0]:.2f}x"))
        else:
            rank("eagle", Reason(f"an EAGLE head trained for {entry.name} is on this machine ({eagle_head_dir(entry.name)})",
                                 "EAGLE head trained here"))
    elif entry.eagle_heads:
        skipped.append(Reason(f"no EAGLE head on this machine ({train_command(entry)})", "no EAGLE head here"))

    for name in entry.drafts:
        draft = registry.models.get(name) if registry is not None else None
        measured = slow(pair_key("draft", name))
        if not have(name):
            skipped.append(Reason(f"draft {name} is not downloaded (localspec pull {name})", f"draft {name} not downloaded"))
        elif draft is not None and not fits(draft):
            need = entry.memory_with(draft)
            skipped.append(Reason(f"draft {name} does not fit beside the target ({_gb(need)} needed, {_gb(memory)} free)",
                                  f"draft {name} does not fit in memory"))
        elif measured:
            skipped.append(Reason(f"draft {name} measured {measured.speedup:.2f}x plain here",
                                  f"draft {name} measured {measured.speedup:.2f}x plain"))
        else:
            rank("draft", Reason(f"draft {name} has the same tokenizer and fits", "same tokenizer, fits"), name)
    if not entry.drafts:
        skipped.append(Reason("no registered draft", "no draft registered"))

    for lookup, about in (("suffix", SUFFIX_DECODING), ("ngram", PROMPT_LOOKUP)):  # they need nothing beside the target
        measured = slow(lookup)
        if measured is None:
            rank(lookup, about)
        else:
            title = KINDS[lookup].title
            skipped.append(Reason(f"{title} measured {measured.speedup:.2f}x plain here",
                                  f"{title} measured {measured.speedup:.2f}x plain"))
    if slow("ngram"):  # the last lookup: plain decoding is the one left
        rank("none", Reason("plain decoding", "plain decoding"))
    return ranked
