"""`localspec bench`: every applicable proposer and transformers' own generate, on the same weights.

All modes see the same prompts, the same max new tokens and greedy decoding; one warm-up
generation per mode is excluded. Tokens per second are end to end (prefill included) so that
localspec and transformers are timed the same way; the decode-only figure is reported beside it.
With --llama-cpp, llama.cpp's tools run on the same GGUF files and prompts after localspec's modes,
and the comparison (decode tok/s, pass costs, prompt processing, one-shot start-up) is added.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import psutil
import torch

from localspec.apps.llamacpp import LlamaCpp, measured_run, ratios
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core.prompt import chat_text
from localspec.core.stats import GenerationStats
from localspec.runtime.costs import CALIBRATION_PREFIX, time_forward
from localspec.store import proposer_catalog
from localspec.store.proposer_catalog import rank_proposers
from localspec.store.registry import load_registry
from localspec.store.session import describe_weights, draft_entry_for, load_models, make_engine
from localspec.store.tokenizers import gguf_file, load_tokenizer

HF_MODES = ("hf-plain", "hf-assisted", "hf-prompt-lookup")
PASS_WIDTHS = (1, 16)  # the pass costs set beside llama-bench's
LONG_PROMPT_TOKENS = 500  # prompt processing is compared on a prompt about this long
ONE_SHOT_TOKENS = 64


def load_prompts(path: str | None) -> list[dict]:
    if path is None:
        text = resources.files("localspec.apps").joinpath("prompts/bench.json").read_text(encoding="utf-8")
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


def peak_memory_mb(device: torch.device) -> float | None:
    """This process's peak so far: CUDA's allocations on a GPU; else the peak resident set, from
    getrusage on POSIX and psutil's peak working set on Windows (which has no `resource`); None
    where neither is known."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:
        peak = getattr(psutil.Process().memory_info(), "peak_wset", None)
        return peak / 2**20 if peak is not None else None
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def localspec_answer(engine, prompt: str, max_new: int) -> tuple[list[int], GenerationStats]:
    """One greedy answer: its token ids and its statistics, from its events."""
    tokens, stats = [], GenerationStats()
    for event in engine.generate(prompt, SamplingConfig(), GenerationLimits(max_new)):
        stats = event.fold(stats)
        tokens += [p.token_id for p in event.pieces]
    return tokens, stats


