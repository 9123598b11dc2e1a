"""`localspec bench`: every applicable proposer and transformers' own generate, on the same weights.

All modes see the same prompts, the same max new tokens and greedy decoding; one warm-up
generation per mode is excluded. Tokens per second are end to end (prefill included) so that
localspec and transformers are timed the same way; the decode-only figure is reported beside it.
"""

from __future__ import annotations

import json
import platform
import resource
import sys
import time
from dataclasses import replace
from importlib import resources
from pathlib import Path

import torch

from localspec.config import GenerationLimits, SamplingConfig, SpecConfig, has_eagle_head
from localspec.errors import LocalspecError
from localspec.registry import choose_proposer, load_registry
from localspec.session import describe_weights, draft_entry_for, load_models, make_engine

HF_MODES = ("hf-plain", "hf-assisted", "hf-prompt-lookup")


def load_prompts(path: str | None) -> list[dict]:
    if path is None:
        text = resources.files("localspec").joinpath("prompts/bench.json").read_text(encoding="utf-8")
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise LocalspecError(f"cannot read prompt file {path}: {exc}") from exc
    try:
        prompts = json.loads(text)
        assert isinstance(prompts, list) and all(isinstance(p["prompt"], str) and p["prompt"].strip() for p in prompts)
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise LocalspecError(f"{path}: expected a JSON list of objects with a non-empty 'prompt' field") from exc
    return [{"name": p.get("name", f"prompt-{i}"), "kind": p.get("kind", ""), "prompt": p["prompt"]} for i, p in enumerate(prompts)]


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu, "machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def run_localspec(engine, prompt: str, max_new: int) -> dict:
    start = time.perf_counter()
    tokens = [p.token_id for ev in engine.generate(prompt, SamplingConfig(), GenerationLimits(max_new)) for p in ev.pieces]
    seconds = time.perf_counter() - start
    stats = engine.stats
    return {
        "tokens": len(tokens), "seconds": seconds, "tokens_per_second": len(tokens) / seconds,
        "decode_tokens_per_second": stats.decode_tokens_per_second, "acceptance_rate": stats.acceptance_rate,
        "mean_tokens_per_pass": stats.mean_tokens_per_pass, "mean_draft_len": stats.mean_draft_len,
        "cost_ratio_c": stats.cost_ratio, "ttft_seconds": stats.ttft_seconds, "output_ids": tokens,
        "mean_accepted_length": stats.accepted / stats.passes if stats.passes else 0.0,
        "accepted_length_histogram": stats.accepted_hist, "draft_steps": stats.draft_steps,
        "lookup_passes": stats.lookup_passes, "lookup_accepted": stats.lookup_accepted,
    }


@torch.inference_mode()
def run_hf(mode: str, target, draft, ids: list[int], max_new: int, eos: set[int]) -> dict:
    kwargs = {}
    if mode == "hf-assisted":
        kwargs["assistant_model"] = draft.model
    elif mode == "hf-prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = 10
    x = torch.tensor([ids], device=target.device)
    start = time.perf_counter()
    out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, **kwargs)
    seconds = time.perf_counter() - start
    new = out[0, len(ids):].tolist()
    while new and new[-1] in eos:  # counted like localspec's answers, which end before the EOS
        new.pop()
    return {"tokens": len(new), "seconds": seconds, "tokens_per_second": len(new) / seconds, "output_ids": new}


def run_bench(args, spec: SpecConfig) -> int:
    registry = load_registry()
    entry = registry.get(args.model)
    prompts = load_prompts(args.prompts)
    if args.max_new_tokens < 1:
        raise LocalspecError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    wanted = [p.strip() for p in args.proposers.split(",") if p.strip()]
    for name in wanted:
        if name not in ("none", "ngram", "draft", "eagle"):
            raise LocalspecError(f"--proposers: unknown proposer {name!r} (none, ngram, draft, eagle)")
    if "eagle" in wanted and not has_eagle_head(entry.name):
        print(f"localspec: no EAGLE head for {entry.name} here (localspec train-eagle --target {entry.name}); "
              "skipping the eagle proposer", file=sys.stderr)
        wanted.remove("eagle")
    if "draft" in wanted and not entry.drafts:
        print(f"localspec: {entry.name} has no registered draft; skipping the draft proposer", file=sys.stderr)
        wanted.remove("draft")
    if "none" not in wanted:
        wanted.insert(0, "none")  # the baseline every speedup is measured against
    quants = [q.strip() for q in spec.quant.split(",") if q.strip()] or ["auto"]
    specs = [replace(spec, quant=q) for q in quants]  # validates each format
    results: dict[str, list[dict]] = {}
    weights: dict[str, dict] = {}
    for one in specs:
        # one weight format at a time: its models are freed before the next one loads
        label = "" if len(specs) == 1 else f"@{one.quant}"
        measured, weights[one.quant] = bench_weights(args, entry, registry, prompts, wanted, one, label)
        results.update(measured)
    baseline = {r["prompt"]: r for r in results[f"none{'' if len(specs) == 1 else '@' + specs[0].quant}"]}
    for mode, runs in results.items():
        for r in runs:
            r["speedup_vs_first_none"] = r["tokens_per_second"] / baseline[r["prompt"]]["tokens_per_second"]
    first = weights[specs[0].quant]
    report = {
        "model": entry.name, **first, "weights_by_quant": weights, "max_new_tokens": args.max_new_tokens,
        "draft_len": args.draft_len or "adaptive", "machine": machine_info(),
        "prompts": [{"name": p["name"], "kind": p["kind"]} for p in prompts], "results": results,
    }
    print_table(report)
    out = Path(args.out) if args.out else Path("bench-results") / f"bench-{entry.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"localspec: wrote {out}", file=sys.stderr)
    return 0


