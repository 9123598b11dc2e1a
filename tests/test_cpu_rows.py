"""The row kernel (kernels/cpu_rows): RMSNorm against transformers' formula, rotary bit for bit
against each model module's own apply_rotary_pos_emb, and norms swapped in as modules."""

from __future__ import annotations

import importlib

import pytest
import torch

from conftest import tiny_model
from localspec.kernels import cpu_rows
from localspec.runtime.decoder import PLAIN_ROTARY, _rows

KERNEL = _rows()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the row kernel cannot be built here")


@needs_kernel
@pytest.mark.parametrize("dim", [7, 64, 1536])
def test_rms_norm_is_the_reference_within_rounding_and_a_row_alone_is_the_row_among_many(dim):
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(1, 9, dim, generator=gen) * 3
    x[0, 4] = 0.0  # eps keeps it finite: zeros out
    weight = torch.randn(dim, generator=gen)
    got = KERNEL.rms_norm(x, weight, 1e-6)
    expected = cpu_rows.rms_norm_reference(x, weight, 1e-6)
    assert ((got - expected).abs() <= 1e-5 * expected.abs().amax(-1, keepdim=True) + 1e-7).all()
    assert torch.equal(got[0, 4], torch.zeros(dim))
    for row in range(9):  # a one-token pass computes what a verify pass computes for that row
        assert torch.equal(KERNEL.rms_norm(x[:, row : row + 1].contiguous(), weight, 1e-6)[0, 0], got[0, row])


def heads_of(out: torch.Tensor, start: int, heads: int, d: int) -> torch.Tensor:
    """Columns [start, start + heads * d) of a projection's output (1, T, N) as (1, H, T, D), the
    view the decoder rotates (its rows are N apart, as in a call shared by q, k and v)."""
    t = out.shape[1]
    return out[..., start : start + heads * d].view(1, t, heads, d).transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("module_name", PLAIN_ROTARY)
@pytest.mark.parametrize("t, d", [(1, 64), (3, 128), (16, 128)])
def test_rotary_gives_the_bits_of_each_models_own_function(module_name, t, d):
    apply_rotary_pos_emb = importlib.import_module(module_name).apply_rotary_pos_emb
    gen = torch.Generator().manual_seed(t * d)
    out = torch.randn(1, t, (12 + 2 + 2) * d, generator=gen) * 4  # q, k and v of one shared call
    query, key = heads_of(out, 0, 12, d), heads_of(out, 12 * d, 2, d)
    cos, sin = torch.randn(1, t, d, generator=gen), torch.randn(1, t, d, generator=gen)
    expected_query, expected_key = apply_rotary_pos_emb(query.clone(), key.clone(), cos, sin)
    values = out[..., 14 * d :].clone()
    assert cpu_rows.takes_rotary(query, cos) and cpu_rows.takes_rotary(key, cos)
    KERNEL.rotary_(query, cos, sin)
    KERNEL.rotary_(key, cos, sin)
    assert torch.equal(query, expected_query) and torch.equal(key, expected_key)
    assert torch.equal(out[..., 14 * d :], values), "the values' columns of the shared output are untouched"


@needs_kernel
def test_the_rotary_reference_is_transformers_own():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x, other = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
    cos, sin = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    assert torch.equal(cpu_rows.rotary_reference(x, cos, sin), apply_rotary_pos_emb(x, other, cos, sin)[0])


def test_rotary_takes_only_the_layout_it_reads():
    cos = torch.randn(1, 2, 8)
    assert cpu_rows.takes_rotary(torch.randn(1, 2, 3, 8).transpose(1, 2), cos)  # heads side by side in a row
    assert not cpu_rows.takes_rotary(torch.randn(1, 3, 2, 8), cos)  # heads apart: another layout
    assert not cpu_rows.takes_rotary(torch.randn(1, 2, 3, 8).transpose(1, 2).double(), cos.double())
    assert not cpu_rows.takes_rotary(torch.randn(1, 2, 3, 8).transpose(1, 2), torch.randn(1, 2, 16)[..., ::2])


@needs_kernel
def test_swapped_norms_compute_the_kernels_rows_keep_their_hooks_and_fall_back_for_other_inputs():
    model = tiny_model("llama")
    assert cpu_rows.fast_norms(model, KERNEL) == 2 * len(model.model.layers) + 1
    assert cpu_rows.fast_norms(model, KERNEL) == 0, "a norm is swapped once"
    norm = model.model.layers[0].input_layernorm
    seen = []
    norm.register_forward_hook(lambda module, args, out: seen.append(out))
    x = torch.randn(1, 5, norm.weight.shape[0])
    out = norm(x)
    assert torch.equal(out, KERNEL.rms_norm(x, norm.weight, norm.variance_epsilon)) and seen[-1] is out
    halves = x.to(torch.bfloat16)
    assert torch.equal(norm(halves), type(norm).forward(norm, halves)), "bf16 rows: the module's own forward"
    trained = norm(x.requires_grad_())
    assert trained.grad_fn is not None, "what autograd differentiates goes through torch's ops"
