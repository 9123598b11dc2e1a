"""EAGLE head checkpoints (localspec.core.proposers.eagle_head): hand-written files in each published
layout (EAGLE-1/2, EAGLE-3, speculators' eagle3; safetensors and pytorch_model.bin) load into a
working head, malformed ones fail with a message naming the problem, save_head round-trips
bit-identically in the official key layout, and the head's forward pass matches a direct float64
re-implementation of the published formulas (docs: /work/shared/docs/eagle-checkpoints.md, sections
1, 2 and 7). The checkpoints here are built from the spec's key names and shapes, not via save_head."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from localspec.base.errors import LocalspecError
from localspec.core.proposers.eagle_head import HeadConfig, build_head, load_head, save_head
from tests.conftest import tiny_model

# The target: tiny Llama, 8 layers, hidden 48, 4 heads / 2 KV heads (d = 12), vocabulary 96.
V, HT, LAYERS = 96, 48, 8
H, HEADS, KV, D, INTER = 48, 4, 2, 12, 64  # the head's own sizes (I differs from the target's 96)
VD = 40  # EAGLE-3 draft vocabulary
EPS, THETA = 1e-5, 5000.0  # not the defaults, so the loader must read them


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=LAYERS, hidden=HT)


# --- hand-built checkpoints in the published layouts -------------------------------------------


def _lin(gen, rows, cols):
    return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)


def _norm(gen, width):
    return 1.0 + 0.1 * torch.randn(width, generator=gen)


def _layer(gen, prefix, *, h=H, attn_in=H, heads=HEADS, kv=KV, d=D, inter=INTER, qkv_bias=False, v3=False):
    t = {
        "self_attn.q_proj.weight": _lin(gen, heads * d, attn_in),
        "self_attn.k_proj.weight": _lin(gen, kv * d, attn_in),
        "self_attn.v_proj.weight": _lin(gen, kv * d, attn_in),
        "self_attn.o_proj.weight": _lin(gen, h, heads * d),
        "mlp.gate_proj.weight": _lin(gen, inter, h),
        "mlp.up_proj.weight": _lin(gen, inter, h),
        "mlp.down_proj.weight": _lin(gen, h, inter),
        "post_attention_layernorm.weight": _norm(gen, h),
    }
    if qkv_bias:
        t["self_attn.q_proj.bias"] = 0.1 * torch.randn(heads * d, generator=gen)
        t["self_attn.k_proj.bias"] = 0.1 * torch.randn(kv * d, generator=gen)
        t["self_attn.v_proj.bias"] = 0.1 * torch.randn(kv * d, generator=gen)
    if v3:
        t["input_layernorm.weight"] = _norm(gen, h)
        t["hidden_norm.weight"] = _norm(gen, h)
    return {prefix + k: v for k, v in t.items()}


def _llama_fields(h=H, vocab=V, heads=HEADS, kv=KV, inter=INTER):
    return {
        "model_type": "llama", "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv, "num_hidden_layers": 1, "vocab_size": vocab, "rms_norm_eps": EPS,
        "rope_theta": THETA, "max_position_embeddings": 512, "hidden_act": "silu",
        "head_dim": 16,  # wrong on purpose (pitfall 5): the weights say d = 12
    }


def eagle1(seed=0, *, fc_bias=True, bias_in_config=None, qkv_bias=False, h=H, vocab=V):
    """EAGLE-1/2 head (cnets1.py): fc [h, 2h](+bias), layers.0.*, embed_tokens [V, h], no lm_head/norm."""
    gen = torch.Generator().manual_seed(seed)
    d = h // HEADS
    state = {"embed_tokens.weight": torch.randn(vocab, h, generator=gen), "fc.weight": _lin(gen, h, 2 * h)}
    if fc_bias:
        state["fc.bias"] = 0.1 * torch.randn(h, generator=gen)
    state.update(_layer(gen, "layers.0.", h=h, attn_in=h, d=d, qkv_bias=qkv_bias))
    config = {"architectures": ["LlamaForCausalLM"], **_llama_fields(h=h, vocab=vocab)}
    if bias_in_config is not None:
        config["bias"] = bias_in_config
    if qkv_bias:
        config["qkv_bias"] = True
    return config, state


def draft_vocab(seed=0, vd=VD, vocab=V):
    gen = torch.Generator().manual_seed(seed + 1000)
    used = torch.randperm(vocab, generator=gen)[:vd].sort().values  # ascending, as scandata builds it
    d2t = used - torch.arange(vd)  # offsets
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[used] = True
    return used, d2t, t2d


def eagle3(seed=0, *, prefix="midlayer.", vd=VD, h=H, ht=HT, own_embed=False):
    """EAGLE-3 head (cnets.py): fc [h, 3Ht], midlayer.* with q/k/v over 2h, norm, lm_head [Vd, h], d2t, t2d."""
    gen = torch.Generator().manual_seed(seed)
    d = h // HEADS
    state = {"fc.weight": _lin(gen, h, 3 * ht)}
    state.update(_layer(gen, prefix, h=h, attn_in=2 * h, d=d, v3=True))
    state["norm.weight"] = _norm(gen, h)
    state["lm_head.weight"] = _lin(gen, vd, h)
    if vd < V:
        _, state["d2t"], state["t2d"] = draft_vocab(seed, vd)
    if own_embed:
        state["embed_tokens.weight"] = torch.randn(V, h, generator=gen)
    config = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(h=h), "draft_vocab_size": vd,
              "tie_word_embeddings": False}
    if ht != h:
        config["target_hidden_size"] = ht
    return config, state


def speculators(seed=0, **kw):
    """speculators' eagle3: layers.0.*, its own embed_tokens, the Llama config nested."""
    _, state = eagle3(seed, prefix="layers.0.", own_embed=True)
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.1.0",
        "draft_vocab_size": VD, "norm_before_residual": False, "target_hidden_size": None,
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **_llama_fields()},
        "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "tiny"}},
    }
    config.update(kw)
    return config, state


