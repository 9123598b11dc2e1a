"""The model loaded from a GGUF is the file's model (store.gguf_blocks, gguf_model, own_models):
every decoder against the gguf package's own de-quantizer, every linear of a loaded model against
the file's tensor, a float file against the model it was written from, speculation on a streamed
model against greedy, and hostile files as one clean line that leaves the file as it was."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from conftest import PROMPT_IDS, hf_greedy
from gguf_files import K_QUANTS, random_blocks, tiny_gguf_model, write_gguf
from localspec.base.errors import LocalspecError
from localspec.kernels import cpu_w4a8
from localspec.kernels.int4_linear import Int4Linear
from localspec.runtime.quant import dense_weight
from localspec.store.gguf_blocks import EIGHT_BIT, FOUR_BIT, SIX_BIT, block_bits, decode
from localspec.store.gguf_model import GGUFEmbedding, GGUFSource, build_model

MIXED = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q6_K, "attn_output": Q.Q4_1, "ffn_gate": Q.Q5_0,
         "ffn_up": Q.Q5_K, "ffn_down": Q.Q8_0, "output": Q.Q5_1, "token_embd": Q.Q4_K}
"""One tensor type per kind of linear: every decoder meets a real model's layout."""


def _blocks_of(qtype: Q, rows: int) -> np.ndarray:
    """(rows, bytes) of 512 inputs per row: random valid K blocks, or quantized normal values."""
    if qtype in K_QUANTS:
        return random_blocks(qtype, rows, 2, seed=int(qtype))
    return quantize(np.random.default_rng(int(qtype)).standard_normal((rows, 512)).astype(np.float32), qtype)