def bench_weights(args, entry, registry, prompts, wanted, spec: SpecConfig, label: str) -> tuple[dict, dict]:
    """Every mode on one weight format; results keyed by mode + label, and how the weights ran."""
    draft_entry = draft_entry_for(registry, entry) if "draft" in wanted else None
    dtype_for = "draft" if draft_entry else "ngram"
    target, draft, dtype_reason = load_models(entry, draft_entry, dtype_for, args.dtype, spec, quiet=False)
    print(f"localspec: bench {entry.name}, {describe_weights(target)} ({dtype_reason}), "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens", file=sys.stderr)

    modes = list(wanted) + ([] if args.no_hf else [m for m in HF_MODES if m != "hf-assisted" or draft])
    results: dict[str, list[dict]] = {m: [] for m in modes}
    engines = {name: make_engine(target, draft, name, spec, choose_proposer(name, entry)[1]) for name in wanted}
    encoded = [engines["none"].encode(p["prompt"]) for p in prompts]
    eos = engines["none"].eos

    def run(mode: str, prompt: str, ids: list[int], max_new: int) -> dict:
        if mode not in engines:
            return run_hf(mode, target, draft, ids, max_new, eos)
        engines[mode].forget()  # no prefix reuse between prompts: each run from scratch
        return run_localspec(engines[mode], prompt, max_new)

    for mode in modes:  # warm-up, excluded: first-call allocations and lazy initialisation
        run(mode, prompts[0]["prompt"], encoded[0], 8)
    # modes take turns on each prompt, so a slow stretch of the machine hits them all alike
    for prompt, ids in zip(prompts, encoded):
        for mode in modes:
            r = run(mode, prompt["prompt"], ids, args.max_new_tokens)
            r["prompt"] = prompt["name"]
            r["peak_memory_mb"] = peak_memory_mb(target.device)
            results[mode].append(r)
            print(f"  {mode + label:22} {prompt['name']:12} {r['tokens_per_second']:6.2f} tok/s", file=sys.stderr, flush=True)

    baseline = {r["prompt"]: r for r in results["none"]}
    for runs in results.values():
        for r in runs:
            base = baseline[r["prompt"]]
            r["speedup_vs_none"] = r["tokens_per_second"] / base["tokens_per_second"]
            r["same_output_as_none"] = r["output_ids"] == base["output_ids"]
    for runs in results.values():
        for r in runs:
            del r["output_ids"]
    how = {
        "dtype": str(target.dtype).removeprefix("torch."), "dtype_reason": dtype_reason,
        "target_weights": describe_weights(target), "load_seconds": round(target.load_seconds, 2),
        "draft_model": draft.name if draft else None, "draft_weights": describe_weights(draft) if draft else None,
    }
    return {mode + label: runs for mode, runs in results.items()}, how


def print_table(report: dict) -> None:
    names = [p["name"] for p in report["prompts"]]
    header = f"| mode | {' | '.join(names)} | accept | tok/pass | c |"
    print(header)
    print("|" + "---|" * (len(names) + 4))
    for mode, runs in report["results"].items():
        by_prompt = {r["prompt"]: r for r in runs}
        cells = [f"{by_prompt[n]['tokens_per_second']:.2f} ({by_prompt[n]['speedup_vs_none']:.2f}x)" for n in names]
        if "acceptance_rate" in runs[0]:
            extra = [
                f"{sum(r['acceptance_rate'] for r in runs) / len(runs):.0%}",
                f"{sum(r['mean_tokens_per_pass'] for r in runs) / len(runs):.2f}",
                f"{sum(r['cost_ratio_c'] for r in runs) / len(runs):.2f}",
            ]
        else:
            extra = ["-", "-", "-"]
        print(f"| {mode} | {' | '.join(cells)} | {' | '.join(extra)} |")
