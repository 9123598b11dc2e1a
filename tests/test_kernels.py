"""Every fast path against its plain torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localspec.kernels.cpu_linear import PackedLinear, pack_linears, packing_supported, packs, unpack_linears

pytestmark = pytest.mark.skipif(not packing_supported(), reason="this torch build has no oneDNN linear ops")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 16, 33])
@pytest.mark.parametrize("out_features, in_features, bias", [(64, 32, False), (97, 45, True), (1, 7, True)])
def test_packed_linear_matches_reference(dtype, tol, rows, out_features, in_features, bias):
    if not packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} weights on this CPU")
    torch.manual_seed(rows)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)
    x = torch.randn(1, rows, in_features, dtype=dtype)
    reference = F.linear(x, linear.weight, linear.bias)
    for wide_from in (1, 4, 64):  # packed path, mixed, reference path
        out = PackedLinear(linear, wide_from)(x)
        assert out.shape == reference.shape and out.dtype == reference.dtype
        torch.testing.assert_close(out, reference, atol=tol, rtol=tol)


def test_packing_a_model_keeps_its_logits():
    from conftest import tiny_model

    model = tiny_model("qwen2")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        reference = model(ids).logits
        added = pack_linears(model, wide_from=4)
        assert added > 0 and any(isinstance(m, PackedLinear) for m in model.modules())
        torch.testing.assert_close(model(ids).logits, reference, atol=1e-4, rtol=1e-4)
        unpack_linears(model)
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        torch.testing.assert_close(model(ids).logits, reference)


from localspec.kernels.cpu_int8 import (
    Int8Linear, int8_linear_reference, int8_supported, quantize_per_channel,
)


@pytest.mark.skipif(not int8_supported(), reason="this torch build has no int8 weight-only matmul")
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("out_features, in_features, bias", [(64, 32, False), (97, 48, True), (8, 16, True)])
def test_int8_linear_matches_reference(rows, out_features, in_features, bias):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    layer = Int8Linear.from_linear(linear)
    x = torch.randn(1, rows, in_features, dtype=torch.bfloat16)
    reference = int8_linear_reference(x, layer.qweight, layer.scales.float(), layer.bias)
    torch.testing.assert_close(layer(x), reference, atol=3e-2, rtol=3e-2)
    # and the quantization itself stays within half a step of the original weight
    q, scales = quantize_per_channel(linear.weight)
    error = (q.float() * scales[:, None] - linear.weight.float()).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-3).all())


@pytest.mark.skipif(not int8_supported(), reason="this torch build has no int8 weight-only matmul")
def test_int8_model_keeps_odd_layers_in_float_and_stays_close():
    model = torch.nn.Sequential(torch.nn.Linear(32, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8)).to(torch.bfloat16)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    reference = model(x)
    from localspec.runtime.quant import quantize_model

    assert quantize_model(model, "int8", torch.device("cpu")) == {"0": "int8"}
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], torch.nn.Linear)  # 40 % 16 != 0
    torch.testing.assert_close(model(x), reference, atol=0.1, rtol=0.1)


def test_a_dtype_onednn_cannot_pack_here_stays_a_plain_linear():
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16).to(torch.bfloat16))
    pack_linears(model, wide_from=2)
    assert isinstance(model[0], PackedLinear) == packs(torch.float32)
    assert isinstance(model[1], PackedLinear) == packs(torch.bfloat16)
    out = model[1](torch.randn(3, 16, dtype=torch.bfloat16))  # runs either way
    assert out.shape == (3, 16)
