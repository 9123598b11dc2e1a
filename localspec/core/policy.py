"""The draft policy: how many guesses each pass verifies, and whose.

Nothing here touches a model or decides a token: verification keeps the output exact whatever is
decided, so the policy only trades drafting time against tokens per pass. It decides in one place
for every proposer: `DraftPolicy.plan` (nothing, prompt lookup's guess alone, or the model's chain
or tree with the guess grafted in, each sized here), the questions a model proposer asks while it
drafts (`another_guess` for a chain, `another_level` and `tree_nodes` for a tree), and `learn`
after the pass.

One formula (Leviathan et al. 2023, with measured costs in place of a constant ratio): a pass
commits the target's own token plus each drafted node with the probability that the target accepts
it (its "reach"), and costs the drafting time plus one verify pass over the root and the drafted
nodes, measured per width (`CostModel`). `expected_rate` is that quotient; every draft length, tree
size and lookup-vs-model choice below maximises it, and `predicted_speedup` is the same quotient in
units of one plain pass.

One estimator: `Running`, a ratio of exponentially decayed sums started at a prior, for acceptance
(accepted over judged guesses), rates (tokens over seconds) and step times (seconds over steps).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import accumulate
from operator import mul

import torch

from localspec.base.config import SamplingConfig, SpecConfig
from localspec.core.proposers.base import Proposer
from localspec.core.stats import chain_tokens, predicted_speedup
from localspec.core.tree import Draft, graft, matched_path, path_probabilities
from localspec.runtime.costs import CostModel
from localspec.runtime.kv import common_prefix

DECAY = 0.9
"""How much a pass weighs in every running estimate next to the pass after it: about the last ten
passes count, so the policy follows a conversation that changes (code, then prose)."""

PRIOR_WEIGHT = 3.0
"""How many observations a prior is worth before the first measurement."""

PRIOR_ACCEPTANCE = 0.6
"""How often a kind of guess never judged yet is believed accepted (measurements take over)."""

UNMEASURED_DRAFT_LEN = 4
"""Guesses verified per pass when no pass cost was measured (tests, a model without calibration)."""
MODEL_TREES = "model"
"""The tree calibration a model proposer's trees share (a lookup's trees have their labels')."""


class Running:
    """A ratio over recent passes: the decayed sum of amounts over the decayed sum of weights,
    started at `prior` worth PRIOR_WEIGHT of weight (None: no value until the first `add`).

    A pass that says nothing new (`rest`) moves the value back towards the prior: after a bad
    stretch that made some guess look useless, the policy tries it again a little later instead of
    never again.
    """

    def __init__(self, prior: float | None = None) -> None:
        self.prior = prior
        self.amount = 0.0 if prior is None else prior * PRIOR_WEIGHT
        self.weight = 0.0 if prior is None else PRIOR_WEIGHT

    def add(self, amount: float, weight: float) -> None:
        self.amount = DECAY * self.amount + amount
        self.weight = DECAY * self.weight + weight

    def rest(self) -> None:
        if self.prior is not None:
            self.add((1 - DECAY) * self.prior * PRIOR_WEIGHT, (1 - DECAY) * PRIOR_WEIGHT)

    @property
    def value(self) -> float | None:
        return self.amount / self.weight if self.weight > 0 else self.prior


class Acceptance(Running):
    """How often one kind of guess is accepted, per guess.

    A pass that accepted k of g guesses saw k successes and, when k < g, one failure: the guesses
    after the first rejected one were never judged. A pass without guesses says nothing new.
    """

    def __init__(self, prior: float = PRIOR_ACCEPTANCE) -> None:
        super().__init__(prior)

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            self.rest()
        else:
            self.add(accepted, accepted + (1 if accepted < drafted else 0))

    @property
    def rate(self) -> float:
        return self.value


# -- the formula -----------------------------------------------------------------------------------


def expected_rate(costs: CostModel, tokens: float, width: int, draft_seconds: float) -> float:
    """Expected tokens per second of a pass that commits `tokens` on average (`expected_tokens`),
    spent `draft_seconds` drafting and verifies `width` drafted nodes together with the root."""
    return tokens / (draft_seconds + costs.verify(width + 1))


def expected_tokens(reach: Iterable[float]) -> float:
    """Tokens a pass commits on average: the target's own, plus each drafted node's reach (the
    probability that the target accepts it)."""
    return 1.0 + sum(reach)


def chain_rate(costs: CostModel, acceptance: float, length: int, free: bool = False) -> float:
    """`expected_rate` of a chain of `length` guesses, each costing a draft step unless `free`
    (a lookup's guesses)."""
    steps = 0.0 if free else length * costs.draft_step_seconds
    return expected_rate(costs, chain_tokens(acceptance, length), length, steps)