def write(directory: Path, config, state, fmt="safetensors") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    else:
        torch.save(state, directory / "pytorch_model.bin")
    return directory


def module_names(published):
    """The published keys under EagleHead's names: layers.0.* / midlayer.* -> midlayer.*; embed and t2d apart."""
    return {k.replace("layers.0.", "midlayer."): v for k, v in published.items() if k not in ("embed_tokens.weight", "t2d")}


def assert_same_tensors(got, want):
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


# --- 1. every published layout loads -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("variant", ["llama2_bias", "llama3_no_bias", "qwen2_qkv_bias", "bias_key_overrides_config"])
def test_eagle1_layout_loads(tmp_path, target, fmt, variant):
    kw = {
        "llama2_bias": dict(fc_bias=True),  # config omits "bias": the head has one
        "llama3_no_bias": dict(fc_bias=False, bias_in_config=False),
        "qwen2_qkv_bias": dict(fc_bias=True, qkv_bias=True),
        "bias_key_overrides_config": dict(fc_bias=True, bias_in_config=False),  # keys decide (pitfall 2)
    }[variant]
    config, state = eagle1(**kw)
    ckpt = load_head(write(tmp_path / "h", config, state, fmt), target.config)
    cfg = ckpt.config
    assert ckpt.layout == "eagle1"
    assert (cfg.version, cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size) == (1, H, HT, INTER)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV, D)  # not config's head_dim 16
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.aux_layers) == (V, V, ())
    assert (cfg.rms_norm_eps, cfg.rope_theta) == (EPS, THETA)
    assert cfg.fc_bias == ("fc.bias" in state)
    assert cfg.qkv_bias == kw.get("qkv_bias", False)
    assert_same_tensors(ckpt.state, module_names(state))
    assert torch.equal(ckpt.embed, state["embed_tokens.weight"])

    head = build_head(ckpt, target)
    assert torch.equal(head.embed, state["embed_tokens.weight"])
    assert torch.equal(head.target_lm_head, target.lm_head.weight)  # EAGLE-1 logits use the target's lm_head
    assert (head.fc.bias is not None) == cfg.fc_bias
    out, k, v = head(torch.randn(1, 5, HT), torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(5)[None])
    assert out.shape == (1, 5, H) and k.shape == v.shape == (1, KV, 5, D)
    assert head.logits(out).shape == (1, 5, V)
    assert torch.equal(head.to_target_ids(torch.tensor([7, 95])), torch.tensor([7, 95]))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle3_layout_loads(tmp_path, target, fmt):
    config, state = eagle3()
    ckpt = load_head(write(tmp_path / "h", config, state, fmt), target.config)
    cfg = ckpt.config
    assert ckpt.layout == "eagle3" and ckpt.embed is None  # official heads use the target's embedding
    assert (cfg.version, cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size) == (3, H, HT, INTER)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV, D)
    assert (cfg.vocab_size, cfg.draft_vocab_size) == (V, VD)
    assert cfg.aux_layers == (2, LAYERS // 2, LAYERS - 3)  # inputs of layers 2, L//2, L-3
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.fc_bias, cfg.qkv_bias) == (EPS, THETA, False, False)
    assert_same_tensors(ckpt.state, module_names(state))

    head = build_head(ckpt, target)
    assert torch.equal(head.embed, target.get_input_embeddings().weight)
    used, _, _ = draft_vocab()
    assert torch.equal(head.to_target_ids(torch.arange(VD)), used)
    assert torch.equal(head.to_target_ids(torch.tensor([[0, VD - 1]])), used[[0, VD - 1]][None])
    out, _, _ = head(torch.randn(2, 4, 3 * HT), torch.randint(0, V, (2, 4)), torch.arange(4).expand(2, 4))
    assert out.shape == (2, 4, H) and head.logits(out).shape == (2, 4, VD)


