"""bitsandbytes' nf4 the way CUDA users load it, run on the CPU (bitsandbytes ships a CPU library:
slow, never a speed path here, but the same load path and layers as on a GPU).

A model too big for 16-bit weights must never be on the device in 16 bits, so the layers are
quantized on the way in; and speculation over an nf4 target must give that same nf4 target's own
greedy output, for every proposer.
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")

from conftest import PROMPT_IDS, hf_greedy, tiny_model  # noqa: E402
from localspec.base.config import GenerationLimits, SpecConfig  # noqa: E402
from localspec.core.engine import Engine  # noqa: E402
from localspec.core.proposers import DraftModelProposer, NgramProposer  # noqa: E402
from localspec.core.proposers.eagle import EagleProposer  # noqa: E402
from localspec.runtime.costs import CostModel  # noqa: E402
from localspec.store.loading import place  # noqa: E402
from test_eagle import random_head  # noqa: E402

CPU = torch.device("cpu")


def nf4_model(seed: int = 0, layers: int = 2):
    model = tiny_model("llama", seed=seed, layers=layers, hidden=64).to(torch.bfloat16)  # nf4 computes in bf16
    place(model, "nf4", CPU)
    return model


def is_bnb(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("bitsandbytes")


def test_layers_are_quantized_before_the_model_moves(monkeypatch):
    model = tiny_model("llama", hidden=64).to(torch.bfloat16)
    moved_with = []
    real_to = torch.nn.Module.to

    def spy(self, *args, **kwargs):
        if self is model:  # the whole-model move: by now every linear must be 4-bit already
            moved_with.append([type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear) and not is_bnb(m)])
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", spy)
    place(model, "nf4", CPU)
    assert moved_with == [[]]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, bnb.nn.Linear4bit) and m.weight.bnb_quantized for m in linears)
    assert all(m.weight.dtype == torch.uint8 for m in linears)  # packed 4-bit, not 16-bit weights


def test_speculation_over_an_nf4_target_is_its_own_greedy_output():
    target = nf4_model(layers=6)  # EAGLE-3 reads three of its layers
    prompt = PROMPT_IDS * 2
    expected = hf_greedy(target, prompt, 32)
    costs = CostModel({1: 1.0, 2: 1.02, 4: 1.05, 8: 1.1, 16: 1.3, 32: 1.8}, 0.01)
    proposers = {
        "none": (None, SpecConfig()),
        "ngram": (NgramProposer(), SpecConfig()),
        "draft (nf4)": (DraftModelProposer(nf4_model(seed=1)), SpecConfig(draft_len=4)),
        "eagle": (EagleProposer(random_head(target, 3, draft_vocab=64), target, top_k=4, depth=3), SpecConfig()),
    }
    for name, (proposer, spec) in proposers.items():
        engine = Engine(target, None, proposer, spec, costs=costs)
        got = [p.token_id for ev in engine.generate(prompt, limits=GenerationLimits(32)) for p in ev.pieces]
        assert got == expected, name
        assert name == "none" or engine.stats.drafted, name
        if proposer is not None:
            proposer.close()
