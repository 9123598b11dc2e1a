"""The timing half of scripts/gpu_check.sh: pass costs on the GPU, as JSON on stdout.

For the default pair's shapes (Qwen2.5-Coder 1.5B target, 0.5B draft) and a published 8B shape
(Llama-3.1-8B), with random bf16 weights (a lent GPU reaches no hub): seconds of a 1-token and a
16-token pass after 128 and 1024 cached tokens, with the row-exact attention generation uses and
with SDPA beside it (what row-by-row costs in launches), and plain decoding's tokens per second
through the engine.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from localspec.attention import use_exact_attention
from localspec.config import GenerationLimits
from localspec.costs import time_forward
from localspec.engine import Engine

SHAPES = {
    "qwen2.5-coder-1.5b": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                                               num_attention_heads=12, num_key_value_heads=2, vocab_size=151936)),
    "qwen2.5-coder-0.5b": (Qwen2Config, Qwen2ForCausalLM, dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                                               num_attention_heads=14, num_key_value_heads=2, vocab_size=151936)),
    "llama-3.1-8b": (LlamaConfig, LlamaForCausalLM, dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)),
}


def random_model(name: str) -> torch.nn.Module:
    config_class, model_class, shape = SHAPES[name]
    config = config_class(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return model_class._from_config(config, dtype=torch.bfloat16).eval().requires_grad_(False)


def main() -> None:
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda, "models": {}}
    for name in SHAPES:
        started = time.perf_counter()
        model = random_model(name)
        row = {"build_seconds": round(time.perf_counter() - started, 1)}
        for attention in ("sdpa", "exact"):
            if attention == "exact":
                use_exact_attention(model)
            for context in (128, 1024):
                costs = time_forward(model, (1, 16), repeats=3, context=context)
                row[f"{attention}|context={context}"] = {w: round(s * 1000, 2) for w, s in costs.items()}  # ms
        engine = Engine(model, None, None)
        prompt = list(range(100, 228))
        started = time.perf_counter()
        produced = sum(len(ev.pieces) for ev in engine.generate(prompt, limits=GenerationLimits(64)))
        row["plain_decode_tok_s"] = round(produced / (time.perf_counter() - started), 1)
        report["models"][name] = row
        print(f"{name}: {row}", file=sys.stderr, flush=True)
        del model, engine
        torch.cuda.empty_cache()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
