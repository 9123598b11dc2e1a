"""EAGLE draft heads: one decoder layer that drafts from the target's own hidden states.

Two published shapes share this module (names follow the official checkpoints, see
`load_head` / `save_head` for the key layouts):
- EAGLE-1/2: x = fc(cat(embed(token), f)) where f is the target's final (normed) hidden state; one
  Llama layer without input norm; logits = the target's own lm_head over the full vocabulary.
- EAGLE-3: g = fc(cat(h_low, h_mid, h_high)), the residual stream entering target layers 2, L//2,
  L-3; x = cat(input_layernorm(embed(token)), hidden_norm(g)) (width 2h) into the attention; own
  final `norm` and `lm_head` over a reduced draft vocabulary, mapped back with the offset table
  d2t (target id = draft id + d2t[draft id]).
Either way position t reads (feature of token t, token t+1) and predicts token t+2; the layer's
pre-norm output replaces the feature when the head drafts further ahead on its own guesses.

The attention is plain torch with an explicit boolean mask over explicit past keys, so the same
code serves the sequential draft cache, the EAGLE-2 tree (siblings share a position) and the
unrolled training-time test (each step sees the real context plus its own earlier steps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from localspec.base.errors import LocalspecError, first_line
from localspec.runtime.quant import dense_weight


@dataclass(frozen=True)
class HeadConfig:
    version: int
    """1 (EAGLE-1/2 layout: also drives EAGLE-2 trees) or 3 (EAGLE-3 layout)."""
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    """The target's vocabulary V."""
    draft_vocab_size: int
    """Rows of the head's own lm_head (EAGLE-3); V for EAGLE-1."""
    aux_layers: tuple[int, ...]
    """Target hidden_states indices the head reads (index 0 = embedding output; EAGLE-3: the
    inputs of layers 2, L//2, L-3). EAGLE-1 reads the final normed state: empty tuple."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    fc_bias: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 32768

    @property
    def feature_width(self) -> int:
        return self.target_hidden_size * max(len(self.aux_layers), 1)

    @classmethod
    def for_target(cls, target_config, version: int = 3, draft_vocab_size: int | None = None,
                   intermediate_size: int | None = None) -> "HeadConfig":
        """A head shaped after the target's own layers (what train-eagle builds)."""
        text = getattr(target_config, "text_config", None) or target_config
        layers = text.num_hidden_layers
        if version == 3 and layers < 6:
            raise LocalspecError(f"EAGLE-3 reads target layers 2, L//2 and L-3: the target has only {layers} layers")
        heads = text.num_attention_heads
        return cls(
            version=version,
            hidden_size=text.hidden_size,
            target_hidden_size=text.hidden_size,
            intermediate_size=intermediate_size or text.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            vocab_size=text.vocab_size,
            draft_vocab_size=(draft_vocab_size or text.vocab_size) if version == 3 else text.vocab_size,
            aux_layers=(2, layers // 2, layers - 3) if version == 3 else (),
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(text),
            max_position_embeddings=getattr(text, "max_position_embeddings", 32768),
        )


def _rope_theta(config) -> float:
    theta = getattr(config, "rope_theta", None)
    if theta is None:  # transformers 5 keeps it in rope_parameters
        params = getattr(config, "rope_parameters", None) or {}
        theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta or 10000.0)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's half-split form). x (B, H, T, d), positions (B, T)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # (d/2,)
    angles = positions.float()[..., None] * inv_freq  # (B, T, d/2)
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # (B, 1, T, d)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig, in_width: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(in_width, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(in_width, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(in_width, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, positions, past_k, past_v, mask):
        """x (B, T, in), positions (B, T), past_k/v (B, Hkv, S, d) or None, mask (B, T, S+T) bool
        (True = may attend) -> out (B, T, h), new k and v (B, Hkv, T, d)."""
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)  # (B, H, T, d)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, d)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta)
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)  # (B, Hkv, S+T, d)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        groups = c.num_heads // c.num_kv_heads
        keys = keys.repeat_interleave(groups, dim=1)  # (B, H, S+T, d)
        values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])  # (B, H, T, d)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k, v


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        if cfg.version == 3:
            self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * h if cfg.version == 3 else h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class EagleHead(nn.Module):
    """The draft head. `embed` is the target's token embedding (frozen, not saved for EAGLE-3);
    `target_lm_head` is the target's output matrix, which EAGLE-1 heads use as theirs."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, target_lm_head: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        fc_in = cfg.feature_width if cfg.version == 3 else h + cfg.target_hidden_size
        self.fc = nn.Linear(fc_in, h, bias=cfg.fc_bias)
        self.midlayer = MidLayer(cfg)
        self.register_buffer("embed", embed.detach(), persistent=False)  # (V, Ht)
        if cfg.version == 3:
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        else:
            if target_lm_head is None:
                raise LocalspecError("an EAGLE-1 head needs the target's lm_head")
            self.register_buffer("target_lm_head", target_lm_head.detach(), persistent=False)  # (V, h)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def forward(self, hidden, tokens, positions, past_k=None, past_v=None, mask=None):
        """One pass of the layer.

        hidden (B, T, feature_width) target features, or (B, T, h) the head's own earlier output;
        tokens (B, T) the token that follows each feature; positions (B, T); past_k/v the head's
        cache (B, Hkv, S, d); mask (B, T, S+T) bool, None = causal over the T new positions.
        Returns out (B, T, h) (pre-norm: fed back when drafting further), k, v (B, Hkv, T, d).
        """
        layer = self.midlayer
        emb = F.embedding(tokens, self.embed).to(self.dtype)  # (B, T, Ht)
        hidden = hidden.to(self.dtype)
        if self.cfg.version == 3:
            g = self.fc(hidden) if hidden.shape[-1] != self.cfg.hidden_size else hidden  # (B, T, h)
            x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(g)], dim=-1)  # (B, T, 2h)
        else:
            g = self.fc(torch.cat([emb, hidden], dim=-1))  # (B, T, h)
            x = g
        if mask is None:
            s = 0 if past_k is None else past_k.shape[2]
            t = tokens.shape[1]
            mask = torch.ones(t, s + t, dtype=torch.bool, device=tokens.device).tril(s)[None].expand(tokens.shape[0], -1, -1)
        attn, k, v = layer.self_attn(x, positions, past_k, past_v, mask)
        y = g + attn  # (B, T, h)
        y = y + layer.mlp(layer.post_attention_layernorm(y))
        return y, k, v

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """(..., h) -> (..., Vd) draft-vocabulary logits (Vd = V for EAGLE-1)."""
        if self.cfg.version == 3:
            return self.lm_head(self.norm(out))
        return F.linear(out, self.target_lm_head.to(out.dtype))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.version == 3:
            return draft_ids + self.d2t[draft_ids]
        return draft_ids


# -- checkpoints ----------------------------------------------------------------------------------

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"


@dataclass
class HeadCheckpoint:
    config: HeadConfig
    state: dict[str, torch.Tensor]
    """Weights under this module's names (fc.*, midlayer.*, norm.*, lm_head.*, d2t)."""
    layout: str
    """"eagle1", "eagle3" or "speculators": which published layout the files were in."""
    embed: torch.Tensor | None = None
    """The head's own embedding, when the checkpoint carries one."""