def best_draft_len(costs: CostModel, acceptance: float, max_len: int, free: bool = False) -> int:
    """The chain length (0 .. max_len) with the best expected rate; the shortest of equals."""
    return max(range(max_len + 1), key=lambda g: chain_rate(costs, acceptance, g, free))


def best_rate(costs: CostModel, acceptance: float, max_len: int) -> float:
    """Tokens per second expected with the best draft-model chain of at most `max_len` guesses
    (0: plain decoding)."""
    return chain_rate(costs, acceptance, best_draft_len(costs, acceptance, max_len))


DRAFT_MARGIN = 1.15
"""How much faster than plain decoding a draft model must expect to be, on its calibrated costs,
to be taken: those are the best of repeated passes, and generation's run 10-20% slower. A draft
that merely broke even on paper lost: the 0.5B beside the 1.5B on an AVX2-only CPU, taken on a
fresh home, decoded at 0.76x plain (65% acceptance)."""


def draft_model_pays(costs: CostModel, acceptance: float, max_len: int) -> bool:
    """Whether a draft model at its measured step cost beats plain decoding at this acceptance by
    DRAFT_MARGIN: a target made fast can leave a draft too dear to be worth it."""
    return best_rate(costs, acceptance, max_len) >= DRAFT_MARGIN * best_rate(costs, acceptance, 0)


# -- trees (EAGLE) ---------------------------------------------------------------------------------


def best_node_count(costs: CostModel, reach: list[float], draft_seconds: float, limit: int) -> int:
    """How many of a tree's candidates (`reach`, most likely first, ancestors before descendants)
    to verify for the best expected rate, after `draft_seconds` of drafting."""
    rates = [expected_rate(costs, tokens, n, draft_seconds) for n, tokens in enumerate(accumulate(reach[:limit], initial=1.0))]
    return max(range(len(rates)), key=rates.__getitem__)  # the fewest nodes of equals


def deeper_pays(costs: CostModel, reach: list[float], nodes: int, frontier: list[float], depth: int,
                step_seconds: float, limit: int) -> bool:
    """Whether drafting one more tree level can raise the expected rate: the tree of `nodes` best
    candidates (of `reach`, most likely first) after `depth` steps, against one step more whose
    level adds at most the frontier's reach (children never outscore their parent) and widens the
    pass by the frontier."""
    tokens = expected_tokens(reach[:nodes])
    now = expected_rate(costs, tokens, nodes, depth * step_seconds)
    deeper = expected_rate(costs, tokens + sum(frontier), min(nodes + len(frontier), limit), (depth + 1) * step_seconds)
    return deeper > now


# -- one engine's policy ---------------------------------------------------------------------------


@dataclass
class Proposal:
    """What one pass verifies, and whose guesses it holds: each part is judged on its own."""

    draft: Draft
    model: Draft | None = None
    """The model proposer's own guesses (draft model, EAGLE), when it drafted this pass."""
    lookup: Draft | None = None
    """Prompt lookup's guesses (a chain), judged under their label."""
    skipped_model: bool = False
    """The model proposer did not draft: prompt lookup's guess alone was expected to pay more."""
    tree: bool = False
    """The model's draft was sized as a tree: its path probabilities calibrate `tree_nodes`."""


