"""Tiny random-weight models of two architectures and a character tokenizer, built in-process."""

from __future__ import annotations

import os

# Triton picks interpreter or GPU when it is first imported (transformers imports it): the kernel
# tests run under the interpreter unless a GPU run asks otherwise with TRITON_INTERPRET=0.
os.environ.setdefault("TRITON_INTERPRET", "1")
# a resident engine the developer left running answers none of the tests' prompts (tests/test_resident.py asks for one)
os.environ["LOCALSPEC_DAEMON"] = "0"

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96
PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8, 40, 41, 42, 5, 6, 7]
"""A prompt with repeats, so prompt lookup finds matches."""
GLANCE_CHARACTERS = 60
"""The most a short reason (the weights, the proposer) may take of the first line a person reads."""


def assert_at_a_glance(short: str) -> None:
    """A short form of a reason: one line of a few words, no parentheses (those are the full form's)."""
    assert short.strip() and "\n" not in short, repr(short)
    assert len(short) <= GLANCE_CHARACTERS and not {"(", ")"} & set(short), short


def tiny_model(arch: str = "llama", seed: int = 0, vocab: int = VOCAB, layers: int = 2, hidden: int = 48):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama" else Qwen2ForCausalLM(Qwen2Config(**common)))
    # random init gives near-uniform logits; sharper ones make greedy runs repeat like real text
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval().requires_grad_(False)


def quantized_as_loaded(model, quant: str):
    """`model` with its linears in `quant` (int4, int8, w8a8, w4a8), in the steps the loader takes."""
    from localspec.runtime import quant as quantization

    quantization.quantize_model(model, quant, torch.device("cpu"))
    model.to(quantization.COMPUTE_DTYPE)
    if quant == "w8a8":
        quantization.quantize_activations(model)
    if quant == "w4a8":
        quantization.use_w4a8(model, None)
    return model


def tiny_tokenizer():
    """A real transformers tokenizer of the same characters as CharTokenizer (one token each), for
    code that saves or loads tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(32 + i): i for i in range(95)} | {"<unk>": 95}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def byte_tokenizer(chars: str = "".join(chr(32 + i) for i in range(95)), chat_template: str | None = None):
    """A real fast tokenizer with a byte-level decoder (what the grammar library reads): each of
    `chars` one token, in order (the default: CharTokenizer's ids, id = ord(c) - 32), then "</s>",
    the EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_level = _bytes_to_unicode()
    vocab = {byte_level[ord(c)]: i for i, c in enumerate(chars)} | {"</s>": len(chars)}
    backend = Tokenizer(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")
    tokenizer.chat_template = chat_template
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the character its byte-level tokens spell it with."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {b: chr(b) for b in kept} | {b: chr(256 + i) for i, b in enumerate(moved)}


class CharTokenizer:
    """Printable ASCII as token ids (id = ord(c) - 32); id 0 (space) ... 94 ('~'), 95 = EOS."""

    eos_token_id = 95
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [min(max(ord(c) - 32, 0), 94) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 32) for i in ids if i != self.eos_token_id)


@pytest.fixture(params=["llama", "qwen2"])
def arch(request):
    return request.param


def hf_greedy(model, prompt: list[int], n: int, **options) -> list[int]:
    """transformers' own greedy decoding, one token per step, on the model as the engine runs it:
    the row-exact attention (see localspec/attention.py), and the cache filled with every prompt
    token but the last in one prompt pass (quant.prompt_pass), as the engine's prefill does.
    `options` go to `generate` (none: exactly n tokens)."""
    from localspec.runtime.attention import use_exact_attention
    from localspec.runtime.kv import KVCache
    from localspec.runtime.quant import prompt_pass

    use_exact_attention(model)
    kv = KVCache()
    with torch.no_grad(), prompt_pass():
        model(input_ids=torch.tensor([prompt[:-1]]), cache=kv.cache, use_cache=True, logits_to_keep=1)
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=kv.cache, do_sample=False,
                         max_new_tokens=n, **(options or {"min_new_tokens": n}))
    return out[0, len(prompt):].tolist()


CODE_PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def assert_speculation_reproduces_greedy(loaded, n: int = 32) -> list[int]:
    """A real loaded model: prompt lookup and a self-draft, verified by the engine, give exactly
    this model's own greedy tokens for CODE_PROMPT; returns the prompt ids."""
    from localspec.base.config import GenerationLimits, SpecConfig
    from localspec.core.engine import Engine
    from localspec.core.proposers import DraftModelProposer, NgramProposer

    ids = loaded.tokenizer(CODE_PROMPT, return_tensors="pt").input_ids[0].tolist()
    expected = hf_greedy(loaded.model, ids, n)
    for proposer in (NgramProposer(), DraftModelProposer(loaded.model)):
        engine = Engine(loaded.model, None, proposer, SpecConfig(draft_len=6))
        out = [p.token_id for ev in engine.generate(ids, limits=GenerationLimits(n)) for p in ev.pieces]
        assert out == expected, proposer
    return ids