def load_weights_only(path: Path, what: str, remedy: str):
    """A torch file through torch's weights-only loader: tensors, numbers, lists and dicts only, so
    a planted file cannot run code; a refused, damaged or foreign one is one line naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        # torch's own message for a refused object suggests weights_only=False: never said here
        refused = "Weights only load failed" in str(exc)
        reason = "not only tensors and numbers: refused, as loading it could run code" if refused else first_line(exc)
        raise LocalspecError(f"{path} cannot be read as {what} ({reason}); {remedy}") from exc


def _read_state(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / WEIGHTS_NAME).exists():
        from safetensors.torch import load_file

        return load_file(str(directory / WEIGHTS_NAME))
    if (directory / LEGACY_WEIGHTS_NAME).exists():
        return load_weights_only(directory / LEGACY_WEIGHTS_NAME, "an EAGLE head", "download or train it again")
    raise LocalspecError(f"{directory}: no {WEIGHTS_NAME} or {LEGACY_WEIGHTS_NAME} (not an EAGLE head directory)")


def _layer_prefix(state: dict[str, torch.Tensor]) -> str:
    layers = sorted({k.split(".")[1] for k in state if k.startswith("layers.")})
    if any(k.startswith("midlayer.") for k in state):
        if layers:
            raise LocalspecError("the checkpoint has both midlayer.* and layers.* tensors: which one is the draft layer?")
        return "midlayer."
    if layers and layers != ["0"]:
        raise LocalspecError(f"the checkpoint has draft layers {', '.join('layers.' + n for n in layers)}; only single-layer heads (layers.0) are supported")
    if layers:
        return "layers.0."
    raise LocalspecError("the checkpoint has no draft layer: expected midlayer.* (EAGLE-3) or layers.0.* (EAGLE-1 / speculators)")


def _need(state: dict[str, torch.Tensor], key: str, shape: tuple[int, ...] | None = None, what: str = "") -> torch.Tensor:
    if key not in state:
        raise LocalspecError(f"the EAGLE head is missing tensor '{key}'{' (' + what + ')' if what else ''}")
    tensor = state[key]
    if shape is not None and tuple(tensor.shape) != shape:
        raise LocalspecError(f"tensor '{key}' has shape {tuple(tensor.shape)}, expected {shape}{' (' + what + ')' if what else ''}")
    return tensor


def _target_sizes(target_config) -> tuple[int, int, int]:
    text = getattr(target_config, "text_config", None) or target_config
    return text.hidden_size, text.vocab_size, text.num_hidden_layers


def load_head(directory: str | Path, target_config) -> HeadCheckpoint:
    """Read a published head (EAGLE-1/2, EAGLE-3, or speculators' eagle3) and check it against the
    target strictly: a missing or mis-shaped tensor is an error naming it, never random weights."""
    directory = Path(directory)
    try:
        raw = json.loads((directory / CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise LocalspecError(f"{directory}: no {CONFIG_NAME} (not an EAGLE head directory)") from None
    except json.JSONDecodeError as exc:
        raise LocalspecError(f"{directory / CONFIG_NAME}: not valid JSON ({exc})") from None
    state = _read_state(directory)
    target_hidden, target_vocab, target_layers = _target_sizes(target_config)
    layout_cfg = raw.get("transformer_layer_config") or raw  # speculators nest the layer config
    prefix = _layer_prefix(state)
    speculators = "speculators_model_type" in raw
    if speculators and raw["speculators_model_type"] != "eagle3":
        raise LocalspecError(f"speculators_model_type {raw['speculators_model_type']!r} is not supported (only 'eagle3')")
    if raw.get("norm_before_residual") or layout_cfg.get("norm_before_residual"):
        # the residual would be hidden_norm(g), not g: EagleHead does not implement that variant
        raise LocalspecError("norm_before_residual: true heads are not supported (the residual would be the normed feature)")
    is_v3 = (
        speculators
        or prefix == "midlayer."
        or any("Eagle3" in a for a in raw.get("architectures", []))
        or f"{prefix}hidden_norm.weight" in state
    )
    layout = "speculators" if speculators else ("eagle3" if is_v3 else "eagle1")
    version = 3 if is_v3 else 1

    h = int(layout_cfg.get("hidden_size", 0)) or int(_need(state, f"{prefix}post_attention_layernorm.weight").shape[0])
    heads = int(layout_cfg.get("num_attention_heads", 0))
    if not heads:
        raise LocalspecError(f"{directory / CONFIG_NAME}: num_attention_heads is missing")
    q = _need(state, f"{prefix}self_attn.q_proj.weight", what="attention query")
    head_dim = q.shape[0] // heads  # the config's head_dim is not trustworthy; the weights are
    if q.shape[0] % heads:
        raise LocalspecError(f"q_proj has {q.shape[0]} rows, not a multiple of num_attention_heads={heads}")
    k = _need(state, f"{prefix}self_attn.k_proj.weight", what="attention key")
    kv_heads = k.shape[0] // head_dim
    vocab = int(raw.get("vocab_size") or layout_cfg.get("vocab_size") or target_vocab)
    if vocab != target_vocab:
        raise LocalspecError(f"the head is for a vocabulary of {vocab} tokens; the target has {target_vocab}")
    ht = int(raw.get("target_hidden_size") or layout_cfg.get("target_hidden_size") or h)
    if ht != target_hidden:
        raise LocalspecError(f"the head reads target features of width {ht}; the target's hidden size is {target_hidden}")
    if version == 3:
        aux = raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or raw.get("eagle_aux_hidden_state_layer_ids")
        # published ids are "output of layer i" = hidden_states[i + 1]
        if not aux and target_layers < 6:
            raise LocalspecError(f"EAGLE-3 reads target layers 2, L//2 and L-3: the target has only {target_layers} layers")
        aux_layers = tuple(int(i) + 1 for i in aux) if aux else (2, target_layers // 2, target_layers - 3)
        if any(not 0 <= i < target_layers for i in aux_layers):
            raise LocalspecError(f"the head reads the inputs of target layers {list(aux_layers)}; the target has {target_layers} layers")
    else:
        aux_layers = ()
    intermediate = _need(state, f"{prefix}mlp.gate_proj.weight", what="MLP").shape[0]
    draft_vocab = int(raw.get("draft_vocab_size") or layout_cfg.get("draft_vocab_size") or vocab) if version == 3 else vocab
    cfg = HeadConfig(
        version=version, hidden_size=h, target_hidden_size=ht, intermediate_size=intermediate,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, vocab_size=vocab,
        draft_vocab_size=draft_vocab, aux_layers=aux_layers,
        rms_norm_eps=float(layout_cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(layout_cfg.get("rope_theta") or (layout_cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        fc_bias="fc.bias" in state, qkv_bias=f"{prefix}self_attn.q_proj.bias" in state,
        max_position_embeddings=int(layout_cfg.get("max_position_embeddings", 32768)),
    )
    fc_in = cfg.feature_width if version == 3 else h + ht
    out: dict[str, torch.Tensor] = {"fc.weight": _need(state, "fc.weight", (h, fc_in), "feature projection")}
    if cfg.fc_bias:
        out["fc.bias"] = _need(state, "fc.bias", (h,))
    attn_in = 2 * h if version == 3 else h
    shapes = {
        "self_attn.q_proj.weight": (heads * head_dim, attn_in),
        "self_attn.k_proj.weight": (kv_heads * head_dim, attn_in),
        "self_attn.v_proj.weight": (kv_heads * head_dim, attn_in),
        "self_attn.o_proj.weight": (h, heads * head_dim),
        "mlp.gate_proj.weight": (intermediate, h),
        "mlp.up_proj.weight": (intermediate, h),
        "mlp.down_proj.weight": (h, intermediate),
        "post_attention_layernorm.weight": (h,),
    }
    if cfg.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (heads * head_dim,), "self_attn.k_proj.bias": (kv_heads * head_dim,),
                       "self_attn.v_proj.bias": (kv_heads * head_dim,)})
    if version == 3:
        shapes.update({"input_layernorm.weight": (h,), "hidden_norm.weight": (h,)})
    for name, shape in shapes.items():
        out[f"midlayer.{name}"] = _need(state, prefix + name, shape)
    if version == 3:
        out["norm.weight"] = _need(state, "norm.weight", (h,), "the head's final norm")
        out["lm_head.weight"] = _need(state, "lm_head.weight", (draft_vocab, h), "the head's own output layer")
        if draft_vocab == vocab and "d2t" not in state:
            out["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)  # identity mapping
        else:
            d2t = _need(state, "d2t", (draft_vocab,), "draft -> target token offsets").long()
            target_ids = torch.arange(draft_vocab) + d2t
            if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
                raise LocalspecError("tensor 'd2t' maps draft tokens outside the target vocabulary (is it an offset table?)")
            if target_ids.unique().numel() != draft_vocab:
                raise LocalspecError("tensor 'd2t' maps several draft tokens to the same target token (is it an offset table?)")
            if "t2d" in state:
                t2d = _need(state, "t2d", (vocab,), "target -> draft token mask")
                if not torch.equal(t2d.bool().nonzero().flatten(), target_ids.sort().values):
                    raise LocalspecError("tensors 'd2t' and 't2d' disagree: nonzero(t2d) != arange(draft_vocab_size) + d2t")
            out["d2t"] = d2t
    embed = state.get("embed_tokens.weight")  # the head's token embedding is h wide (fc / input_layernorm input)
    if embed is not None and tuple(embed.shape) != (vocab, h):
        raise LocalspecError(f"tensor 'embed_tokens.weight' has shape {tuple(embed.shape)}, expected {(vocab, h)}")
    if embed is None and ht != h:
        raise LocalspecError(f"the head's width {h} differs from the target's {ht}, so it must ship its own "
                             "'embed_tokens.weight' (the target's embedding does not fit)")
    return HeadCheckpoint(cfg, out, layout, embed)


def build_head(checkpoint: HeadCheckpoint, target: torch.nn.Module, dtype: torch.dtype | None = None) -> EagleHead:
    """The head, with the target's embedding (or its own) and, for EAGLE-1, the target's lm_head."""
    embed = checkpoint.embed if checkpoint.embed is not None else dense_weight(target.get_input_embeddings())
    if embed.shape[-1] != checkpoint.config.hidden_size:
        raise LocalspecError(f"the head needs a token embedding of width {checkpoint.config.hidden_size}; "
                             f"the target's is {embed.shape[-1]} wide and the checkpoint has none of its own")
    lm_head = dense_weight(target.get_output_embeddings()).float() if checkpoint.config.version == 1 else None
    head = EagleHead(checkpoint.config, embed, lm_head)
    head.load_state_dict(checkpoint.state, strict=True)
    head.requires_grad_(False)
    head.to(dtype or torch.float32).eval()
    head.embed = embed.detach()  # shared with the target, not a converted copy: a lookup reads a few rows
    return head


def head_config_json(cfg: HeadConfig) -> dict:
    """The config.json published heads carry, plus the fields this module needs to reload exactly."""
    common = {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if cfg.version == 3:
        return {
            **common,
            "architectures": ["LlamaForCausalLMEagle3"],
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layers],
                "use_aux_hidden_state": True,
            },
        }
    return {**common, "architectures": ["LlamaForCausalLM"], "bias": cfg.fc_bias, "qkv_bias": cfg.qkv_bias}


def save_head(head: EagleHead, directory: str | Path, extras: dict | None = None) -> None:
    """Write the head in the official layout of its version (config.json + model.safetensors):
    EAGLE-3 as midlayer.* with d2t/t2d, EAGLE-1 as layers.0.* with its embedding copy."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = head.cfg
    state = {k: v.detach().float().contiguous() if v.is_floating_point() else v.contiguous() for k, v in head.state_dict().items()}
    if cfg.version == 3:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"]] = True
        state["t2d"] = t2d
        if cfg.target_hidden_size != cfg.hidden_size:  # the target's embedding does not fit: ship the head's own
            state["embed_tokens.weight"] = head.embed.detach().float().contiguous()
    else:
        state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
        state["embed_tokens.weight"] = head.embed.detach().float().contiguous()
    config = head_config_json(cfg)
    if extras:
        config["localspec"] = extras
    tmp = directory / (WEIGHTS_NAME + ".partial")
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(directory / WEIGHTS_NAME)
    (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")


def describe(cfg: HeadConfig) -> str:
    params = cfg.hidden_size * (cfg.feature_width if cfg.version == 3 else 2 * cfg.hidden_size)
    params += 3 * cfg.hidden_size * cfg.intermediate_size
    params += cfg.draft_vocab_size * cfg.hidden_size if cfg.version == 3 else 0
    return f"EAGLE-{cfg.version} head, {params / 1e6:.0f}M parameters, draft vocabulary {cfg.draft_vocab_size}"