class DraftPolicy:
    """What one engine drafts each pass, learned from the passes so far.

    Acceptance is tracked per kind of guess: per lookup label (a 3-token match is far more reliable
    than a 1-token one) and, for a chain-drafting model, per bin of its own confidence in a guess.
    """

    def __init__(self, spec: SpecConfig, costs: CostModel | None) -> None:
        self.spec = spec
        self.costs = costs
        self.lookup_acceptance: dict[str, Acceptance] = defaultdict(Acceptance)
        self.lookup_evidence: dict[str, Acceptance] = defaultdict(lambda: Acceptance(prior=0.0))
        """Per lookup label, acceptance believed only from what was seen: skipping the model on a
        guess is a bet, so it is made on evidence (the grafted branch gathers it for free)."""
        self.by_confidence: dict[int, Acceptance] = {}
        self.model_rate = Running()
        """Tokens per second of the passes the model proposer drafted for."""
        self.level_seconds = Running()
        """Seconds of one tree level (one step of an EAGLE head)."""
        self.tree_calibration: dict[str, Running] = defaultdict(lambda: Running(prior=1.0))
        """Accepted tokens over predicted ones (the sum of a tree's path probabilities): a model's
        trees under MODEL_TREES, a lookup's under its label (suffix decoding's match length and
        where it matched), since a one-token match's counts promise far more than they keep."""
        self.guard = SpeedGuard(costs) if costs is not None else None

    @property
    def allows(self) -> bool:
        """False while the kill switch has speculation paused."""
        return self.guard is None or self.guard.allows

    # -- before the pass --------------------------------------------------------------------------

    def plan(self, proposer: Proposer | None, lookup: Proposer | None, tokens: list[int], limit: int,
             sampling: SamplingConfig, generator: torch.Generator) -> Proposal:
        """What this pass verifies, at most `limit` nodes after `tokens`: nothing while the kill
        switch has speculation paused; a lookup's guess (the proposer's own, or the `lookup` a
        model proposer carries), cut to the length that pays for its label; alone, when it is
        expected to beat the model's measured rate; else the model's chain (at most the chain
        limit) or tree (every node that fits), drafted while `another_guess` / `another_level`
        say it pays, with the lookup's guess grafted in as one more branch."""
        if proposer is None or limit <= 0 or not self.allows:
            return Proposal(Draft.chain([]))
        guesser = lookup if proposer.has_model else proposer
        alone = guesser is proposer  # a lookup verified on its own keeps its draft's shape, a tree too
        wanted = limit if alone and proposer.builds_trees else self.chain_limit(limit)
        guess = guesser.propose(tokens, wanted, sampling, generator) if guesser else Draft.chain([])
        guess = guess if alone else guess.likeliest_chain()  # grafted into the model's draft as one branch
        guess = guess.first(self.lookup_size(guess, limit))
        if not proposer.has_model:
            return Proposal(guess, lookup=guess)
        if len(guess) and self.lookup_alone_pays(guess):
            return Proposal(guess, lookup=guess, skipped_model=True)
        room = limit - len(guess)
        wanted = room if proposer.builds_trees else self.chain_limit(room)
        own = proposer.propose(tokens, wanted, sampling, generator, self) if wanted > 0 else Draft.chain([])
        return Proposal(graft(own, guess.tokens), model=own, lookup=guess if len(guess) else None, tree=proposer.builds_trees)

    def chain_limit(self, limit: int) -> int:
        """Most guesses a chain may offer this pass (lookup, draft model): the fixed length, else
        the configured maximum, within the room left."""
        return min(limit, self.spec.draft_len or self.spec.max_draft_len)

    def lookup_len(self, label: str, available: int) -> int:
        """Tokens of a lookup guess worth verifying: fixed, or the best expected rate for the
        acceptance seen so far under this label (a lookup's guesses cost no draft steps)."""
        if self.spec.draft_len is not None:
            wanted = self.spec.draft_len
        elif self.costs is not None:
            wanted = best_draft_len(self.costs, self.lookup_acceptance[label].rate, self.spec.max_draft_len, free=True)
        else:
            wanted = min(UNMEASURED_DRAFT_LEN, self.spec.max_draft_len)
        return max(0, min(wanted, available))

    def lookup_size(self, guess: Draft, limit: int) -> int:
        """Nodes of a lookup's guess worth verifying: a chain's length by its label's acceptance
        (`lookup_len`); a tree's node count by its path probabilities, as a model's tree is sized
        but with no drafting time (a lookup's guesses are free)."""
        if guess.is_chain:
            return self.lookup_len(guess.label, len(guess))
        if self.spec.draft_len is not None:
            return min(self.spec.draft_len, len(guess))
        return self._tree_size(path_probabilities(guess), 0, limit, guess.label)

    def lookup_alone_pays(self, guess: Draft) -> bool:
        """Whether verifying a lookup guess alone is expected to beat the model proposer's measured
        rate, so this pass need not spend the model's drafting time."""
        if self.costs is None or self.model_rate.value is None:
            return False
        alone = chain_rate(self.costs, self.lookup_evidence[guess.label].rate, len(guess), free=True)
        return alone >= self.model_rate.value

    # -- while a model drafts (the questions in proposers/base.py) ---------------------------------

    def another_guess(self, confidences: list[float]) -> bool:
        """Whether keeping a chain's newest guess raises the expected rate of this pass, each
        guess's acceptance read from the bin of the model's confidence in it (the newest last);
        always, for a fixed length or without measured costs."""
        if self.spec.draft_len is not None or self.costs is None:
            return True
        k = len(confidences)
        reach = list(accumulate((self._confidence_bin(c).rate for c in confidences), mul))
        step = self.costs.draft_step_seconds
        without = expected_rate(self.costs, expected_tokens(reach[:-1]), k - 1, (k - 1) * step)
        with_it = expected_rate(self.costs, expected_tokens(reach), k, k * step)
        if with_it > without:
            return True
        # a refused guess is never judged: let its bin drift back to its prior, so it is tried again
        self._confidence_bin(confidences[-1]).update(0, 0)
        return False

    def tree_nodes(self, probs: list[float], levels: int, limit: int) -> int:
        """How many of a tree's candidates (path probabilities `probs`, most likely first,
        ancestors before descendants) to verify after drafting `levels` levels."""
        return self._tree_size(probs, levels, limit, MODEL_TREES)

    def _tree_size(self, probs: list[float], levels: int, limit: int, label: str) -> int:
        if self.costs is None:
            return min(limit, len(probs))
        return best_node_count(self.costs, self._reach(probs, label), levels * (self.level_seconds.value or 0.0), limit)

    def another_level(self, probs: list[float], nodes: int, frontier: list[float], levels: int, limit: int) -> bool:
        """Whether one more tree level can raise the expected rate: the tree of the `nodes` best
        candidates (path probabilities `probs`, most likely first) after `levels` levels against
        one level more, which adds at most the frontier's path probabilities."""
        if self.costs is None:
            return True
        if self.level_seconds.value is None:
            return True  # not measured yet: measure by drafting
        return deeper_pays(self.costs, self._reach(probs), nodes, self._reach(frontier), levels, self.level_seconds.value, limit)

    def timed_level(self, seconds: float) -> None:
        """A tree level took `seconds` to draft."""
        self.level_seconds.add(seconds, 1)

    def _reach(self, probs: list[float], label: str = "") -> list[float]:
        """A tree's path probabilities as acceptance: scaled by how well those of its kind
        (`label`; a model's by default) predicted so far."""
        calibration = self._calibration(label).value
        return [calibration * p for p in probs]

    def _calibration(self, label: str) -> Running:
        """The tree calibration of trees labelled `label`; an unlabelled tree is a model's."""
        return self.tree_calibration[label or MODEL_TREES]

    # -- after the pass ----------------------------------------------------------------------------

    def learn(self, proposal: Proposal, accepted: list[int], seconds: float) -> int | None:
        """Learn from a verified pass that accepted `accepted` (tokens) in `seconds`; returns how
        many of the model proposer's own guesses were accepted (None: it did not draft)."""
        guess = proposal.lookup
        if guess is not None and guess.is_chain:
            right = common_prefix(guess.tokens, accepted)
            self.lookup_acceptance[guess.label].update(len(guess), right)
            self.lookup_evidence[guess.label].update(len(guess), right)
        elif guess is not None:  # a lookup's tree: its path probabilities, calibrated as a model's tree is
            self._calibration(guess.label).add(len(matched_path(guess, accepted)), sum(path_probabilities(guess)))
        own = proposal.model
        if own is None:
            return None
        path = matched_path(own, accepted)
        self.model_rate.add(len(accepted) + 1, seconds)
        if own.is_chain:  # per guess: accepted ones succeeded, the first rejected one failed, later ones were never judged
            for i, confidence in enumerate(own.confidences[: len(path) + 1]):
                self._confidence_bin(confidence).update(1, 1 if i < len(path) else 0)
        if proposal.tree and len(own):
            self.tree_calibration[MODEL_TREES].add(len(path), sum(path_probabilities(own)))
        return len(path)

    def _confidence_bin(self, confidence: float) -> Acceptance:
        """How often guesses of about this confidence are accepted (ten bins, learned as we go).

        A sibling draft is accepted more often than its own confidence says (the two models share
        their doubts), so each bin starts halfway between its confidence and certainty, and the
        measurements take over from there.
        """
        b = min(int(confidence * 10), 9)
        if b not in self.by_confidence:
            self.by_confidence[b] = Acceptance(prior=(1 + (b + 0.5) / 10) / 2)
        return self.by_confidence[b]


