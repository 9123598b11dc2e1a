"""The draft policy: the one expected-rate formula against hand-computed values, lengths and tree
sizes chosen from measured costs, the lookup-vs-model decision both ways, the running estimates."""

from __future__ import annotations

import pytest

from localspec.base.config import SpecConfig
from localspec.runtime.costs import CostModel
from localspec.core.policy import (
    Acceptance, DraftPolicy, Proposal, Running, best_draft_len, best_node_count, best_rate, chain_rate, chain_tokens,
    MODEL_TREES, deeper_pays, draft_model_pays, expected_rate, expected_tokens, predicted_speedup,
)
from localspec.core.tree import Draft

FLAT = CostModel({1: 0.30, 2: 0.28, 4: 0.24, 8: 0.26, 16: 0.31}, draft_step_seconds=0.0)
"""Verifying is nearly free up to 8 tokens (bf16 with AMX)."""
STEEP = CostModel({1: 0.25, 2: 0.28, 3: 0.29, 4: 0.51, 8: 0.97}, draft_step_seconds=0.09)
"""Every extra verified token costs (fp32 past 3 tokens) and a draft step costs a third of a pass."""


def test_expected_rate_by_hand():
    costs = CostModel({1: 1.0, 2: 1.2, 4: 1.6}, draft_step_seconds=0.1)
    # 3 guesses accepted with probability 0.5 each: 1 + 0.5 + 0.25 + 0.125 tokens, for 3 draft steps
    # and a pass of width 4 (root + 3)
    assert chain_tokens(0.5, 3) == pytest.approx(1.875)
    assert chain_rate(costs, 0.5, 3) == pytest.approx(1.875 / (0.3 + 1.6))
    assert chain_rate(costs, 0.5, 3, free=True) == pytest.approx(1.875 / 1.6)  # a lookup's guesses cost no steps
    # a tree: the reach of each node, summed, after two steps, verified at width 1 + 3
    assert expected_tokens([0.9, 0.5, 0.2]) == pytest.approx(2.6)
    assert expected_rate(costs, 2.6, 3, 0.2) == pytest.approx(2.6 / (0.2 + 1.6))
    # certainty: every guess comes through; nothing drafted: one token per pass
    assert chain_tokens(1.0, 4) == 5.0
    assert chain_rate(costs, 0.7, 0) == pytest.approx(1.0)


def test_predicted_speedup_is_the_same_formula_in_plain_passes():
    assert predicted_speedup(0.0, 0, 0.1) == 1.0
    # a = 0.8, g = 4, c = 0.1: (1 - 0.8^5) / (0.2 * 1.4)
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    flat_passes = CostModel({1: 1.0}, draft_step_seconds=0.1)
    assert predicted_speedup(0.8, 4, 0.1) == pytest.approx(chain_rate(flat_passes, 0.8, 4) / chain_rate(flat_passes, 0.8, 0))


def test_draft_length_follows_measured_costs():
    assert best_draft_len(FLAT, 0.8, 12) >= 7  # long drafts pay when acceptance is high
    assert 1 <= best_draft_len(STEEP, 0.8, 12) <= 3
    assert best_draft_len(STEEP, 0.02, 12) == 0  # drafts that are always wrong only cost time
    # a lookup riding along a draft model costs no draft steps: only the wider pass limits it
    slow_draft = CostModel(FLAT.verify_seconds, draft_step_seconds=0.5)
    assert best_draft_len(slow_draft, 0.8, 12) == 0
    assert best_draft_len(slow_draft, 0.8, 12, free=True) == best_draft_len(FLAT, 0.8, 12)
    # the best length's rate, and whether a draft model pays at all
    g = best_draft_len(STEEP, 0.8, 12)
    assert best_rate(STEEP, 0.8, 12) == pytest.approx(chain_rate(STEEP, 0.8, g))
    assert best_rate(STEEP, 0.8, 0) == pytest.approx(1 / 0.25)
    assert draft_model_pays(STEEP, 0.8, 12) and not draft_model_pays(slow_draft, 0.8, 12)
    # a draft that would only break even on its calibrated costs is not taken: generation's passes run slower
    even = next(step for step in (x / 1000 for x in range(1, 500)) if best_rate(CostModel(STEEP.verify_seconds, draft_step_seconds=step), 0.8, 12) < 1.1 / 0.25)
    assert best_draft_len(CostModel(STEEP.verify_seconds, draft_step_seconds=even), 0.8, 12) > 0
    assert not draft_model_pays(CostModel(STEEP.verify_seconds, draft_step_seconds=even), 0.8, 12)


