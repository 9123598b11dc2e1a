"""Host syncs per target pass: on a GPU every read of a device value drains the launch queue, so
a pass may read back only a handful of values, whatever its width and whatever proposes.

Counted on the CPU by wrapping every tensor-to-host conversion while generating on a tiny model:
the same code runs on a GPU, where each of these calls would be a sync.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import PROMPT_IDS, tiny_model
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.core.engine import Engine
from localspec.core.proposers import DraftModelProposer, NgramProposer
from localspec.core.proposers.eagle import EagleProposer
from localspec.runtime.costs import CostModel
from test_eagle import random_head

CONVERSIONS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "nonzero", "cpu", "numpy")
LIMIT_PER_PASS = 12
CHEAP_WIDE_PASSES = CostModel({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3, 32: 1.8}, 0.01)


@contextlib.contextmanager
def count_host_reads():
    """Counts calls of every Tensor method that hands a value to the host."""
    counts = {"n": 0}
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def counted(original):
        def wrapper(*args, **kwargs):
            counts["n"] += 1
            return original(*args, **kwargs)
        return wrapper

    for name, original in originals.items():
        setattr(torch.Tensor, name, counted(original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def proposers(target):
    yield "none", None, SpecConfig()
    yield "ngram", NgramProposer(), SpecConfig()
    yield "draft", DraftModelProposer(tiny_model("llama", seed=1)), SpecConfig(draft_len=6)
    yield "draft+lookup tree", DraftModelProposer(tiny_model("llama", seed=1)), SpecConfig()
    head = random_head(target, 3, draft_vocab=64)
    yield "eagle tree", EagleProposer(head, target, top_k=4, depth=4), SpecConfig()


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=20, seed=1)], ids=["greedy", "sampled"])
def test_a_handful_of_host_reads_per_target_pass(sampling):
    target = tiny_model("llama", seed=0, layers=8)
    prompt = PROMPT_IDS * 3  # repeats: prompt lookup guesses, and its guesses are grafted into trees
    for name, proposer, spec in proposers(target):
        engine = Engine(target, None, proposer, spec, costs=CHEAP_WIDE_PASSES)
        with count_host_reads() as counts:
            for _ in engine.generate(prompt, sampling, GenerationLimits(40)):
                pass
        stats = engine.stats
        assert stats.passes and (name == "none" or stats.drafted), name
        per_pass = counts["n"] / stats.passes
        assert per_pass <= LIMIT_PER_PASS, (name, counts["n"], stats.passes)


def test_the_counter_sees_a_read():
    with count_host_reads() as counts:
        x = torch.arange(4)
        int(x[1]), x.tolist(), bool(x.sum()), x.nonzero()
    assert counts["n"] >= 4
