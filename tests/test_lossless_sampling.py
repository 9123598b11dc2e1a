"""Sampling with speculation must be distributed exactly as the target alone (T > 0).

Chi-square tests against the exact target distribution, computed from the target's own logits.
The same tests with a deliberately wrong rejection rule must fail, so they have the power to
notice a real bug.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from conftest import tiny_model
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.core.engine import Engine
from localspec.core.proposers import DraftModelProposer
from localspec.core.sampling import make_generator, probs_from_logits
from localspec.core.tree import Draft
from localspec.core.verify import verify_sampling
from localspec.kernels import rejection_rule

VOCAB = 6
PROMPT = [1, 2, 3, 4]


def chi2_limit(df: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square with df degrees of freedom (Wilson-Hilferty; z=3.29 ~ p 0.9995)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: dict, expected: dict, n: int) -> tuple[float, int]:
    stat, cells = 0.0, 0
    for key, p in expected.items():
        e = n * p
        if e >= 5:
            stat += (counts.get(key, 0) - e) ** 2 / e
            cells += 1
    return stat, cells - 1


def exact_pairs(target, sampling: SamplingConfig, prompt: list[int] = PROMPT) -> dict:
    """P(first two generated tokens) under the target alone."""
    with torch.no_grad():
        p1 = probs_from_logits(target(torch.tensor([prompt])).logits[0, -1], sampling)
        out = {}
        for a in range(VOCAB):
            p2 = probs_from_logits(target(torch.tensor([prompt + [a]])).logits[0, -1], sampling)
            for b in range(VOCAB):
                out[(a, b)] = float(p1[a] * p2[b])
    return out


def sample_pairs(target, draft, sampling_kw: dict, n: int, prompt: list[int] = PROMPT, spec: SpecConfig = SpecConfig(draft_len=2)) -> tuple[dict, int]:
    """Counts of the first two generated tokens over n seeds, and the tokens prompt lookup supplied."""
    engine = Engine(target, None, DraftModelProposer(draft), spec)
    counts: dict = {}
    from_lookup = 0
    for seed in range(n):
        sampling = SamplingConfig(seed=seed, **sampling_kw)
        out = [p.token_id for ev in engine.generate(prompt, sampling, GenerationLimits(2)) for p in ev.pieces]
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        from_lookup += engine.stats.lookup_accepted
    return counts, from_lookup


def models():
    target = tiny_model("llama", seed=3, vocab=VOCAB, layers=1, hidden=16)
    draft = tiny_model("llama", seed=4, vocab=VOCAB, layers=1, hidden=16)
    with torch.no_grad():  # a soft target and a peaked draft that disagrees with it often
        target.lm_head.weight.mul_(0.3)
        draft.lm_head.weight.mul_(2.0)
    return target, draft


@pytest.mark.parametrize("sampling_kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_speculative_sampling_matches_target_distribution(sampling_kw):
    target, draft = models()
    n = 1000
    counts, _ = sample_pairs(target, draft, sampling_kw, n)
    stat, df = chi2(counts, exact_pairs(target, SamplingConfig(**sampling_kw)), n)
    assert stat < chi2_limit(df), (stat, df)


def test_a_sampled_draft_with_a_lookup_branch_keeps_target_distribution():
    """The draft's sampled chain (its own q) and prompt lookup's fixed guess (one-hot q) are
    siblings in one tree; the rule must stay exact across the mix."""
    target, draft = models()
    prompt = [1, 2, 3, 4, 5, 1, 2, 3, 4]  # lookup guesses 5, 1 at the first pass
    n = 1000
    counts, from_lookup = sample_pairs(target, draft, dict(temperature=1.0), n, prompt, SpecConfig(draft_len=2))
    assert from_lookup > n / 20, "the test must exercise the lookup branch"
    stat, df = chi2(counts, exact_pairs(target, SamplingConfig(temperature=1.0), prompt), n)
    assert stat < chi2_limit(df), (stat, df)


def test_wrong_rejection_rule_is_detected(monkeypatch):
    # a classic bug: after a rejection, sample from p instead of the residual max(0, p - q)
    monkeypatch.setattr(rejection_rule, "residual", lambda p, q, token: p)
    target, draft = models()
    n = 1000
    counts, _ = sample_pairs(target, draft, dict(temperature=1.0), n)
    stat, df = chi2(counts, exact_pairs(target, SamplingConfig(temperature=1.0)), n)
    assert stat > chi2_limit(df), (stat, df)


def _tree_counts(p: torch.Tensor, draft: Draft, n: int) -> dict:
    logits = p.log().expand(len(draft) + 1, -1)  # the same target distribution at every node
    gen = make_generator(0)
    counts: dict = {}
    for _ in range(n):
        verdict = verify_sampling(draft, logits, SamplingConfig(temperature=1.0), gen)
        first = draft.tokens[verdict.accepted[0]] if verdict.accepted else verdict.next_token
        counts[first] = counts.get(first, 0) + 1
    return counts


def test_tree_multi_candidate_rule_keeps_target_distribution():
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    # three deterministic guesses at the first position (one-hot q), one of them with a child
    draft = Draft([1, 3, 0, 2], [-1, -1, -1, 0])
    n = 20000
    counts = _tree_counts(p, draft, n)
    stat, df = chi2(counts, {i: float(p[i]) for i in range(5)}, n)
    assert stat < chi2_limit(df), (stat, df)


def test_tree_rule_without_renormalising_is_detected(monkeypatch):
    monkeypatch.setattr(rejection_rule, "residual", lambda p, q, token: p)
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    draft = Draft([1, 3, 0, 2], [-1, -1, -1, 0])
    n = 20000
    counts = _tree_counts(p, draft, n)
    stat, df = chi2(counts, {i: float(p[i]) for i in range(5)}, n)
    assert stat > chi2_limit(df), (stat, df)
