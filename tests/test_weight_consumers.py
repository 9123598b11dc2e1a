"""Whatever reads a layer's weights instead of running it (an EAGLE head's shared output layer and
embedding, train-eagle) gets them through `quant.dense_weight`, in every format the loader makes:
each format's de-quantization against its reference, and train-eagle end to end on quantized
targets (features, training, save, load, then EAGLE decoding exactly the target's greedy output)."""

from __future__ import annotations

import importlib.util
import textwrap
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import PROMPT_IDS, CharTokenizer, hf_greedy, quantized_as_loaded, tiny_model
from localspec.base.config import GenerationLimits, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core.engine import Engine
from localspec.core.proposers.eagle import EagleProposer
from localspec.core.proposers.eagle_head import build_head, load_head
from localspec.kernels import cpu_w4a8
from localspec.kernels.cpu_int8 import Int8Linear, int8_supported
from localspec.kernels.cpu_linear import PackedLinear, packing_supported
from localspec.kernels.cpu_w8a8 import W8A8Linear, w8a8_supported
from localspec.kernels.int4_format import dequantize_int4
from localspec.kernels.int4_linear import GROUP_SIZE, Int4Linear, cpu_int4_supported
from localspec.runtime import quant as quantization
from localspec.runtime.quant import dense_weight

CPU = torch.device("cpu")


def _w4a8_kernel():
    try:
        return quantization.w4a8_kernel()
    except LocalspecError:
        return None


KERNEL = _w4a8_kernel()
needs_int4 = pytest.mark.skipif(not cpu_int4_supported(), reason="this torch build has no CPU int4 matmul")
needs_int8 = pytest.mark.skipif(not int8_supported(), reason="this torch build has no CPU int8 matmul")
needs_w8a8 = pytest.mark.skipif(not w8a8_supported(), reason="no exact oneDNN int8 matmul on this machine")
needs_w4a8 = pytest.mark.skipif(KERNEL is None, reason="the w4a8 kernel cannot be built or run here")
needs_bitsandbytes = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")


def float_linear(out_features: int, in_features: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=True).requires_grad_(False)


