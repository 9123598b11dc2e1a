"""Soak test (not run in CI): a long chat and one 10,000-token generation on a tiny model.

Checks that memory stays flat, speed does not decay and the statistics stay consistent, and
prints a report (recorded in docs/soak.md). Usage: python scripts/soak.py [--tokens 10000] [--turns 40]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.core.engine import Engine
from localspec.core.proposers import NgramProposer
from localspec.core.stats import GenerationStats
from localspec.runtime.costs import CostModel


def tiny_model(context: int) -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=context, bos_token_id=None, eos_token_id=None,
    )
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    return model


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def consistent(stats) -> bool:
    per_position_ok = all(a <= d for a, d in zip(stats.accepted_at, stats.drafted_at))
    return (
        stats.accepted <= stats.drafted
        and per_position_ok
        and sum(stats.accepted_at) == stats.accepted
        and sum(stats.drafted_at) == stats.drafted
        and stats.new_tokens <= stats.accepted + stats.passes
    )


def long_generation(tokens: int) -> list[str]:
    model = tiny_model(tokens + 64)
    costs = CostModel({1: 0.002, 4: 0.0022, 16: 0.003})
    engine = Engine(model, None, NgramProposer(), SpecConfig(), costs=costs)
    lines, chunk, mark, produced = [], 1000, time.perf_counter(), 0
    start_rss, stats = rss_mb(), GenerationStats()
    for event in engine.generate(list(range(1, 33)), SamplingConfig(temperature=0.8, seed=1), GenerationLimits(tokens)):
        stats = event.fold(stats)
        before = produced
        produced += len(event.pieces)
        if produced // chunk > before // chunk:
            now = time.perf_counter()
            lines.append(
                f"  tokens {produced // chunk * chunk:6d}: {chunk / (now - mark):7.1f} tok/s, RSS {rss_mb():7.1f} MB "
                f"(+{rss_mb() - start_rss:5.1f}), KV {len(engine.kv)} positions, stats consistent: {consistent(stats)}"
            )
            mark = now
    lines.append(f"  done: {stats.summary()}")
    return lines


def long_chat(turns: int) -> list[str]:
    model = tiny_model(32768)
    engine = Engine(model, None, NgramProposer(), SpecConfig(draft_len=4))
    history = list(range(1, 17))
    lines, start_rss = [], rss_mb()
    for turn in range(1, turns + 1):
        started = time.perf_counter()
        answer, stats = [], GenerationStats()
        for event in engine.generate(history, limits=GenerationLimits(100)):
            answer += [p.token_id for p in event.pieces]
            stats = event.fold(stats)
        seconds = time.perf_counter() - started
        history = history + answer + [turn % 90, (turn * 7) % 90]  # the next user message
        if turn % 10 == 0 or turn == 1:
            lines.append(
                f"  turn {turn:3d}: context {len(history):6d} tokens, {len(answer) / seconds:7.1f} tok/s, "
                f"prefill {stats.prefill_seconds * 1000:6.1f} ms (prefix reused), RSS {rss_mb():7.1f} MB "
                f"(+{rss_mb() - start_rss:5.1f}), stats consistent: {consistent(stats)}"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=40)
    args = parser.parse_args()
    print(f"soak on {torch.__version__}, {torch.get_num_threads()} threads, {sys.platform}")
    print(f"one generation of {args.tokens} tokens (T=0.8, n-gram proposer, adaptive length):")
    print("\n".join(long_generation(args.tokens)))
    print(f"a chat of {args.turns} turns of 100 tokens (n-gram, draft length 4):")
    print("\n".join(long_chat(args.turns)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
