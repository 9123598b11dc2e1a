"""The timing half of scripts/gpu_check.sh: pass costs on the GPU, as JSON on stdout.

For the default pair's shapes (Qwen2.5-Coder 1.5B target, 0.5B draft) and a published 8B shape
(Llama-3.1-8B), with random bf16 weights (a lent GPU reaches no hub): milliseconds of a 1-token and
a 16-token pass after 128 and 1024 cached tokens through the `TargetPass` generation runs, eagerly
(the row-exact attention in Triton rows) and replayed from a CUDA graph (localspec/runtime/graphs.py);
and plain decoding's tokens per second through the engine, with and without graphs.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from localspec.base.config import GenerationLimits
from localspec.core.engine import Engine
from localspec.core.stats import GenerationStats
from localspec.runtime.costs import time_forward
from localspec.runtime.target_pass import TargetPass

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


def decode_tok_s(model: torch.nn.Module, graphs: bool) -> tuple[float, list[str]]:
    """Plain decoding through the engine: tokens per second, and its notices."""
    engine = Engine(model, None, None)
    if not graphs:
        engine.target_pass.graphs = None
    prompt = list(range(100, 228))
    for _ in engine.generate(prompt, limits=GenerationLimits(8)):  # warm-up: compiles, captures
        pass
    started = time.perf_counter()
    stats, produced = GenerationStats(), 0
    for event in engine.generate(prompt, limits=GenerationLimits(64)):
        stats, produced = event.fold(stats), produced + len(event.pieces)
    return round(produced / (time.perf_counter() - started), 1), stats.notices


def main() -> None:
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda, "models": {}}
    for name in SHAPES:
        started = time.perf_counter()
        model = random_model(name)
        row = {"build_seconds": round(time.perf_counter() - started, 1)}
        for path in ("eager", "graphs"):
            for context in (128, 1024):
                target = TargetPass(model)
                if path == "eager":
                    target.graphs = None
                try:
                    costs = time_forward(model, (1, 16), repeats=3, context=context, target=target)
                    row[f"{path}|context={context}"] = {w: round(s * 1000, 2) for w, s in costs.items()}  # ms
                except Exception as exc:  # one failing measurement must not cost the others
                    row[f"{path}|context={context}"] = repr(exc)[:300]
        for graphs in (True, False):
            tok_s, notices = decode_tok_s(model, graphs)
            row["plain_decode_tok_s" + ("" if graphs else "_eager")] = tok_s
            if notices:
                row["notices" + ("" if graphs else "_eager")] = notices
        report["models"][name] = row
        print(f"{name}: {row}", file=sys.stderr, flush=True)
        del model
        torch.cuda.empty_cache()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
