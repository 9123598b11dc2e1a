"""The lean decode/verify pass against transformers' forward (its reference), bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from localspec.runtime.attention import RowPlan, use_exact_attention
from localspec.runtime.decoder import lean_forward, unsupported_reason, use_lean_forward
from localspec.runtime.kv import KVCache
from localspec.core.tree import Draft, verify_inputs, visible_rows


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


def test_installed_forward_routes_generation_passes_and_leaves_the_rest(arch, monkeypatch):
    model = tiny_model(arch)
    use_exact_attention(model)
    assert use_lean_forward(model) and use_lean_forward(model)  # idempotent
    calls = []
    import localspec.runtime.decoder as decoder

    real = decoder.lean_forward
    monkeypatch.setattr(decoder, "lean_forward", lambda *a, **k: calls.append(k["input_ids"].shape) or real(*a, **k))
    kv, tokens = prefilled(model)  # 20 tokens: a short pass, lean
    assert calls == [(1, 20)]
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([[4]]), cache=kv.cache, use_cache=True, logits_to_keep=1)
        assert out.logits.shape == (1, 1, model.config.vocab_size)
        model(input_ids=torch.tensor([[4]]), cache=kv.cache, use_cache=True, output_hidden_states=True)
        model(input_ids=torch.tensor([[i % 90 for i in range(130)]]), use_cache=False)  # no cache: transformers
        model.generate(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 3, dtype=torch.long), max_new_tokens=2,
                       do_sample=False)
    assert calls == [(1, 20), (1, 1)]


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


def test_unsupported_models_keep_transformers_forward():
    model = tiny_model("qwen2")
    model.config.layer_types = ["sliding_attention", "full_attention"]
    assert "sliding" in unsupported_reason(model)
    use_exact_attention(model)
    assert not use_lean_forward(model)
    windowed = tiny_model("llama")
    windowed.config.sliding_window = 16  # a Mistral-style window, no layer_types to say otherwise
    assert "sliding" in unsupported_reason(windowed)
    plain = tiny_model("llama")  # not on the row-exact attention: the lean pass would not match it
    assert unsupported_reason(plain) is None and not use_lean_forward(plain)
