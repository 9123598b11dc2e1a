"""The lean decode/verify pass against transformers' forward (its reference), bit for bit, and which
of the two a `TargetPass` runs."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_model

from localspec.core.tree import Draft, verify_inputs, visible_rows
from localspec.runtime import target_pass
from localspec.runtime.attention import NAME as EXACT_ATTENTION, ROW_BY_ROW_UP_TO, RowPlan, use_exact_attention
from localspec.runtime.decoder import lean_forward, unsupported_reason
from localspec.runtime.kv import KVCache
from localspec.runtime.target_pass import TargetPass


def prefilled(model, n: int = 20) -> tuple[KVCache, list[int]]:
    kv = KVCache()
    tokens = [(7 * i + 3) % 90 for i in range(n)]
    model(input_ids=torch.tensor([tokens]), cache=kv.cache, use_cache=True)
    return kv, tokens


def both_passes(model, kv: KVCache, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The same pass through transformers and the lean function, the cache put back in between."""
    length = len(kv)
    expected = type(model).forward(model, cache=kv.cache, use_cache=True, **kwargs).logits  # transformers' own
    cached_keys = [layer.keys.clone() for layer in kv.cache.layers]
    kv.truncate(length)
    got = lean_forward(model, cache=kv.cache, **kwargs)
    for layer, keys in zip(kv.cache.layers, cached_keys):
        assert torch.equal(layer.keys, keys)  # the lean pass wrote the same cache entries
    kv.truncate(length)
    return expected, got


@pytest.mark.parametrize("width", [1, 2, 5, 16])
def test_chain_pass_matches_transformers_bit_for_bit(arch, width):
    model = tiny_model(arch)
    use_exact_attention(model)
    kv, tokens = prefilled(model)
    ids = torch.tensor([[(5 * i + 1) % 90 for i in range(width)]])
    positions = torch.arange(len(tokens), len(tokens) + width)[None]
    with torch.inference_mode():
        expected, got = both_passes(model, kv, input_ids=ids, position_ids=positions, logits_to_keep=width)
    assert got.shape == expected.shape == (1, width, model.config.vocab_size)
    assert torch.equal(got, expected)


def test_tree_pass_matches_transformers_with_mask_or_plan(arch):
    model = tiny_model(arch)
    use_exact_attention(model)
    kv, tokens = prefilled(model)
    draft = Draft(tokens=[11, 12, 13, 21, 22], parents=[-1, 0, 1, -1, 3])
    ids, positions, mask = verify_inputs(draft, 9, len(tokens))
    plan = RowPlan.from_rows(len(tokens), visible_rows(draft), torch.device("cpu"))
    with torch.inference_mode():
        expected, from_mask = both_passes(model, kv, input_ids=ids, position_ids=positions, attention_mask=mask)
        _, from_plan = both_passes(model, kv, input_ids=ids, position_ids=positions, attention_mask=mask, row_plan=plan)
    assert torch.equal(from_mask, expected)
    assert torch.equal(from_plan, expected)


def test_the_target_pass_takes_the_lean_pass_for_short_passes_and_transformers_for_the_rest(arch, monkeypatch):
    model = tiny_model(arch)
    target = TargetPass(model)
    assert model.config._attn_implementation == EXACT_ATTENTION and target.lean and target.name == EXACT_ATTENTION + "+lean"
    assert model.forward.__func__ is type(model).forward  # the model's own forward is left as it is
    calls = []
    real = target_pass.lean_forward
    monkeypatch.setattr(target_pass, "lean_forward", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    kv = KVCache()
    with torch.inference_mode():
        target(kv, torch.tensor([list(range(20))]), torch.arange(20)[None], logit_rows=1)  # a short prompt: lean
        logits = target(kv, torch.tensor([[4]]), torch.tensor([[20]]), logit_rows=1)
        assert logits.shape == (1, model.config.vocab_size)
        long = torch.tensor([[i % 90 for i in range(ROW_BY_ROW_UP_TO + 2)]])
        target(kv, long, torch.arange(21, 21 + long.shape[1])[None], logit_rows=1)  # a long prompt chunk: transformers
    assert calls == [(1, 20), (1, 1)] and len(kv) == 21 + long.shape[1]


def test_norm_hooks_fire_as_in_transformers(arch):
    """EAGLE's feature taps hook the norms; the lean pass runs them as modules."""
    model = tiny_model(arch)
    use_exact_attention(model)
    seen = {"layer1": [], "final": []}
    model.model.layers[1].input_layernorm.register_forward_pre_hook(lambda m, args: seen["layer1"].append(args[0]))
    model.model.norm.register_forward_hook(lambda m, args, out: seen["final"].append(out))
    kv, tokens = prefilled(model)
    ids = torch.tensor([[3, 4, 5]])
    with torch.inference_mode():
        both_passes(model, kv, input_ids=ids, position_ids=torch.arange(20, 23)[None])
    for captured in seen.values():
        reference, lean = captured[-2:]
        assert torch.equal(reference, lean)


def test_unsupported_models_keep_transformers_forward(monkeypatch):
    model = tiny_model("qwen2")
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert "sliding" in unsupported_reason(model)
    windowed = tiny_model("llama")
    windowed.config.sliding_window = 16  # a Mistral-style window, no layer_types to say otherwise
    assert "sliding" in unsupported_reason(windowed)
    assert not TargetPass(model).lean
    monkeypatch.setattr(target_pass, "lean_forward", lambda *a, **k: pytest.fail("the lean pass ran"))
    target = TargetPass(windowed)
    assert not target.lean and target.name == EXACT_ATTENTION
    with torch.inference_mode():
        assert target(KVCache(), torch.tensor([[1, 2, 3]]), torch.arange(3)[None], logit_rows=1).shape == (1, VOCAB)
