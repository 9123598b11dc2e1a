"""The real SmolLM2-135M (offline mirror): every proposer reproduces transformers' greedy output."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from localspec.base.config import GenerationLimits, SpecConfig
from localspec.core.engine import Engine
from localspec.core.proposers import DraftModelProposer, NgramProposer
from localspec.store.loading import load_model
from localspec.store.registry import load_registry

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Repeat this list exactly, then add one more fruit: apple, banana, cherry, date, elderberry, fig.",
]


@pytest.fixture(scope="module")
def smollm2():
    return load_model(load_registry().get("smollm2-135m"), torch.float32, progress=False)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_every_proposer_matches_transformers_greedy(smollm2, prompt):
    model, tokenizer = smollm2.model, smollm2.tokenizer
    plain = Engine(model, tokenizer, None)
    ids = plain.encode(prompt)
    x = torch.tensor([ids])
    expected = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=64)[0, len(ids):]
    expected = [t for t in expected.tolist() if t not in plain.eos]
    proposers = [None, NgramProposer(), DraftModelProposer(model)]
    for proposer, draft_len in [(p, n) for p in proposers for n in (2, 5)]:
        engine = Engine(model, tokenizer, proposer, SpecConfig(draft_len=draft_len))
        out = [p.token_id for ev in engine.generate(prompt, limits=GenerationLimits(64)) for p in ev.pieces]
        assert out == expected[: len(out)] and len(out) == len(expected), (proposer, draft_len)


def test_cli_json_run_on_the_tiny_real_model():
    proc = subprocess.run(
        [sys.executable, "-m", "localspec", "run", "List three colours.", "--model", "smollm2-135m",
         "--proposer", "ngram", "--dtype", "float32", "--max-new-tokens", "24", "--json"],
        capture_output=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(proc.stdout)
    assert result["text"].strip()
    assert result["stats"]["new_tokens"] >= 1 and result["settings"]["proposer"] == "ngram"
    assert result["stats"]["passes"] >= 1