def test_eagle3_aux_ids_from_eagle_config(tmp_path, target):
    config, state = eagle3()
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 3, 6], "use_aux_hidden_state": True}
    ckpt = load_head(write(tmp_path / "h", config, state), target.config)
    assert ckpt.config.aux_layers == (1, 4, 7)  # "output of layer i" = hidden_states[i + 1]


def test_eagle3_full_vocab_without_d2t_is_identity(tmp_path, target):
    config, state = eagle3(vd=V)
    assert "d2t" not in state
    ckpt = load_head(write(tmp_path / "h", config, state), target.config)
    assert ckpt.config.draft_vocab_size == V
    head = build_head(ckpt, target)
    assert torch.equal(head.to_target_ids(torch.arange(V)), torch.arange(V))


def test_eagle3_vllm_layers0_variant(tmp_path, target):
    config, state = eagle3(prefix="layers.0.")
    ckpt = load_head(write(tmp_path / "h", config, state), target.config)
    assert ckpt.config.version == 3
    assert_same_tensors(ckpt.state, module_names(state))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_speculators_layout_loads(tmp_path, target, fmt):
    config, state = speculators()
    ckpt = load_head(write(tmp_path / "h", config, state, fmt), target.config)
    cfg = ckpt.config
    assert ckpt.layout == "speculators"
    assert (cfg.version, cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads) == (3, H, D, KV)
    assert (cfg.vocab_size, cfg.draft_vocab_size, cfg.intermediate_size) == (V, VD, INTER)
    assert (cfg.rms_norm_eps, cfg.rope_theta) == (EPS, THETA)  # read from transformer_layer_config
    assert_same_tensors(ckpt.state, module_names(state))
    head = build_head(ckpt, target)
    assert torch.equal(head.embed, state["embed_tokens.weight"])
    assert torch.equal(head.to_target_ids(torch.arange(VD)), draft_vocab()[0])