class SpeedGuard:
    """The kill switch: when speculative passes measure slower than plain decoding would be (the
    calibrated one-token pass), speculation pauses for a while, then is tried again.

    The policy already drafts less as acceptance falls; this catches what it cannot see, such as a
    draft model slowed by other work on the machine. It judges whole windows of fresh passes, not a
    running estimate: after a pause nothing from before it should count.
    """

    def __init__(self, costs: CostModel, window: int = 16, pause: int = 16, margin: float = 0.85) -> None:
        # plain decoding's rate is read from the same cost model the drafts are sized by, at the
        # context the passes ran at
        self.costs = costs
        # a pass also pays for the loop around the forward, which the calibration leaves out: only
        # a clear loss (below `margin` of plain decoding's rate) switches speculation off
        self.margin = margin
        self.window = window
        self.pause = pause
        self.recent: list[tuple[int, float, float]] = []  # (tokens committed, seconds, plain seconds per token) of speculative passes
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
        self.recent = [*self.recent, (tokens, seconds, self.costs.verify(1))][-self.window :]
        if len(self.recent) < self.window:
            return ""
        rate = sum(t for t, _, _ in self.recent) / sum(s for _, s, _ in self.recent)
        plain_rate = self.margin * sum(t for t, _, _ in self.recent) / sum(t * p for t, _, p in self.recent)
        if rate >= plain_rate:
            return ""
        self.recent = []
        self.paused_for = self.pause
        return (
            f"speculation paused: {rate:.1f} tok/s over the last {self.window} passes, clearly below plain "
            f"decoding; trying again in {self.pause} passes"
        )
