"""bench --perplexity (apps/perplexity): llama-perplexity's chunking and scoring, the comparison
with the float32 model, and reading llama-perplexity's own figure."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from conftest import tiny_model
from localspec.apps import perplexity
from localspec.base.errors import LocalspecError


class WordTokenizer:
    """One id per character, and a BOS the model adds (as llama-perplexity would put in front)."""

    bos_token_id = 1
    add_bos_token = True

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2 + ord(c) % 90 for c in text]}


def test_chunks_are_whole_context_windows_with_bos_first_and_too_short_a_text_is_refused():
    chunks = perplexity.chunk_tokens(WordTokenizer(), "x" * 50, context=16, chunks=8)
    assert len(chunks) == 3 and all(len(c) == 16 and c[0] == 1 for c in chunks)
    assert len(perplexity.chunk_tokens(WordTokenizer(), "x" * 50, context=16, chunks=2)) == 2
    with pytest.raises(LocalspecError, match="at least one chunk of 16"):
        perplexity.chunk_tokens(WordTokenizer(), "x" * 10, context=16, chunks=2)


def test_only_the_second_half_of_each_chunk_is_scored_from_the_logits_before_each_token():
    model = tiny_model("llama")
    chunks = [[1, 5, 9, 3, 7, 2, 8, 4], [1, 6, 6, 6, 2, 2, 9, 10]]
    scored = perplexity.score(model, chunks)
    nll = []
    for chunk in chunks:
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), -1)
        nll += [-lp[j, chunk[j + 1]].item() for j in range(4, 7)]  # tokens 5..7 of 8
    assert scored.nll.shape == (6,)
    assert torch.allclose(scored.nll, torch.tensor(nll, dtype=torch.float64), atol=1e-5)
    assert math.isclose(scored.perplexity, math.exp(sum(nll) / 6), rel_tol=1e-5)
    same = perplexity.compare(scored, scored)
    assert same["mean_kl_vs_float32"] == pytest.approx(0.0, abs=1e-7) and same["top1_agreement_vs_float32"] == 1.0


def test_llama_perplexitys_final_estimate_is_read_and_a_missing_tool_is_one_line(tmp_path):
    tool = tmp_path / "llama-perplexity"
    tool.write_text(f"#!{sys.executable}\nimport sys\nprint('[1]2.0,[2]1.9', file=sys.stderr)\n"
                    "print('Final estimate: PPL = 1.7782 +/- 0.03', file=sys.stderr)\n")
    tool.chmod(0o755)
    got = perplexity.llama_perplexity(str(tmp_path), Path("m.gguf"), Path("t.txt"), 512, 4, 2)
    assert got["perplexity"] == 1.7782
    with pytest.raises(LocalspecError, match="no llama-perplexity there"):
        perplexity.llama_perplexity(str(tmp_path / "nowhere"), Path("m.gguf"), Path("t.txt"), 512, 4, 2)
