"""Quantized targets: the CPU int4 path against its reference, exactness relative to the quantized
target for every proposer, the on-disk quantized cache, and the automatic format choice."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import PROMPT_IDS, assert_speculation_reproduces_greedy, hf_greedy, quantized_as_loaded, tiny_model
from localspec.base.config import GenerationLimits, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core.engine import Engine
from localspec.core.proposers import DraftModelProposer, NgramProposer
from localspec.kernels.cpu_int8 import Int8Linear
from localspec.kernels.cpu_w4a8 import W4A8Linear
from localspec.kernels.cpu_w8a8 import W8A8Linear, w8a8_linear_reference, w8a8_supported, wait_for_packing
from localspec.kernels.int4_format import int4_matmul_reference, quantize_int4
from localspec.kernels.int4_linear import Int4Linear, cpu_int4_supported
from localspec.runtime import quant as quantization

needs_int4 = pytest.mark.skipif(not cpu_int4_supported(), reason="this torch build has no CPU int4 matmul")
needs_w8a8 = pytest.mark.skipif(not w8a8_supported(), reason="no exact oneDNN int8 matmul on this machine")


def _w4a8_builds() -> bool:
    try:
        return quantization.w4a8_kernel() is not None
    except LocalspecError:
        return False


needs_w4a8 = pytest.mark.skipif(not _w4a8_builds(), reason="the w4a8 kernel cannot be built or run here")


@needs_int4
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("out_features, in_features, group", [(33, 64, 32), (96, 128, 32), (257, 96, 32), (40, 128, 64)])
def test_cpu_int4_linear_matches_reference(rows, out_features, in_features, group):
    torch.manual_seed(rows + out_features)
    linear = torch.nn.Linear(in_features, out_features, bias=True)
    layer = Int4Linear.from_linear(linear, group)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    reference = int4_matmul_reference(x, layer.packed, layer.scales, layer.mins, group).float() + layer.bias.float()
    got = layer(x).float()
    assert torch.equal(layer(x.t().contiguous().t()), layer(x)), "non-contiguous rows (a transposed view) work too"
    # bf16 activations and bf16 scale/zero in the kernel: a few bf16 steps of the output's size
    bound = 3e-2 * reference.abs().max() + 1e-2
    assert (got - reference).abs().max() <= bound
    # the cached CPU layout, adopted by a fresh module, computes the same
    other = Int4Linear(in_features, out_features, True, group)
    other.load_state_dict(layer.state_dict())
    other.adopt_cpu_layout(layer.cpu_layout())
    assert torch.equal(other(x), layer(x))


def test_int4_quantization_error_is_at_most_half_a_step():
    w = torch.randn(48, 96) * torch.linspace(0.1, 3, 96)
    packed, scales, mins = quantize_int4(w, 32)
    layer = Int4Linear(96, 48, False, 32)
    layer.packed.copy_(packed), layer.scales.copy_(scales), layer.mins.copy_(mins)
    error = (layer.dense_weight() - w).abs().reshape(48, 3, 32)
    assert bool((error <= scales[..., None] / 2 + 1e-6).all())


@needs_w8a8
@pytest.mark.parametrize("out_features, in_features", [(48, 64), (257, 96), (96, 1024)])
def test_w8a8_linear_sums_exactly_and_each_row_alone(out_features, in_features):
    torch.manual_seed(out_features)
    linear = torch.nn.Linear(in_features, out_features)
    linear.weight.data *= torch.linspace(0.1, 4, in_features)  # uneven channels, as in real models
    layer = W8A8Linear(Int8Linear.from_linear(linear, torch.float32))
    x = torch.randn(16, in_features) * torch.linspace(5, 0.01, in_features)
    x[3, 7] = 300.0  # an outlier row
    unpacked = layer(x)  # torch._int_mm, before the weight is packed for oneDNN
    layer.pack()
    out = layer(x)
    assert torch.equal(out, w8a8_linear_reference(x, layer.qweight, layer.scales, layer.bias))
    assert torch.equal(unpacked, out), "packing must not change a single bit"
    for rows in (slice(0, 1), slice(3, 4), slice(5, 12)):  # a row computes the same in any company
        assert torch.equal(layer(x[rows]), out[rows])
    plain = torch.cat([x[:3], x[4:]])  # without the outlier row, whose other entries lose precision
    relative = (layer(plain) - linear(plain)).norm() / linear(plain).norm()
    assert relative < 0.04  # 8-bit weights and activations stay close to the float layer


def quantized_tiny(quant: str, seed: int = 0):
    return quantized_as_loaded(tiny_model("llama", seed=seed, hidden=64), quant)


@pytest.mark.parametrize("quant", [pytest.param("int4", marks=needs_int4), "int8", pytest.param("w8a8", marks=needs_w8a8),
                                   pytest.param("w4a8", marks=needs_w4a8)])
def test_greedy_on_a_quantized_target_is_that_targets_own_greedy_output(quant):
    target = quantized_tiny(quant)
    kinds = {type(m) for m in target.modules()}
    assert {"int4": Int4Linear, "int8": Int8Linear, "w8a8": W8A8Linear, "w4a8": W4A8Linear}[quant] in kinds
    expected = hf_greedy(target, PROMPT_IDS, 40)
    drafts = [None, NgramProposer(), DraftModelProposer(target), DraftModelProposer(quantized_tiny(quant, seed=1))]
    for proposer in drafts:
        for draft_len in (2, 5):
            engine = Engine(target, None, proposer, SpecConfig(draft_len=draft_len))
            out = [p.token_id for ev in engine.generate(PROMPT_IDS, limits=GenerationLimits(40)) for p in ev.pieces]
            assert out == expected, (proposer, draft_len)


def test_unsupported_formats_fail_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # not installed
    with pytest.raises(LocalspecError, match="nf4 needs bitsandbytes"):
        quantization.check_supported("nf4", torch.device("cpu"))
    with pytest.raises(LocalspecError, match="w8a8 is a CPU format"):
        quantization.check_supported("w8a8", torch.device("mps"))
    with pytest.raises(LocalspecError, match="--quant must be one of"):
        SpecConfig(quant="int3")


def test_auto_format_keeps_a_ggufs_own_numbers_then_w8a8_on_a_capable_cpu_then_fits_memory(monkeypatch):
    from localspec.store import session
    from localspec.store.registry import load_registry

    registry = load_registry()
    cpu = torch.device("cpu")
    monkeypatch.setattr(session, "_w4a8_kernel_name", lambda: "AVX2")
    assert session.choose_quant(registry.get("qwen2.5-coder-1.5b"), "auto", cpu)[0] == "w4a8"
    monkeypatch.setattr(session, "_w4a8_kernel_name", lambda: None)  # no compiler: the file's 4-bit tensors as int4
    monkeypatch.setattr(session, "w8a8_supported", lambda: True)
    assert session.choose_quant(registry.get("qwen2.5-coder-1.5b"), "auto", cpu)[0] == "int4"
    monkeypatch.setattr(session.torch.cuda, "mem_get_info", lambda: (64e9, 80e9))
    assert session.choose_quant(registry.get("qwen2.5-coder-1.5b"), "auto", torch.device("cuda"))[0] == "int4"
    assert session.choose_quant(registry.get("qwen2.5-coder-1.5b"), "none", cpu) == ("none", "--quant none")
    monkeypatch.setattr(session, "w8a8_supported", lambda: False)
    big = next(e for e in registry.models.values() if e.mirror is None and e.params >= 7)

    class Memory:
        def __init__(self, available):
            self.available = available

    for free, expected in [(64e9, "none"), (12e9, "int8"), (6e9, "int4")]:
        monkeypatch.setattr(session.psutil, "virtual_memory", lambda free=free: Memory(free))
        assert session.choose_quant(big, "auto", cpu)[0] == expected, free
    monkeypatch.setattr(session, "w8a8_supported", lambda: True)
    for free, expected in [(64e9, "w8a8"), (6e9, "int4")]:  # int8 weights must fit, else 4-bit
        monkeypatch.setattr(session.psutil, "virtual_memory", lambda free=free: Memory(free))
        assert session.choose_quant(big, "auto", cpu)[0] == expected, free
    mps, small_4bit = torch.device("mps"), registry.get("qwen2.5-coder-1.5b")
    for free, expected in [(64e9, "none"), (2e9, "int4")]:  # MPS: 16-bit where it fits, its int4 is a slow reference
        monkeypatch.setattr(session.psutil, "virtual_memory", lambda free=free: Memory(free))
        assert session.choose_quant(small_4bit, "auto", mps)[0] == expected, free


@pytest.mark.real_model
@needs_int4
def test_an_int4_load_of_a_gguf_holds_its_4bit_tensors_as_they_are_and_loads_the_same_model_again():
    import localspec.store.loading as loading
    from localspec.store.registry import load_registry

    entry = load_registry().get("smollm2-135m")
    first = loading.load_model(entry, torch.float32, quant="int4", progress=False)
    ids = torch.tensor([[1, 504, 2177, 42, 7, 99]])
    with torch.no_grad():
        expected = first.model(ids).logits
    assert first.dtype == torch.bfloat16 and first.quant == "int4"
    assert sum(isinstance(m, Int4Linear) for m in first.model.modules()) == 30 * 7  # Q4_1 projections; Q8_0 output in bf16
    again = loading.load_model(entry, torch.float32, quant="int4", progress=False)
    with torch.no_grad():
        assert torch.equal(again.model(ids).logits, expected)


@pytest.mark.real_model
@needs_w8a8
def test_w8a8_runs_a_ggufs_weights_as_int8_and_speculation_reproduces_its_greedy_output():
    import localspec.store.loading as loading
    from localspec.store.registry import load_registry

    entry = load_registry().get("smollm2-135m")
    loaded = loading.load_model(entry, torch.bfloat16, quant="w8a8", progress=False)
    assert loaded.quant == "w8a8" and loaded.dtype == torch.float32
    layers = [m for m in loaded.model.modules() if isinstance(m, W8A8Linear)]
    assert len(layers) == 30 * 7 + 1  # every projection and the output layer
    wait_for_packing(loaded.model)
    assert all(m._packed is not None for m in layers)
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert_speculation_reproduces_greedy(loaded)