def test_eagle3_wider_target_ships_own_embedding(tmp_path):
    """target_hidden_size (Ht) != h: fc reads 3*Ht, the embedding the head ships is [V, h] (section 1)."""
    wide = tiny_model("llama", layers=LAYERS, hidden=64)
    config, state = eagle3(h=H, ht=64, own_embed=True)
    ckpt = load_head(write(tmp_path / "h", config, state), wide.config)
    assert (ckpt.config.hidden_size, ckpt.config.target_hidden_size) == (H, 64)
    assert torch.equal(ckpt.embed, state["embed_tokens.weight"])
    head = build_head(ckpt, wide)
    out, _, _ = head(torch.randn(1, 3, 3 * 64), torch.tensor([[4, 5, 6]]), torch.arange(3)[None])
    assert out.shape == (1, 3, H)
    # and it survives a save: the embedding is not the target's, so it must be written
    save_head(head, tmp_path / "saved")
    again = load_head(tmp_path / "saved", wide.config)
    assert torch.equal(again.embed, state["embed_tokens.weight"])


# --- 2. malformed checkpoints fail, naming the problem ------------------------------------------


def _drop(*keys):
    def f(config, state):
        for k in keys:
            del state[k]
    return f


def _set(key, value):
    def f(config, state):
        state[key] = value
    return f


def _absolute_d2t(config, state):
    used, _, _ = draft_vocab()
    state["d2t"] = used.clone()  # target ids instead of offsets


def _d2t_disagrees_with_t2d(config, state):
    used, _, _ = draft_vocab()
    unused = int((~state["t2d"]).nonzero()[0])
    t2d = state["t2d"].clone()
    t2d[used[5]], t2d[unused] = False, True  # still Vd entries, but not the ids d2t maps to
    state["t2d"] = t2d


def _d2t_duplicates(config, state):
    del state["t2d"]
    state["d2t"] = -torch.arange(VD) + 3  # every draft id -> target id 3


def _vocab(config, state):
    config["vocab_size"] = 100
    state["t2d"] = torch.cat([state["t2d"], torch.zeros(4, dtype=torch.bool)])


def _target_width(config, state):
    config["target_hidden_size"] = 64
    state["fc.weight"] = torch.randn(H, 3 * 64)


def _second_layer(config, state):
    state.update(_layer(torch.Generator().manual_seed(9), "layers.1."))


