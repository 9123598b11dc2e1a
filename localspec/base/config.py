"""Frozen settings for sampling and speculation, and where localspec keeps its files.

No torch import here: the CLI validates options before anything heavy loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from localspec.base.errors import LocalspecError

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTS = ("auto", "none", "int8", "int4", "w8a8", "w4a8", "nf4")
DRAFT_QUANTS = ("auto", "none", "int8", "int4", "w8a8", "w4a8")
NGRAM_LIMIT = 64
"""Longest suffix prompt lookup may try (--ngram-max)."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    """0 means greedy: the output is the target's own argmax sequence."""
    top_k: int = 0
    """Keep only the k most likely tokens before sampling; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches p; 1.0 keeps all."""
    seed: int | None = None
    """Seed for the sampler's generator; None draws a fresh one."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise LocalspecError(f"--temperature must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            raise LocalspecError(f"--top-k must be 0 (off) or a positive integer, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise LocalspecError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not (0 <= self.seed < 2**64):  # what torch.Generator takes
            raise LocalspecError(f"--seed must be between 0 and 2**64 - 1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpecConfig:
    proposer: str = "auto"
    """auto, or a name in localspec.store.proposer_catalog (checked there when a session resolves it: that
    table sits above this module)."""
    draft_len: int | None = None
    """Fixed number of drafted tokens per pass; None lets the measured cost model choose each pass."""
    max_draft_len: int = 15
    """Upper bound for the adaptive policy (verify widths are calibrated up to this + 1)."""
    ngram_min: int = 1
    """Shortest suffix the n-gram proposer will match."""
    ngram_max: int = 4
    """Longest suffix the n-gram proposer tries first."""
    draft_quant: str = "auto"
    """auto | none | int8 | int4 | w8a8: the draft model's weights; auto picks the fastest measured step.
    Only the guesses change, never the output."""
    tree_top_k: int = 8
    """EAGLE: children kept per expanded node and nodes expanded per level."""
    tree_nodes: int | None = None
    """EAGLE: fixed tree size; None sizes each tree from the measured verify cost per width."""
    tree_depth: int | None = None
    """EAGLE: fixed depth; None drafts a level only while it pays for its head step."""
    history: bool = True
    """Suffix decoding (the proposer, and the lookup a model proposer carries) also guesses from this
    model's earlier conversations here, and keeps each finished one; False: neither read nor written."""
    context: tuple[str, ...] = ()
    """Files and folders whose text suffix decoding also guesses from (`--context`), for the session."""
    lookup: bool = True
    """Model proposers (draft, EAGLE) also offer suffix decoding's likeliest guess in the same verify
    pass, and skip their own drafting when the lookup alone is expected to pay more. Output is unchanged."""
    quant: str = "auto"
    """auto | none | int8 | int4 | w8a8 | w4a8 | nf4: the target's weights. Output is exact relative
    to the target as loaded; auto takes w4a8 for a 4-bit published model on an x86 CPU that builds
    localspec's kernel, else w8a8 on a CPU that multiplies int8 exactly, else keeps a 4-bit
    published model 4-bit, else quantizes only to fit memory."""

    def __post_init__(self) -> None:
        if self.draft_len is not None and not (0 <= self.draft_len <= 64):
            raise LocalspecError(f"--draft-len must be between 0 and 64, got {self.draft_len}")
        if not (1 <= self.max_draft_len <= 64):
            raise LocalspecError(f"max draft length must be between 1 and 64, got {self.max_draft_len}")
        if self.draft_quant not in DRAFT_QUANTS:
            raise LocalspecError(f"--draft-quant must be one of {', '.join(DRAFT_QUANTS)}, got {self.draft_quant!r}")
        if not (1 <= self.tree_top_k <= 64):
            raise LocalspecError(f"--tree-top-k must be between 1 and 64, got {self.tree_top_k}")
        if self.tree_nodes is not None and not (1 <= self.tree_nodes <= 256):
            raise LocalspecError(f"--tree-nodes must be between 1 and 256, got {self.tree_nodes}")
        if self.tree_depth is not None and not (1 <= self.tree_depth <= 32):
            raise LocalspecError(f"--tree-depth must be between 1 and 32, got {self.tree_depth}")
        if any(q.strip() not in QUANTS for q in self.quant.split(",")):
            raise LocalspecError(f"--quant must be one of {', '.join(QUANTS)} (bench: a comma list), got {self.quant!r}")
        # each size tried costs a pass over the whole context: beyond a few dozen it is work
        # that almost never finds a longer match
        if not (1 <= self.ngram_min <= self.ngram_max <= NGRAM_LIMIT):
            raise LocalspecError(
                f"n-gram sizes need 1 <= min <= max <= {NGRAM_LIMIT}, got min={self.ngram_min} max={self.ngram_max}"
            )


@dataclass(frozen=True)
class GenerationLimits:
    max_new_tokens: int = 512
    """Stop after this many generated tokens."""
    stop: tuple[str, ...] = ()
    """Stop as soon as the text contains one of these strings (it is cut before the string)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise LocalspecError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if any(s == "" for s in self.stop):
            raise LocalspecError("a stop string must not be empty")


def eagle_head_dir(model: str) -> Path:
    """Where `localspec train-eagle` puts the head it trains for `model` (and where auto looks)."""
    return home_dir() / "heads" / model


def has_eagle_head(model: str) -> bool:
    folder = eagle_head_dir(model)
    return (folder / "config.json").is_file() and any((folder / f).is_file() for f in ("model.safetensors", "pytorch_model.bin"))


def home_dir() -> Path:
    """Root of localspec's files: $LOCALSPEC_HOME, else $XDG_CACHE_HOME/localspec, else ~/.cache/localspec."""
    if os.environ.get("LOCALSPEC_HOME"):
        return Path(os.environ["LOCALSPEC_HOME"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "localspec"
