"""Greedy output of every proposer against a reference that shares nothing with localspec.

`conftest.hf_greedy` runs transformers' `generate` on the model as the engine runs it (row-exact
attention, localspec's cache, its prompt pass), so a bug in those parts would sit on both sides
of the other exactness tests. Here the reference is stock transformers on a copy of the model
built on its own (same seed, so the same weights), in float32 with eager and with SDPA attention
and nothing of localspec installed on it. Floating-point sums in another order may differ in the
last place, so the test also asserts that every greedy choice of the reference wins by a margin
far beyond that rounding: a token-for-token match is then a real check, never a coin flip.
"""

from __future__ import annotations

import pytest
import torch

from conftest import PROMPT_IDS, tiny_model
from localspec.base.config import GenerationLimits, SpecConfig
from localspec.core.engine import Engine
from localspec.core.proposers import DraftModelProposer, NgramProposer
from localspec.core.proposers.eagle import EagleProposer
from localspec.runtime.attention import use_exact_attention
from test_eagle import CHEAP_WIDE_PASSES, random_head

NEW_TOKENS = 40
LAYERS, HIDDEN = 8, 48  # the EAGLE tests' target: deep enough for EAGLE-3's three feature layers
CLEAR_MARGIN = 1e-4
"""A greedy choice must beat the runner-up by this fraction of the largest logit, and the two sides'
logits may differ by a tenth of it (asserted below), so rounding cannot flip a choice. Measured: the
sides differ by ~1e-6 on logits of ~4, and the smallest margin here is ~1e-3."""


def stock_model(arch: str, attention: str) -> torch.nn.Module:
    model = tiny_model(arch, layers=LAYERS, hidden=HIDDEN)
    model.set_attn_implementation(attention)
    return model


def stock_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy `generate` with its own cache and masks: nothing passed in but the ids."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def next_token_logits(model: torch.nn.Module, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """(len(continuation), V): one pass over prompt + continuation without a cache, the logits
    that chose each continuation token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation])).logits[0]  # (P + N, V)
    return logits[len(prompt) - 1 : -1]


def untouched(model: torch.nn.Module, attention: str) -> bool:
    """Nothing of localspec on the model: its own attention, forward and modules."""
    return (model.config._attn_implementation == attention and "forward" not in vars(model)
            and all(type(m).__module__.startswith(("transformers", "torch")) for m in model.modules()))


def proposers(target: torch.nn.Module, arch: str) -> dict:
    """Every kind the engine runs: none (plain decoding), prompt lookup, a draft model (the target
    itself, accepted in long chains, and another model, rejected often) and EAGLE heads (trees of
    EAGLE-1 and EAGLE-3 with a smaller draft vocabulary)."""
    return {
        "none": None,
        "ngram": NgramProposer(),
        "self draft": DraftModelProposer(target),
        "other draft": DraftModelProposer(tiny_model(arch, seed=1)),
        "eagle-1 tree": EagleProposer(random_head(target, 1), target, top_k=4, nodes=10, depth=3),
        "eagle-3": EagleProposer(random_head(target, 3, draft_vocab=64), target),
    }


def test_every_proposer_reproduces_stock_transformers_greedy_token_for_token(arch):
    eager, sdpa = stock_model(arch, "eager"), stock_model(arch, "sdpa")
    expected = stock_greedy(eager, PROMPT_IDS, NEW_TOKENS)
    assert stock_greedy(sdpa, PROMPT_IDS, NEW_TOKENS) == expected, "the two stock attentions agree"

    logits = next_token_logits(eager, PROMPT_IDS, expected)  # (N, V)
    assert logits.argmax(dim=-1).tolist() == expected, "generate's cache path chose what one full pass chooses"
    best, runner_up = logits.topk(2, dim=-1).values.unbind(dim=-1)  # (N,) each
    assert ((best - runner_up) > CLEAR_MARGIN * logits.abs().max()).all(), "a near-tie: choose another prompt or seed"

    target = tiny_model(arch, layers=LAYERS, hidden=HIDDEN)  # the engine's own copy, same weights
    assert all(torch.equal(a, b) for a, b in zip(target.state_dict().values(), eager.state_dict().values()))
    use_exact_attention(target)
    disagreement = (next_token_logits(target, PROMPT_IDS, expected) - logits).abs().max()
    assert disagreement <= 1e-5 * logits.abs().max(), "localspec's attention computes the same logits to rounding"

    for name, proposer in proposers(target, arch).items():
        engine = Engine(target, None, proposer, SpecConfig(), costs=CHEAP_WIDE_PASSES)
        got = [p.token_id for ev in engine.generate(PROMPT_IDS, limits=GenerationLimits(NEW_TOKENS)) for p in ev.pieces]
        assert got == expected, name
        if proposer is not None:
            assert engine.stats.accepted > 0, f"{name}: its guesses went through verification"
            if isinstance(proposer, EagleProposer):
                proposer.close()
    assert untouched(eager, "eager") and untouched(sdpa, "sdpa"), "the reference stayed stock throughout"
