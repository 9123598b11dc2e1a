"""`localspec serve` against the engine itself, and the time to first token of a resent conversation.

Not run in CI. For each benchmark prompt: the engine's own decode tok/s and TTFT, then the same
prompt streamed through the HTTP API (client-side clock: first and last content chunk). Then a
two-turn chat whose second turn resends the first turn's prompt and answer, as chat clients do,
timed with the engine's cache as the first turn left it (warm) and again after `engine.forget()`
(cold: the same prompt, prefilled from scratch). Every run is greedy and starts from an empty cache
except the warm turn; each figure is the best of --repeat runs, as the machine may be shared.

Usage: python scripts/serve_bench.py [--model smollm2-135m] [--proposer ngram] [--max-new-tokens 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import uvicorn

from localspec.apps.bench import load_prompts
from localspec.apps.serve.app import create_app, listen
from localspec.apps.serve.turns import Served
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.core.stats import GenerationStats
from localspec.store.session import open_session


def direct(engine, messages, n: int) -> tuple[float, float]:
    engine.forget()
    stats = GenerationStats()
    for event in engine.generate(messages, SamplingConfig(), GenerationLimits(n)):
        stats = event.fold(stats)
    return stats.ttft_seconds, stats.decode_tokens_per_second


def streamed(url: str, messages, n: int) -> tuple[str, float, float, dict]:
    """Answer text, TTFT and decode tok/s as the client sees them, and the server's timings."""
    body = {"messages": messages, "max_tokens": n, "temperature": 0, "stream": True}
    text, first, last, timings = [], None, None, {}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            timings = chunk.get("timings", timings)
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
                text.append(chunk["choices"][0]["delta"]["content"])
    tokens = timings["predicted_n"]
    decode = (tokens - 1) / (last - first) if tokens > 1 and last > first else 0.0
    return "".join(text), first - start, decode, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--proposer", default="ngram")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quant", default="none")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    session = open_session(args.model, args.proposer, args.dtype, SpecConfig(proposer=args.proposer, quant=args.quant), quiet=True)
    engine = session.engine
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(lambda: Served(args.model, engine)), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    while not server.started or httpx.get(url + "/health").status_code != 200:
        time.sleep(0.1)

    prompts = load_prompts(None)
    direct(engine, [{"role": "user", "content": prompts[0]["prompt"]}], 8)  # warm-up
    print(f"{args.model}, {session.proposer}, {session.dtype_reason}, {args.max_new_tokens} new tokens")
    print(f"{'prompt':12} {'engine tok/s':>12} {'API tok/s':>10} {'engine TTFT':>12} {'API TTFT':>9}")
    for p in prompts:
        messages = [{"role": "user", "content": p["prompt"]}]
        runs = [direct(engine, messages, args.max_new_tokens) for _ in range(args.repeat)]
        ttft, rate = min(r[0] for r in runs), max(r[1] for r in runs)
        api_runs = []
        for _ in range(args.repeat):
            engine.forget()
            api_runs.append(streamed(url, messages, args.max_new_tokens))
        api_ttft, api_rate = min(r[1] for r in api_runs), max(r[2] for r in api_runs)
        print(f"{p['name']:12} {rate:12.2f} {api_rate:10.2f} {ttft * 1e3:10.0f}ms {api_ttft * 1e3:7.0f}ms")

    # a conversation: every benchmark prompt as one long first message, then a short follow-up
    history = [{"role": "user", "content": "\n\n".join(p["prompt"] for p in prompts * 2)}]
    engine.forget()
    answer, _, _, _ = streamed(url, history, args.max_new_tokens)
    second = history + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Now in one sentence."}]
    warm = cold = float("inf")
    for _ in range(args.repeat):
        engine.forget()
        streamed(url, history, args.max_new_tokens)  # the first turn, as the client saw it
        _, seconds, _, warm_timings = streamed(url, second, 8)
        warm = min(warm, seconds)
        engine.forget()
        cold = min(cold, streamed(url, second, 8)[1])
    print(f"second turn, {warm_timings['prompt_n']} prompt tokens: TTFT {warm * 1e3:.0f} ms with "
          f"{warm_timings['cache_n']} of them cached, {cold * 1e3:.0f} ms cold ({cold / warm:.1f}x)")
    server.should_exit = True


if __name__ == "__main__":
    main()