MALFORMED = {
    # EAGLE-3
    "no_lm_head": (eagle3, _drop("lm_head.weight"), r"lm_head\.weight"),
    "no_d2t": (eagle3, _drop("d2t"), r"d2t"),
    "no_d2t_no_t2d": (eagle3, _drop("d2t", "t2d"), r"d2t"),
    "absolute_d2t": (eagle3, _absolute_d2t, r"d2t"),
    "d2t_vs_t2d": (eagle3, _d2t_disagrees_with_t2d, r"d2t|t2d"),
    "d2t_not_one_to_one": (eagle3, _d2t_duplicates, r"d2t"),
    "d2t_wrong_length": (eagle3, _set("d2t", torch.zeros(VD + 1, dtype=torch.long)), r"d2t"),
    "no_fc": (eagle3, _drop("fc.weight"), r"fc\.weight"),
    "fc_eagle1_width": (eagle3, _set("fc.weight", torch.randn(H, 2 * H)), r"fc\.weight"),
    "k_proj_over_h": (eagle3, _set("midlayer.self_attn.k_proj.weight", torch.randn(KV * D, H)), r"midlayer\.self_attn\.k_proj\.weight"),
    "lm_head_rows": (eagle3, _set("lm_head.weight", torch.randn(VD + 2, H)), r"lm_head\.weight"),
    "no_hidden_norm": (eagle3, _drop("midlayer.hidden_norm.weight"), r"midlayer\.hidden_norm\.weight"),
    "no_final_norm": (eagle3, _drop("norm.weight"), r"norm\.weight"),
    "target_width": (eagle3, _target_width, r"hidden size|width"),
    "vocab_v3": (eagle3, _vocab, r"vocabulary"),
    # EAGLE-1
    "down_proj_transposed": (eagle1, _set("layers.0.mlp.down_proj.weight", torch.randn(INTER, H)), r"layers\.0\.mlp\.down_proj\.weight"),
    "fc_bias_shape": (eagle1, _set("fc.bias", torch.randn(2 * H)), r"fc\.bias"),
    "embed_shape": (eagle1, _set("embed_tokens.weight", torch.randn(V, H + 1)), r"embed_tokens\.weight"),
    "no_q_proj": (eagle1, _drop("layers.0.self_attn.q_proj.weight"), r"q_proj"),
    "several_layers": (eagle1, _second_layer, r"layers\.1"),
    # speculators
    "norm_before_residual": (lambda: speculators(norm_before_residual=True), lambda c, s: None, r"norm_before_residual"),
    "speculators_eagle1": (lambda: speculators(speculators_model_type="eagle"), lambda c, s: None, r"speculators_model_type"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_checkpoint_is_refused(tmp_path, target, case):
    make, mutate, pattern = MALFORMED[case]
    config, state = make()
    mutate(config, state)
    directory = write(tmp_path / "h", config, state)
    with pytest.raises(LocalspecError, match=pattern):
        load_head(directory, target.config)


def test_hidden_size_mismatch_eagle1(tmp_path, target):
    config, state = eagle1(h=32)  # self-consistent head for a 32-wide target
    with pytest.raises(LocalspecError, match=r"hidden size|width") as err:
        load_head(write(tmp_path / "h", config, state), target.config)
    assert "32" in str(err.value) and "48" in str(err.value)


def test_vocab_mismatch_eagle1(tmp_path, target):
    config, state = eagle1(vocab=100)
    with pytest.raises(LocalspecError, match=r"vocabulary") as err:
        load_head(write(tmp_path / "h", config, state), target.config)
    assert "100" in str(err.value) and "96" in str(err.value)


def test_eagle3_wider_target_without_embedding_is_refused(tmp_path):
    wide = tiny_model("llama", layers=LAYERS, hidden=64)
    config, state = eagle3(h=H, ht=64, own_embed=False)
    with pytest.raises(LocalspecError, match=r"embed"):
        load_head(write(tmp_path / "h", config, state), wide.config)


def test_eagle3_needs_enough_target_layers(tmp_path):
    shallow = tiny_model("llama", layers=4, hidden=HT)
    config, state = eagle3()
    with pytest.raises(LocalspecError, match=r"layers"):
        load_head(write(tmp_path / "h", config, state), shallow.config)


def test_eagle3_aux_ids_beyond_target_are_refused(tmp_path, target):
    config, state = eagle3()
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}  # a 32-layer target's ids
    with pytest.raises(LocalspecError, match=r"layer"):
        load_head(write(tmp_path / "h", config, state), target.config)


def test_missing_files(tmp_path, target):
    config, state = eagle3()
    directory = write(tmp_path / "h", config, state)
    (directory / "config.json").unlink()
    with pytest.raises(LocalspecError, match=r"config\.json"):
        load_head(directory, target.config)
    directory = write(tmp_path / "w", config, state)
    (directory / "model.safetensors").unlink()
    with pytest.raises(LocalspecError, match=r"model\.safetensors|pytorch_model\.bin"):
        load_head(directory, target.config)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(LocalspecError, match=r"JSON"):
        load_head(directory, target.config)
    with pytest.raises(LocalspecError):
        load_head(tmp_path / "does-not-exist", target.config)


# --- 3. save_head round trip in the official layout ---------------------------------------------


def _round_trip(tmp_path, target, config, state):
    ckpt = load_head(write(tmp_path / "in", config, state), target.config)
    head = build_head(ckpt, target)
    save_head(head, tmp_path / "out", extras={"trained_by": "test"})
    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    saved_config = json.loads((tmp_path / "out" / "config.json").read_text())
    again = load_head(tmp_path / "out", target.config)
    assert again.config == ckpt.config
    assert_same_tensors(again.state, ckpt.state)
    head2 = build_head(again, target)
    assert_same_tensors(head2.state_dict(), head.state_dict())
    assert torch.equal(head2.embed, head.embed)
    return saved, saved_config


def test_round_trip_eagle3(tmp_path, target):
    config, state = eagle3()
    saved, saved_config = _round_trip(tmp_path, target, config, state)
    assert set(saved) == set(state)  # exactly the official key set: fc, midlayer.*, norm, lm_head, d2t, t2d
    assert not any(k.startswith("layers.") for k in saved) and "embed_tokens.weight" not in saved
    assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
    assert saved["t2d"].shape == (V,) and saved["d2t"].shape == (VD,)
    assert torch.equal(saved["t2d"].nonzero().flatten(), torch.arange(VD) + saved["d2t"])
    assert torch.equal(saved["t2d"], state["t2d"])
    for k in state:
        assert torch.equal(saved[k], state[k]), k
    assert saved_config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert saved_config["draft_vocab_size"] == VD and saved_config["vocab_size"] == V
    assert saved_config["tie_word_embeddings"] is False
    assert saved_config["localspec"] == {"trained_by": "test"}


@pytest.mark.parametrize("variant", [dict(fc_bias=True), dict(fc_bias=False, bias_in_config=False), dict(qkv_bias=True)])
def test_round_trip_eagle1(tmp_path, target, variant):
    config, state = eagle1(**variant)
    saved, saved_config = _round_trip(tmp_path, target, config, state)
    assert set(saved) == set(state)  # layers.0.*, fc, embed_tokens; no midlayer, norm or lm_head
    for k in state:
        assert torch.equal(saved[k], state[k]), k
    assert "lm_head.weight" not in saved and "norm.weight" not in saved
    assert saved_config.get("bias", True) == ("fc.bias" in state)
    assert not any("Eagle3" in a for a in saved_config.get("architectures", []))


def test_round_trip_speculators_as_official_eagle3(tmp_path, target):
    config, state = speculators()
    # speculators heads ship a frozen copy of the target's embedding
    state["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    saved, _ = _round_trip(tmp_path, target, config, state)
    assert any(k.startswith("midlayer.") for k in saved) and not any(k.startswith("layers.") for k in saved)


# --- 4. the forward pass against the published formulas ------------------------------------------


def _rms(x, w, eps=EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta=THETA):
    """Llama rotary embedding, half-split pairs (i, i + d/2). x (T, d), pos (T,)."""
    d = x.shape[-1]
    half = d // 2
    freq = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * freq[None]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[:, :half], x[:, half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _attention(x, w, p, pos, *, heads=HEADS, kv=KV, d=D):
    """Causal GQA attention, one sequence: x (T, in) -> (T, h)."""
    def proj(name):
        y = x @ w[p + f"self_attn.{name}.weight"].T
        bias = w.get(p + f"self_attn.{name}.bias")
        return y if bias is None else y + bias
    q, k, v = proj("q_proj"), proj("k_proj"), proj("v_proj")
    t = x.shape[0]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    outs = []
    for i in range(heads):
        g = i // (heads // kv)  # query head i reads KV head i // (heads / kv)
        qi = _rope(q[:, i * d:(i + 1) * d], pos)
        ki = _rope(k[:, g * d:(g + 1) * d], pos)
        scores = (qi @ ki.T / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        outs.append(torch.softmax(scores, dim=-1) @ v[:, g * d:(g + 1) * d])
    return torch.cat(outs, dim=-1) @ w[p + "self_attn.o_proj.weight"].T


def _mlp_block(y, w, p):
    z = _rms(y, w[p + "post_attention_layernorm.weight"])
    return y + (F.silu(z @ w[p + "mlp.gate_proj.weight"].T) * (z @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T


def ref_eagle3(w, embed, feats, tokens, pos, *, fed_back=False):
    """Section 2: g = fc(feats) (skipped for the head's own h-wide output); x = cat(input_layernorm(emb),
    hidden_norm(g)); y = g + attn(x); out = y + mlp(post_norm(y)); logits = lm_head(norm(out))."""
    p = "midlayer."
    g = feats if fed_back else feats @ w["fc.weight"].T
    x = torch.cat([_rms(embed[tokens], w[p + "input_layernorm.weight"]), _rms(g, w[p + "hidden_norm.weight"])], dim=-1)
    out = _mlp_block(g + _attention(x, w, p, pos), w, p)
    return out, _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


def ref_eagle1(w, embed, lm_head, feats, tokens, pos):
    """Section 2: x = fc(cat(embed(tok), f)); one Llama layer without input norm; logits = target lm_head(out)."""
    p = "layers.0."
    x = torch.cat([embed[tokens], feats], dim=-1) @ w["fc.weight"].T
    if "fc.bias" in w:
        x = x + w["fc.bias"]
    out = _mlp_block(x + _attention(x, w, p, pos), w, p)
    return out, out @ lm_head.T


def _double(state):
    return {k: v.double() if v.is_floating_point() else v for k, v in state.items()}


def _close(got, want):
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def test_eagle3_forward_matches_formula(tmp_path, target):
    config, state = eagle3(seed=3)
    head = build_head(load_head(write(tmp_path / "h", config, state), target.config), target)
    w = _double(state)
    embed = target.get_input_embeddings().weight.double()
    ids = torch.tensor([[5, 17, 60, 2, 33, 91, 40]])
    hs = target(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in head.cfg.aux_layers], dim=-1)  # (1, T, 3Ht): real target features
    tokens = torch.tensor([[17, 60, 2, 33, 91, 40, 8]])
    pos = torch.arange(3, 3 + ids.shape[1])  # not starting at 0, so RoPE matters everywhere

    out, k, v = head(feats, tokens, pos[None])
    ref_out, ref_logits = ref_eagle3(w, embed, feats[0].double(), tokens[0], pos)
    _close(out[0], ref_out)
    _close(head.logits(out)[0], ref_logits)
    assert torch.equal(head.to_target_ids(head.logits(out).argmax(-1)), draft_vocab(3)[0][ref_logits.argmax(-1)][None])

    # drafting ahead: the pre-norm output goes back in and fc is skipped
    out2, _, _ = head(out, tokens, pos[None])
    _close(out2[0], ref_eagle3(w, embed, out[0].double(), tokens[0], pos, fed_back=True)[0])

    # the cache: a prefix, then the rest over its keys, equals one pass
    a, ka, va = head(feats[:, :3], tokens[:, :3], pos[None, :3])
    b, _, _ = head(feats[:, 3:], tokens[:, 3:], pos[None, 3:], past_k=ka, past_v=va)
    _close(torch.cat([a, b], dim=1)[0], ref_out)
    torch.testing.assert_close(torch.cat([ka, k[:, :, 3:]], dim=2), k)


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_eagle1_forward_matches_formula(tmp_path, target, qkv_bias):
    config, state = eagle1(seed=4, qkv_bias=qkv_bias)
    head = build_head(load_head(write(tmp_path / "h", config, state), target.config), target)
    w = _double(state)
    ids = torch.tensor([[5, 17, 60, 2, 33, 91]])
    feats = target(ids, output_hidden_states=True).hidden_states[-1]  # final, normed: lm_head's input
    tokens = torch.tensor([[17, 60, 2, 33, 91, 40]])
    pos = torch.arange(2, 2 + ids.shape[1])

    out, _, _ = head(feats, tokens, pos[None])
    ref_out, ref_logits = ref_eagle1(w, w["embed_tokens.weight"], target.lm_head.weight.double(), feats[0].double(), tokens[0], pos)
    _close(out[0], ref_out)
    torch.testing.assert_close(head.logits(out)[0].double(), ref_logits, rtol=1e-4, atol=1e-3)
    assert isinstance(head.cfg, HeadConfig)