@pytest.mark.parametrize("qtype", FOUR_BIT + SIX_BIT + EIGHT_BIT, ids=lambda q: q.name)
def test_every_decoder_gives_the_gguf_dequantizers_numbers_and_only_fp16_rounds_the_scales(qtype):
    blocks = _blocks_of(qtype, 8)
    reference = torch.from_numpy(dequantize(blocks, qtype))  # (8, K)
    affine = decode(torch.from_numpy(blocks), qtype)
    assert affine.bits == block_bits(qtype) and affine.group == (32 if affine.bits == 4 else 16)
    assert int(affine.codes.max()) < 2**affine.bits
    n, k = affine.codes.shape
    codes = affine.codes.float().reshape(n, k // affine.group, affine.group)
    exact = (codes * affine.scales[..., None] + affine.mins[..., None]).reshape(n, k)
    assert torch.equal(exact, reference), "the file's own codes, scales and mins"
    # the kernels hold scales and mins in fp16: each may move by half an fp16 step (2^-11 relative)
    bound = (codes * affine.scales[..., None].abs() + affine.mins[..., None].abs()).reshape(n, k) * 2.0**-11
    assert ((affine.dequantize() - reference).abs() <= bound + 1e-12).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_float_gguf_loads_as_exactly_the_model_it_was_written_from(arch, tmp_path):
    model = tiny_gguf_model(arch, hidden=64)
    path = write_gguf(model, tmp_path / "tiny.gguf")
    loaded = build_model(GGUFSource(path), "none", torch.float32, None)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    assert torch.equal(loaded.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quant", ["w4a8", "int4"])
def test_every_linear_of_a_streamed_model_holds_the_files_numbers(arch, quant, tmp_path):
    if quant == "w4a8":
        pytest.importorskip("localspec.kernels.cpu_w4a8")
    model = tiny_gguf_model(arch)
    path = write_gguf(model, tmp_path / "mixed.gguf", MIXED)
    source = GGUFSource(path)
    loaded = build_model(source, quant, torch.float32, tmp_path / "blocks.pt")
    file_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down"}
    checked = 0
    for i, layer in enumerate(loaded.model.layers):
        for hf, short in file_names.items():
            name = f"blk.{i}.{short}.weight"
            module = layer.get_submodule(hf)
            rows = _hf_rows(arch, model.config, short, module.out_features)
            expected = decode(source.raw(name), source.qtype(name)).dequantize()[rows]
            if quant == "w4a8":
                assert isinstance(module, cpu_w4a8.W4A8Linear) and module.bits == block_bits(source.qtype(name))
            elif source.qtype(name) in FOUR_BIT:
                assert isinstance(module, Int4Linear)
            else:  # int4 elsewhere: the wider types kept in bf16, more bits than the file has
                expected = torch.from_numpy(dequantize(source.raw(name).numpy(), source.qtype(name)))[rows]
                assert torch.allclose(dense_weight(module).float(), expected, rtol=2**-8, atol=0)
                checked += 1
                continue
            assert torch.equal(dense_weight(module).float(), expected), name
            checked += 1
    assert checked == 7 * len(loaded.model.layers)
    if quant == "w4a8":
        assert torch.equal(dense_weight(loaded.lm_head), decode(source.raw("output.weight"), Q.Q5_1).dequantize())
    embedding = loaded.get_input_embeddings()
    assert isinstance(embedding, GGUFEmbedding)
    table = torch.from_numpy(dequantize(source.raw("token_embd.weight").numpy(), Q.Q4_K))
    assert torch.equal(dense_weight(embedding), table)


def _hf_rows(arch, config, short, rows):
    if arch != "llama" or short not in ("attn_q", "attn_k"):
        return torch.arange(rows)
    heads = config.num_attention_heads if short == "attn_q" else config.num_key_value_heads
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def test_a_tied_file_uses_its_embedding_as_the_output_layer_and_a_warm_load_maps_the_stored_blocks(tmp_path):
    model = tiny_gguf_model("qwen2")
    path = write_gguf(model, tmp_path / "tied.gguf", {"token_embd": Q.Q8_0}, default=Q.Q4_0, tied=True)
    source = GGUFSource(path, tmp_path / "header.json")
    blocks = tmp_path / "blocks.pt"
    cold = build_model(source, "w4a8", torch.float32, blocks)
    assert blocks.is_file() and (tmp_path / "header.json").is_file()
    assert torch.equal(dense_weight(cold.lm_head), decode(source.raw("token_embd.weight"), Q.Q8_0).dequantize())
    warm = build_model(GGUFSource(path, tmp_path / "header.json"), "w4a8", torch.float32, blocks)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        assert torch.equal(warm(ids).logits, cold(ids).logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_speculation_on_a_streamed_model_reproduces_its_greedy_decoding(arch, tmp_path):
    from localspec.base.config import GenerationLimits, SpecConfig
    from localspec.core.engine import Engine
    from localspec.core.proposers import DraftModelProposer, NgramProposer

    model = tiny_gguf_model(arch)
    path = write_gguf(model, tmp_path / "mixed.gguf", MIXED)
    target = build_model(GGUFSource(path), "w4a8", torch.float32, None)
    draft = build_model(GGUFSource(write_gguf(tiny_gguf_model(arch, seed=1), tmp_path / "draft.gguf", MIXED)),
                        "w4a8", torch.float32, None)
    expected = hf_greedy(target, PROMPT_IDS, 24)
    for proposer in (NgramProposer(), DraftModelProposer(draft)):
        engine = Engine(target, None, proposer, SpecConfig(draft_len=4))
        out = [p.token_id for ev in engine.generate(PROMPT_IDS, limits=GenerationLimits(24)) for p in ev.pieces]
        assert out == expected, type(proposer).__name__


def _digest(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def test_hostile_files_are_one_clean_line_and_stay_as_they_were(tmp_path):
    good = write_gguf(tiny_gguf_model("llama", hidden=64), tmp_path / "good.gguf")
    data = good.read_bytes()
    cases = {
        "truncated.gguf": data[: len(data) // 2],
        "garbage.gguf": os.urandom(4096),
        "empty.gguf": b"",
        "header only.gguf": data[:24],
    }
    for name, content in cases.items():
        path = tmp_path / name
        path.write_bytes(content)
        before = _digest(path)
        with pytest.raises(LocalspecError) as caught:
            GGUFSource(path)
        assert "\n" not in str(caught.value) and name in str(caught.value), name
        assert _digest(path) == before, name


def test_an_unsupported_architecture_is_named_in_one_line(tmp_path):
    path = write_gguf(tiny_gguf_model("llama", hidden=64), tmp_path / "other.gguf", arch="llama")
    raw = path.read_bytes().replace(b"llama", b"gpt2x", 1)  # general.architecture's value
    odd = tmp_path / "odd.gguf"
    odd.write_bytes(raw)
    with pytest.raises(LocalspecError, match="architecture 'gpt2x' is not supported"):
        GGUFSource(odd)


def test_a_tensor_past_the_end_of_the_file_is_refused(tmp_path):
    path = write_gguf(tiny_gguf_model("llama", hidden=64), tmp_path / "good.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1000])  # the header still promises every tensor
    with pytest.raises(LocalspecError, match="not a readable GGUF file"):
        GGUFSource(cut)


def test_own_file_is_registered_once_runs_by_name_and_rm_never_touches_it(tmp_path, monkeypatch):
    from localspec.store import hub, own_models
    from localspec.store.registry import load_registry

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    folder = tmp_path / "my models"  # a space in the path
    folder.mkdir()
    path = write_gguf(tiny_gguf_model("qwen2", hidden=64), folder / "Tiny-Qwen.Q8_0.gguf", default=Q.Q8_0)
    before = _digest(path)
    name = own_models.resolve(str(path))
    assert name == "tiny-qwen.q8_0"
    assert own_models.resolve(str(path)) == name, "registered once"
    entry = load_registry().get(name)
    assert entry.gguf == path and entry.arch == "qwen2" and entry.size == path.stat().st_size
    assert own_models.resolve(str(path), "mine") == "mine"
    with pytest.raises(LocalspecError, match="no such file"):
        own_models.resolve(str(folder / "missing.gguf"))
    header = Path(os.environ["LOCALSPEC_HOME"]) / "converted" / f"{name}-file" / "gguf" / "header.json"
    assert header.is_file()
    from localspec.store.registry import save_user_model

    save_user_model("qwen2.5-coder-1.5b", {"drafts": [name]})  # what --draft PATH writes
    hub.rm(entry)
    assert not header.exists() and _digest(path) == before, "rm removes localspec's copies, never the file"
    registry = load_registry()
    assert name not in registry.models and name not in registry.get("qwen2.5-coder-1.5b").drafts


def test_a_path_that_is_not_utf8_is_one_clean_line(tmp_path, monkeypatch):
    from localspec.store import own_models

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9.gguf"))
    write_gguf(tiny_gguf_model("qwen2", hidden=64), odd)
    with pytest.raises(LocalspecError) as caught:
        own_models.resolve(str(odd))
    assert "\n" not in str(caught.value) and "UTF-8" in str(caught.value)


@pytest.mark.real_model
def test_a_real_files_every_linear_is_its_own_numbers_never_fewer_bits():
    """Qwen2.5-Coder-0.5B's Q4_K_M file mixes Q4_K, Q5_0, Q6_K and Q8_0: every linear of its w4a8
    load is the file's tensor, the 5- and 6-bit ones in 6-bit blocks, Q8_0 in 8-bit ones."""
    from localspec.store.gguf_mirror import ensure_gguf
    from localspec.store.registry import load_registry

    source = GGUFSource(ensure_gguf(load_registry().get("qwen2.5-coder-0.5b"), progress=False))
    model = build_model(source, "w4a8", torch.float32, None)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    seen = set()
    for i, layer in enumerate(model.model.layers):
        for hf, short in names.items():
            name = f"blk.{i}.{short}.weight"
            module, qtype = layer.get_submodule(hf), source.qtype(name)
            assert module.bits == block_bits(qtype), name
            assert torch.equal(dense_weight(module), decode(source.raw(name), qtype).dequantize()), name
            seen.add(qtype)
    assert torch.equal(dense_weight(model.lm_head), decode(source.raw("output.weight"), source.qtype("output.weight")).dequantize())
    assert {Q.Q4_K, Q.Q5_0, Q.Q6_K} <= seen


def test_a_tensor_laid_out_in_row_ranges_gets_the_same_blocks_as_in_one_piece(tmp_path, monkeypatch):
    from localspec.store import gguf_model

    path = write_gguf(tiny_gguf_model("llama"), tmp_path / "mixed.gguf", MIXED)
    whole = build_model(GGUFSource(path), "w4a8", torch.float32, None)
    monkeypatch.setattr(gguf_model, "PACK_ROWS", 16)  # 256-row tensors in 16 pieces, q/k rows permuted across them
    pieces = build_model(GGUFSource(path), "w4a8", torch.float32, None)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        assert torch.equal(pieces(ids).logits, whole(ids).logits)
    layer = pieces.model.layers[1].self_attn.q_proj
    assert torch.equal(layer.blocks, whole.model.layers[1].self_attn.q_proj.blocks)