def codes_of(packed: torch.Tensor) -> torch.Tensor:
    """The int4 format's nibbles, read one column at a time: column 2j in byte j's low half."""
    return torch.stack([(packed[:, j // 2] >> (4 * (j % 2))) & 0x0F for j in range(2 * packed.shape[1])], dim=1)


# -- each format against its reference ------------------------------------------------------------


def test_a_float_layer_hands_its_own_tensor_without_a_copy():
    linear = float_linear(24, 64)
    embedding = torch.nn.Embedding(96, 48)
    assert dense_weight(linear).data_ptr() == linear.weight.data_ptr()
    assert dense_weight(embedding).data_ptr() == embedding.weight.data_ptr()
    with pytest.raises(LocalspecError, match="cannot read a weight out of a ReLU layer"):
        dense_weight(torch.nn.ReLU())


@pytest.mark.skipif(not packing_supported(), reason="no oneDNN weight packing in this torch build")
def test_a_prepacked_linear_reads_the_weight_it_was_packed_from():
    linear = float_linear(24, 64)
    packed = PackedLinear(linear, wide_from=4)
    assert dense_weight(packed).data_ptr() == linear.weight.data_ptr()


@pytest.mark.parametrize("out_features, in_features", [(33, 64), (96, 128)])
def test_int4_weights_are_their_codes_times_scale_plus_min(out_features, in_features):
    linear = float_linear(out_features, in_features)
    layer = Int4Linear.from_linear(linear, GROUP_SIZE)
    weight = dense_weight(layer)  # (N, K)
    codes = codes_of(layer.packed).float().reshape(out_features, -1, GROUP_SIZE)  # (N, G, group)
    expected = (codes * layer.scales[..., None] + layer.mins[..., None]).reshape(out_features, in_features)
    assert weight.dtype == torch.float32 and torch.equal(weight, expected)
    step = layer.scales.repeat_interleave(GROUP_SIZE, dim=1)  # (N, K)
    assert ((weight - linear.weight).abs() <= step / 2 + 1e-6).all()


def test_int8_weights_and_w8a8_which_runs_them_read_codes_times_the_channel_scale():
    linear = float_linear(40, 64)
    layer = Int8Linear.from_linear(linear, torch.bfloat16)
    expected = layer.qweight.float() * layer.scales.float()[:, None]
    assert torch.equal(dense_weight(layer), expected)
    assert torch.equal(dense_weight(W8A8Linear(layer)), expected)  # the same numbers, another kernel
    assert ((dense_weight(layer) - linear.weight).abs() <= layer.scales.float()[:, None] / 2 + 1e-3).all()


@needs_w4a8
@pytest.mark.parametrize("out_features, in_features", [(37, 64), (48, 96), (16, 1536)])
def test_w4a8_reads_back_from_its_blocks_the_int4_weight_with_fp16_steps_and_that_is_what_the_kernel_multiplies(out_features, in_features):
    source = Int4Linear.from_linear(float_linear(out_features, in_features), GROUP_SIZE)
    layer = cpu_w4a8.fuse([source], KERNEL)[0]
    packed, scales16, mins16 = cpu_w4a8.unpack(layer.blocks, out_features, in_features)
    assert torch.equal(packed, source.packed)  # the blocks hold the same codes, and the steps pack rounded to fp16
    assert torch.equal(scales16, source.scales.to(torch.float16)) and torch.equal(mins16, source.mins.to(torch.float16))
    expected = dequantize_int4(source.packed, source.scales.half().float(), source.mins.half().float(), GROUP_SIZE)
    assert torch.equal(dense_weight(layer), expected)
    # the compiled kernel reading the blocks agrees: one-hot rows give each input's column of the weight
    columns = layer(torch.eye(in_features)) - layer.bias  # (K, N)
    torch.testing.assert_close(columns, expected.t(), rtol=1e-5, atol=1e-6)


@needs_w4a8
def test_w4a8_linears_sharing_one_call_each_read_their_own_rows():
    sources = [Int4Linear.from_linear(float_linear(n, 64, seed=n), GROUP_SIZE) for n in (32, 16, 48)]
    for source, layer in zip(sources, cpu_w4a8.fuse(sources, KERNEL)):
        assert layer.shared is not None
        assert torch.equal(dense_weight(layer), dequantize_int4(source.packed, source.scales.half().float(),
                                                                source.mins.half().float(), GROUP_SIZE))


@needs_bitsandbytes
@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_bitsandbytes_layers_read_the_weight_their_own_forward_multiplies(quant):
    linear = float_linear(32, 64)
    layer = quantization._bitsandbytes_linear(linear, quant, CPU)
    weight = dense_weight(layer)
    assert weight.dtype == torch.float32 and weight.shape == linear.weight.shape
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight.to(torch.bfloat16), layer.bias))
    assert (weight - linear.weight).abs().max() < (0.05 if quant == "nf4" else 0.005)


# -- train-eagle on a quantized target, end to end ------------------------------------------------


class TrainingTokenizer(CharTokenizer):
    """The suite's character tokenizer, called the way train-eagle calls a transformers tokenizer."""

    pad_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.encode(text)}


SOURCE = textwrap.dedent('''
    def mean(values):
        """Returns the arithmetic mean of a list of numbers."""
        total = 0
        for value in values:
            total += value
        return total / len(values)


    def clamp(x, low, high):
        """Limits a number to the range from low to high."""
        if x < low:
            return low
        return high if x > high else x


    def words(text):
        """Splits a text into its words and drops empty ones."""
        parts = text.split(" ")
        return [part for part in parts if part]
''') * 6


def quantized_target(quant: str, tied: bool):
    """A 6-layer tiny Llama (EAGLE-3 reads three of its layers) in `quant`, as the loader runs it."""
    model = tiny_model("llama", layers=6, hidden=64)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
        model.config.tie_word_embeddings = True
    if quant == "nf4":
        from localspec.store.loading import place

        place(model.to(torch.bfloat16), "nf4", CPU)
        return model
    return model if quant == "none" else quantized_as_loaded(model, quant)


FORMATS = [  # (format, tied embeddings, what it needs, EAGLE versions)
    ("none", False, [], (1, 3)),
    ("none", True, [], (1, 3)),
    ("int4", False, [needs_int4], (1, 3)),
    ("int8", False, [needs_int8], (1, 3)),
    ("w8a8", False, [needs_w8a8], (1, 3)),
    ("w4a8", False, [needs_w4a8], (1, 3)),
    ("w4a8", True, [needs_w4a8], (1, 3)),
    ("nf4", False, [needs_bitsandbytes], (1,)),  # slow on a CPU; EAGLE-1 reads the output layer in training and in the head
]
CASES = [pytest.param(quant, tied, version, marks=needs, id=f"{quant}{'-tied' if tied else ''}-eagle{version}")
         for quant, tied, needs, versions in FORMATS for version in versions]


@pytest.mark.parametrize("quant, tied, version", CASES)
def test_train_eagle_on_each_format_trains_saves_and_loads_a_head_that_decodes_the_targets_own_greedy_output(tmp_path, quant, tied, version):
    from localspec.apps.train_eagle import TrainSettings, train_eagle

    target = quantized_target(quant, tied)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "stats.py").write_text(SOURCE)
    settings = TrainSettings(version=version, seq_len=64, max_tokens=640, self_distill=2, answer_tokens=8,
                             draft_vocab=64, epochs=1, batch=4, ttt_steps=2)
    loaded = SimpleNamespace(model=target, tokenizer=TrainingTokenizer(), name="tiny", quant=quant)
    summary = train_eagle(loaded, tmp_path / "head", [tmp_path / "data"], settings, quiet=True)
    assert summary["steps"] > 0 and summary["version"] == version and summary["target_weights"] == quant

    head = build_head(load_head(tmp_path / "head", target.config), target)
    if version == 1:  # the head's output layer is the target's own, de-quantized from what the target runs
        assert torch.equal(head.target_lm_head, dense_weight(target.get_output_embeddings()).float())
    expected = hf_greedy(target, PROMPT_IDS, 16)
    proposer = EagleProposer(head, target, top_k=4, nodes=10, depth=3)
    engine = Engine(target, None, proposer, SpecConfig())
    out = [p.token_id for ev in engine.generate(PROMPT_IDS, limits=GenerationLimits(16)) for p in ev.pieces]
    assert out == expected
    assert engine.stats.drafted > 0, "the EAGLE head must have drafted"
    proposer.close()