def test_tree_size_and_depth_follow_measured_costs():
    reach = [0.9, 0.8, 0.5, 0.3, 0.1, 0.05]
    # nearly free wide passes: every node that adds reach is worth verifying
    cheap = CostModel({1: 1.0, 8: 1.01})
    assert best_node_count(cheap, reach, 0.0, limit=6) == 6
    assert best_node_count(cheap, reach, 0.0, limit=3) == 3
    # each verified node costs 40% of a pass: only the likely ones (each node must add more than
    # the rate, tokens per pass-time, it would dilute)
    dear = CostModel({1: 1.0, 2: 1.4, 3: 1.8, 4: 2.2, 5: 2.6, 6: 3.0, 7: 3.4})
    rates = [expected_rate(dear, expected_tokens(reach[:n]), n, 0.0) for n in range(7)]
    assert best_node_count(dear, reach, 0.0, limit=6) == rates.index(max(rates)) == 2
    # a level that can add half a token pays for a cheap step, not for a dear one
    assert deeper_pays(cheap, reach, 6, [0.3, 0.2], depth=2, step_seconds=0.01, limit=16)
    assert not deeper_pays(cheap, reach, 6, [0.3, 0.2], depth=2, step_seconds=2.0, limit=16)


def test_acceptance_moves_towards_recent_passes_and_rests_towards_its_prior():
    tracker = Acceptance(prior=0.5)
    for _ in range(30):
        tracker.update(drafted=4, accepted=4)
    assert tracker.rate > 0.95
    for _ in range(30):
        tracker.update(drafted=4, accepted=0)
    assert tracker.rate < 0.2
    tracker.update(drafted=0, accepted=0)  # an empty draft says nothing about acceptance...
    assert tracker.rate < 0.2
    for _ in range(60):
        tracker.update(drafted=0, accepted=0)  # ...but a long silence lets the prior back in
    assert tracker.rate == pytest.approx(0.5, abs=0.01)
    # k of g accepted: k successes and one failure
    one = Acceptance(prior=0.0)
    one.update(drafted=4, accepted=2)
    assert one.rate == pytest.approx(2 / (0.9 * 3 + 3))


def test_a_running_ratio_without_prior_starts_at_the_first_measurement():
    rate = Running()
    assert rate.value is None
    rate.add(3, 0.5)  # 3 tokens in half a second
    assert rate.value == pytest.approx(6.0)
    rate.add(1, 0.5)
    assert rate.value == pytest.approx((0.9 * 3 + 1) / (0.9 * 0.5 + 0.5))


def lookup_guess(n: int) -> Draft:
    return Draft.chain(list(range(10, 10 + n)), label="ngram-3")


def test_lookup_alone_beats_the_model_only_on_evidence_and_measured_rates():
    policy = DraftPolicy(SpecConfig(), CostModel({1: 0.1, 8: 0.12}, draft_step_seconds=0.01))
    guess = lookup_guess(4)
    assert not policy.lookup_alone_pays(guess)  # the model's rate is not measured yet
    # the model drafted a pass: 4 tokens in 0.2 s, twice what a plain pass of 0.1 s makes
    model = Draft.chain([1, 2, 3], confidences=[0.9, 0.9, 0.9])
    policy.learn(Proposal(model, model=model), [1, 2, 3], 0.2)
    assert policy.model_rate.value == pytest.approx(20.0)
    assert not policy.lookup_alone_pays(guess)  # the lookup's label was never seen right
    for _ in range(5):  # the grafted branch gathers evidence: the lookup's guesses come through
        policy.learn(Proposal(guess, model=Draft.chain([]), lookup=guess), guess.tokens, 1.0)
    assert policy.lookup_alone_pays(guess)
    # a model measured far faster than a lookup pass can be: the model drafts
    for _ in range(50):
        policy.learn(Proposal(Draft.chain([1]), model=Draft.chain([1], confidences=[0.9])), [1], 1e-3)
    assert not policy.lookup_alone_pays(guess)


def test_lookup_length_fixed_measured_or_default():
    costs = CostModel({1: 0.1, 2: 0.11, 4: 0.13, 8: 0.17, 16: 0.25})  # each verified token costs a tenth of a pass
    assert DraftPolicy(SpecConfig(draft_len=3), costs).lookup_len("ngram-1", 10) == 3
    assert DraftPolicy(SpecConfig(draft_len=3), costs).lookup_len("ngram-1", 2) == 2  # what the lookup found
    assert DraftPolicy(SpecConfig(), None).lookup_len("ngram-1", 10) == 4
    policy = DraftPolicy(SpecConfig(max_draft_len=8), costs)
    assert policy.lookup_len("ngram-3", 10) == best_draft_len(costs, 0.6, 8, free=True) > 0
    for _ in range(30):  # a label that is always wrong is not worth a wider pass
        policy.learn(Proposal(lookup_guess(4), lookup=lookup_guess(4)), [99], 0.1)
    assert policy.lookup_len("ngram-3", 10) == 0