def run_localspec(engine, prompt: str, max_new: int) -> dict:
    start = time.perf_counter()
    tokens, stats = localspec_answer(engine, prompt, max_new)
    seconds = time.perf_counter() - start
    return {
        "tokens": len(tokens), "seconds": seconds, "tokens_per_second": len(tokens) / seconds,
        "decode_tokens_per_second": stats.decode_tokens_per_second, "acceptance_rate": stats.acceptance_rate,
        "mean_tokens_per_pass": stats.mean_tokens_per_pass, "mean_draft_len": stats.mean_draft_len,
        "cost_ratio_c": stats.cost_ratio, "ttft_seconds": stats.ttft_seconds, "output_ids": tokens,
        "mean_accepted_length": stats.accepted / stats.passes if stats.passes else 0.0,
        "accepted_length_histogram": stats.accepted_hist, "draft_steps": stats.draft_steps,
        "lookup_passes": stats.lookup_passes, "lookup_accepted": stats.lookup_accepted,
        "history_passes": stats.history_passes, "history_accepted": stats.history_accepted,
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


def requested_proposers(listed: str | None) -> list[str]:
    """`--proposers` as names; not given: every proposer in the catalog, plain decoding first."""
    return [p.strip() for p in (listed or ",".join(reversed(proposer_catalog.KINDS))).split(",") if p.strip()]


def run_bench(args, spec: SpecConfig) -> int:
    registry = load_registry()
    entry = registry.get(args.model)
    prompts = load_prompts(args.prompts)
    if args.max_new_tokens < 1:
        raise LocalspecError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    wanted = requested_proposers(args.proposers)
    for name in wanted:
        if name not in proposer_catalog.KINDS:
            raise LocalspecError(f"--proposers: unknown proposer {name!r} ({', '.join(proposer_catalog.KINDS)})")
    for name in list(wanted):
        if why_not := proposer_catalog.unavailable(name, entry):
            print(f"localspec: {why_not}; skipping the {name} proposer", file=sys.stderr)
            wanted.remove(name)
    if "none" not in wanted:
        wanted.insert(0, "none")  # the baseline every speedup is measured against
    quants = [q.strip() for q in spec.quant.split(",") if q.strip()] or ["auto"]
    specs = [replace(spec, quant=q) for q in quants]  # validates each format
    # a wrong llama.cpp folder or a model without a GGUF fails now, before minutes of loading
    side = prepare_llama_cpp(args.llama_cpp, entry, registry, prompts) if args.llama_cpp else None
    results: dict[str, list[dict]] = {}
    weights: dict[str, dict] = {}
    for one in specs:
        # one weight format at a time: its models are freed before the next one loads
        label = "" if len(specs) == 1 else f"@{one.quant}"
        long_prompt = side.long_prompt if side else None
        measured, weights[one.quant] = bench_weights(args, entry, registry, prompts, wanted, one, label, long_prompt)
        results.update(measured)
    baseline_mode = f"none{'' if len(specs) == 1 else '@' + specs[0].quant}"
    baseline = {r["prompt"]: r for r in results[baseline_mode]}
    for mode, runs in results.items():
        for r in runs:
            r["speedup_vs_first_none"] = r["tokens_per_second"] / baseline[r["prompt"]]["tokens_per_second"]
    first = weights[specs[0].quant]
    report = {
        "model": entry.name, **first, "weights_by_quant": weights, "max_new_tokens": args.max_new_tokens,
        "draft_len": args.draft_len or "adaptive", "machine": machine_info(),
        "prompts": [{"name": p["name"], "kind": p["kind"]} for p in prompts], "results": results,
    }
    if side:
        report["llama_cpp"] = bench_llama_cpp(side, entry, prompts, args.max_new_tokens, results, baseline_mode, weights)
    print_table(report)
    if side:
        print_llama_cpp(report)
    write_report(report, args.out, f"bench-{entry.name}")
    return 0


def write_report(report: dict, out: str | None, stem: str) -> None:
    """The JSON report at --out, else bench-results/<stem>-<time>.json."""
    path = Path(out) if out else Path("bench-results") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    print(f"localspec: wrote {path}", file=sys.stderr)


def bench_weights(args, entry, registry, prompts, wanted, spec: SpecConfig, label: str,
                  long_prompt: str | None = None) -> tuple[dict, dict]:
    """Every mode on one weight format; results keyed by mode + label, and how the weights ran.
    With `long_prompt` (--llama-cpp) also the figures set beside llama.cpp's: fresh pass costs and
    the time to first token on that prompt."""
    draft_entry = draft_entry_for(registry, entry) if any(proposer_catalog.KINDS[n].draft_model for n in wanted) else None
    dtype_for = "draft" if draft_entry else "ngram"
    target, draft, dtype_reason = load_models(entry, draft_entry, dtype_for, args.dtype, spec, quiet=False)
    print(f"localspec: bench {entry.name}, {describe_weights(target)} ({dtype_reason}), "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens", file=sys.stderr)

    modes = list(wanted) + ([] if args.no_hf else [m for m in HF_MODES if m != "hf-assisted" or draft])
    results: dict[str, list[dict]] = {m: [] for m in modes}
    engines = {name: make_engine(target, draft, name, spec, rank_proposers(name, entry)[0].reason) for name in wanted}
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
    if long_prompt is not None:
        engines["none"].forget()
        first = run_localspec(engines["none"], long_prompt, 1)
        # measured now rather than read from the calibration cache, so both sides share the run
        passes = time_forward(target.model, PASS_WIDTHS)
        how["vs_llama_cpp"] = {
            "weights": target.quant, "pass_ms": {w: s * 1000 for w, s in passes.items()},
            "long_prompt_tokens": len(engines["none"].encode(long_prompt)), "ttft_seconds": first["ttft_seconds"],
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


# --- llama.cpp beside localspec (--llama-cpp) -------------------------------------------------


@dataclass
class LlamaCppSide:
    """What llama.cpp's runs need, settled before localspec loads anything."""

    tools: LlamaCpp
    gguf: Path
    draft_gguf: Path | None
    texts: list[str]
    """Each prompt rendered through the target's chat template: llama.cpp decodes the same tokens."""
    prompt_tokens: list[int | None]
    """How many tokens localspec reads in each text (None without a chat template: not compared)."""
    long_prompt: str
    long_text: str


def long_prompt(tokenizer, tokens: int = LONG_PROMPT_TOKENS) -> str:
    """About `tokens` of the packaged prompts' text, repeated as needed: the same prompt-processing
    test whatever --prompts holds."""
    ids = tokenizer.encode("\n\n".join(p["prompt"] for p in load_prompts(None)), add_special_tokens=False)
    ids = ids * (tokens // len(ids) + 1)
    return "Summarize the following texts.\n\n" + tokenizer.decode(ids[:tokens])


def prepare_llama_cpp(folder: str, entry, registry, prompts: list[dict]) -> LlamaCppSide:
    tools = LlamaCpp.at(folder, torch.get_num_threads())
    if entry.mirror is None and entry.gguf is None:
        raise LocalspecError(f"--llama-cpp runs llama.cpp on the model's GGUF file, and {entry.name} has none")
    draft = draft_entry_for(registry, entry) if entry.drafts else None
    # the registered draft is llama.cpp's draft too, whichever localspec proposers were asked for
    draft_gguf = gguf_file(draft) if draft is not None and (draft.mirror or draft.gguf) else None
    tokenizer = load_tokenizer(entry)
    long = long_prompt(tokenizer)
    texts = [chat_text(tokenizer, p["prompt"]) for p in prompts]
    templated = bool(getattr(tokenizer, "chat_template", None))
    counts = [len(tokenizer.encode(t, add_special_tokens=False)) if templated else None for t in texts]
    return LlamaCppSide(tools, gguf_file(entry), draft_gguf, texts, counts, long, chat_text(tokenizer, long))


def bench_llama_cpp(side: LlamaCppSide, entry, prompts: list[dict], max_new: int, results: dict[str, list[dict]],
                    baseline_mode: str, weights: dict[str, dict]) -> dict:
    """llama.cpp's plain and speculative decoding on every prompt, its pass costs and prompt
    processing, and both one-shot runs; ratios per prompt against localspec's `results`."""
    tools = side.tools
    modes = [None, *tools.spec_types(side.draft_gguf is not None)]
    print(f"localspec: llama.cpp from {tools.bin_dir}: plain, {', '.join(modes[1:]) or 'no speculative mode'}",
          file=sys.stderr)
    tools.generate(side.gguf, side.texts[0], 8)  # warm-up, excluded: brings the GGUF into the page cache
    runs: dict[str, list[dict]] = {m or "plain": [] for m in modes}
    for prompt, text, count in zip(prompts, side.texts, side.prompt_tokens):
        for mode in modes:
            r = tools.generate(side.gguf, text, max_new, mode, side.draft_gguf)
            r["prompt"] = prompt["name"]
            if mode is None and count is not None and r["prompt_tokens"] != count:  # not like for like
                print(f"localspec: warning: llama.cpp read {r['prompt_tokens']} prompt tokens of {prompt['name']}, "
                      f"localspec {count}", file=sys.stderr)
            runs[r["mode"]].append(r)
            print(f"  llama.cpp {r['mode']:12} {prompt['name']:12} {r['decode_tokens_per_second']:6.2f} tok/s (decode)",
                  file=sys.stderr, flush=True)
    ours = {m: {r["prompt"]: r for r in rs} for m, rs in results.items() if not m.startswith("hf-")}
    theirs = {m: {r["prompt"]: r for r in rs} for m, rs in runs.items()}
    per_prompt = [
        {"prompt": p["name"], **ratios({m: rs[p["name"]] for m, rs in ours.items()},
                                       {m: rs[p["name"]] for m, rs in theirs.items()}, baseline_mode)}
        for p in prompts
    ]
    bench = tools.pass_costs(side.gguf, PASS_WIDTHS, CALIBRATION_PREFIX, max_new)
    prefill = tools.generate(side.gguf, side.long_text, 1)
    print(f"localspec: one-shot runs ({ONE_SHOT_TOKENS} tokens, start-up included)", file=sys.stderr)
    one_shot = {
        "prompt": prompts[0]["name"], "tokens": ONE_SHOT_TOKENS,
        "llama_cpp": tools.one_shot(side.gguf, side.texts[0], ONE_SHOT_TOKENS),
        "localspec": localspec_one_shot(entry.name, prompts[0]["prompt"]),
        "localspec_resident": localspec_resident_one_shot(entry.name, prompts[0]["prompt"]),
    }
    return {
        "bin_dir": str(tools.bin_dir), "threads": tools.threads, "gguf": str(side.gguf),
        "draft_gguf": str(side.draft_gguf) if side.draft_gguf else None, "results": runs, "ratios": per_prompt,
        "pass_costs": {
            "context_tokens": CALIBRATION_PREFIX,
            "localspec_ms": {w["vs_llama_cpp"]["weights"]: w["vs_llama_cpp"]["pass_ms"] for w in weights.values()},
            "llama_cpp_ms": bench["pass_ms"], "llama_cpp_decode_tokens_per_second": bench["decode_tokens_per_second"],
        },
        "prompt_processing": {
            "localspec": {w["vs_llama_cpp"]["weights"]: {"prompt_tokens": w["vs_llama_cpp"]["long_prompt_tokens"],
                                                         "ttft_seconds": w["vs_llama_cpp"]["ttft_seconds"]}
                          for w in weights.values()},
            "llama_cpp": {"prompt_tokens": prefill["prompt_tokens"], "seconds": prefill["prompt_seconds"]},
        },
        "one_shot": one_shot,
    }


def localspec_one_shot(model: str, prompt: str) -> dict:
    """`localspec run` as a one-shot user starts it (default proposer and weights, in its own
    process), start to end."""
    from localspec.store.token_history import empty_history

    cmd = [sys.executable, "-m", "localspec.apps.cli", "run", "--model", model, "--max-new-tokens", str(ONE_SHOT_TOKENS),
           "--quiet", "--no-daemon", "--", prompt]
    with empty_history():  # a new prompt: the answer an earlier benchmark gave is not remembered
        run = measured_run(cmd, "localspec run")
    return {"seconds": run.seconds, "peak_rss_mb": run.peak_rss_mb}


def localspec_resident_one_shot(model: str, prompt: str) -> dict:
    """The same one-shot answered by a resident engine that already holds the model (started here
    and stopped after; warmed by another prompt, so this one's prefill is not cached): start to
    end, the answer's own decode time, and the first token's time as the user sees it."""
    from localspec.apps import resident
    from localspec.store.token_history import empty_history

    if resident.find_engine() is not None:
        return {"skipped": "a resident engine already runs for this home: stop it to measure one started here"}
    with empty_history():  # the engine remembers nothing from an earlier benchmark's answers
        run = _resident_run(model, prompt)
    stats = json.loads(run.stdout)["stats"]
    engine_seconds = stats["ttft_seconds"] + stats["decode_seconds"]
    return {"seconds": run.seconds, "decode_seconds": stats["decode_seconds"],
            "wall_over_decode": run.seconds / stats["decode_seconds"] if stats["decode_seconds"] else None,
            "ttft_seconds": run.seconds - engine_seconds + stats["ttft_seconds"], "engine_ttft_seconds": stats["ttft_seconds"],
            "new_tokens": stats["new_tokens"]}


def _resident_run(model: str, prompt: str):
    """`localspec run --json` of `prompt` through a resident engine started (and stopped) here."""
    from localspec.apps import resident

    engine = subprocess.Popen([sys.executable, "-m", "localspec.apps.cli", "serve", "--model", model, "--port", "0",
                               "--keep-alive", "forever"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + resident.STARTUP_SECONDS
        while (record := resident.find_engine()) is None or record.pid != engine.pid:
            if engine.poll() is not None or time.monotonic() > deadline:
                raise LocalspecError("the resident engine for the one-shot benchmark did not start")
            time.sleep(0.1)
        resident.ResidentEngine(record).details()  # loaded
        cmd = [sys.executable, "-m", "localspec.apps.cli", "run", "--model", model, "--max-new-tokens",
               str(ONE_SHOT_TOKENS), "--json", "--"]
        measured_run([*cmd, "Say hello."], "localspec run (resident)")
        return measured_run([*cmd, prompt], "localspec run (resident)")
    finally:
        engine.terminate()
        engine.wait(30)


def _x(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio is not None else "-"


def print_llama_cpp(report: dict) -> None:
    side = report["llama_cpp"]
    names = [p["name"] for p in report["prompts"]]
    by_prompt = {r["prompt"]: r for r in side["ratios"]}
    print(f"\ndecode tok/s beside llama.cpp (same GGUF and prompts, greedy, {side['threads']} threads)")
    print(f"| | {' | '.join(names)} |")
    print("|" + "---|" * (len(names) + 1))
    rows = [
        ("localspec none", lambda r: f"{r['localspec_none']:.2f}"),
        ("localspec best", lambda r: f"{r['localspec_best']:.2f} ({r['localspec_best_mode']})"),
        ("llama.cpp plain", lambda r: f"{r['llama_cpp_plain']:.2f}"),
        ("llama.cpp best speculative", lambda r: f"{r['llama_cpp_best_speculative']:.2f} ({r['llama_cpp_best_speculative_mode']})"
         if r["llama_cpp_best_speculative_mode"] else "-"),
        ("best localspec / best llama.cpp", lambda r: _x(r["best_vs_best"])),
        ("none / llama.cpp plain", lambda r: _x(r["none_vs_plain"])),
    ]
    for label, cell in rows:
        print(f"| {label} | {' | '.join(cell(by_prompt[n]) for n in names)} |")

    costs = side["pass_costs"]
    print(f"\n| pass cost, ms (after {costs['context_tokens']} tokens) | {' | '.join(f'{w} tok' for w in PASS_WIDTHS)} | "
          f"{PASS_WIDTHS[-1]} / {PASS_WIDTHS[0]} |")
    print("|" + "---|" * (len(PASS_WIDTHS) + 2))
    for label, ms in [*((f"localspec ({k})", v) for k, v in costs["localspec_ms"].items()), ("llama.cpp", costs["llama_cpp_ms"])]:
        cells = [f"{ms[w]:.0f}" if w in ms else "-" for w in PASS_WIDTHS]
        spread = _x(ms[PASS_WIDTHS[-1]] / ms[PASS_WIDTHS[0]]) if all(w in ms for w in PASS_WIDTHS) else "-"
        print(f"| {label} | {' | '.join(cells)} | {spread} |")
    for n, rate in costs["llama_cpp_decode_tokens_per_second"].items():
        print(f"llama-bench tg{n}: {rate:.2f} tok/s")

    prefill = side["prompt_processing"]
    theirs = prefill["llama_cpp"]
    for weights, ours in prefill["localspec"].items():
        print(f"prompt processing: localspec ({weights}) first token after {ours['ttft_seconds']:.2f} s "
              f"({ours['prompt_tokens']} tokens); llama.cpp {theirs['seconds']:.2f} s ({theirs['prompt_tokens']} tokens)")
    shot = side["one_shot"]
    ls, lc = shot["localspec"], shot["llama_cpp"]
    memory = (f", peak memory {ls['peak_rss_mb'] / 1024:.2f} GB vs {lc['peak_rss_mb'] / 1024:.2f} GB "
              f"({_x(ls['peak_rss_mb'] / lc['peak_rss_mb'])})" if ls["peak_rss_mb"] and lc["peak_rss_mb"] else "")
    print(f"one-shot {shot['tokens']} tokens ({shot['prompt']}), start-up included: localspec run {ls['seconds']:.1f} s "
          f"vs llama-completion {lc['seconds']:.1f} s ({_x(ls['seconds'] / lc['seconds'])}){memory}")
    warm = shot.get("localspec_resident", {})
    if "seconds" in warm:
        print(f"one-shot through the resident engine: {warm['seconds']:.2f} s, first token after {warm['ttft_seconds']:.2f} s, "
              f"{_x(warm['wall_over_decode'])} its own decode time ({warm['decode_seconds']:.2f} s); "
              f"{_x(warm['seconds'] / lc['seconds'])} llama-completion's wall clock")