def test_a_chain_model_stops_where_the_next_guess_does_not_pay():
    # a draft step costs 30% of a pass and each verified token another 30%
    costs = CostModel({1: 1.0, 2: 1.3, 4: 1.9}, draft_step_seconds=0.3)
    policy = DraftPolicy(SpecConfig(), costs)
    assert policy.another_guess([0.95]) and policy.another_guess([0.95, 0.95])  # confident guesses pay
    assert not policy.another_guess([0.95, 0.01])  # an unsure one does not
    # bins learn: a confident bin whose guesses are always rejected stops being drafted
    for _ in range(30):
        policy.learn(Proposal(Draft.chain([1]), model=Draft.chain([1], confidences=[0.95])), [], 1.0)
    assert not policy.another_guess([0.95])
    assert DraftPolicy(SpecConfig(draft_len=3), costs).another_guess([0.95, 0.01])  # a fixed length drafts it all
    assert DraftPolicy(SpecConfig(), None).another_guess([0.95, 0.01])


def test_a_tree_is_sized_by_the_policy_from_its_measured_levels_and_calibration():
    costs = CostModel({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3}, 0.0)
    policy = DraftPolicy(SpecConfig(), costs)
    probs = [0.9, 0.6, 0.3, 0.2, 0.1, 0.05]
    assert policy.tree_nodes(probs, 2, 16) == best_node_count(costs, probs, 0.0, 16)
    assert policy.another_level(probs, 6, [0.3, 0.2], 2, 16)  # a level never timed: draft it, and time it
    policy.timed_level(2.0)
    assert policy.tree_nodes(probs, 2, 16) == best_node_count(costs, probs, 4.0, 16)
    assert not policy.another_level(probs, 6, [0.3, 0.2], 2, 16)  # two seconds a level: no deeper
    assert not deeper_pays(costs, probs, 6, [0.3, 0.2], 2, 2.0, 16)
    # a head whose trees are never accepted: its path probabilities count for less, so trees shrink
    tree = Draft([1, 2, 3], [-1, 0, -1], confidences=[0.9, 0.5, 0.6])
    for _ in range(20):
        policy.learn(Proposal(tree, model=tree, tree=True), [], 1.0)
    assert policy.tree_calibration[MODEL_TREES].value < 0.1
    assert policy.tree_nodes(probs, 1, 16) < best_node_count(costs, probs, 2.0, 16)
    assert DraftPolicy(SpecConfig(), None).tree_nodes(probs, 3, 4) == 4  # unmeasured: every node that fits


def test_learn_credits_each_part_of_a_proposal():
    policy = DraftPolicy(SpecConfig(), CostModel({1: 0.1}))
    own = Draft.chain([1, 2, 3], confidences=[0.9, 0.9, 0.9])
    lookup = Draft.chain([1, 2, 7], label="ngram-2")
    assert policy.learn(Proposal(own, model=own, lookup=lookup), [1, 2, 3], 1.0) == 3
    # the lookup: 2 right, then 1 wrong; its evidence starts from nothing
    assert policy.lookup_acceptance["ngram-2"].rate == pytest.approx((0.9 * 0.6 * 3 + 2) / (0.9 * 3 + 3))
    assert policy.lookup_evidence["ngram-2"].rate == pytest.approx(2 / (0.9 * 3 + 3))
    assert policy.by_confidence[9].rate > 0.975  # the model's three guesses, each right
    assert policy.model_rate.value == pytest.approx(4.0)
    assert policy.learn(Proposal(lookup, lookup=lookup), [1, 2], 1.0) is None  # no model part


def test_each_lookup_label_learns_its_own_tree_calibration():
    """Suffix decoding's trees from a one-token match are rarely right, those from a long match
    often: a label that keeps missing stops being verified, the others are sized as before."""
    costs = CostModel({1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4}, 0.0)
    policy = DraftPolicy(SpecConfig(), costs)
    short = Draft([1, 2, 3], [-1, 0, 1], label="prompt-1", confidences=[1.0, 1.0, 1.0])
    long = Draft([1, 2, 3], [-1, 0, 1], label="prompt-8", confidences=[1.0, 1.0, 1.0])
    assert policy.lookup_size(short, 8) == policy.lookup_size(long, 8) > 0
    for _ in range(20):
        policy.learn(Proposal(short, lookup=short), [], 1.0)  # never right
        policy.learn(Proposal(long, lookup=long), [1, 2, 3], 1.0)  # always right
    assert policy.lookup_size(short, 8) == 0 and policy.lookup_size(long, 8) == 3
    assert policy.tree_calibration[MODEL_TREES].value == 1.0, "a model's trees keep their own"
