"""Command line: `localspec run`, `localspec bench`, `localspec models`.

Errors the user can act on print one line (`localspec: error: ...`) and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from localspec.config import DTYPES, PROPOSERS, GenerationLimits, SamplingConfig, SpecConfig
from localspec.errors import LocalspecError


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="registry name (default: the registry's default model)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="compute dtype (auto: measured on this machine)")
    p.add_argument("--draft-len", type=int, default=None, help="fixed draft length (default: adaptive, from measured costs)")
    p.add_argument("--max-draft-len", type=int, default=12, help="upper bound for the adaptive draft length")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest suffix prompt lookup matches")
    p.add_argument("--ngram-max", type=int, default=4, help="longest suffix prompt lookup tries first")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=512)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localspec", description="Lossless speculative decoding on your own machine.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="answer one prompt, streaming to stdout")
    run.add_argument("prompt", help="the prompt, or - to read it from stdin")
    _add_model_options(run)
    run.add_argument("--proposer", default="auto", choices=PROPOSERS)
    _add_sampling_options(run)
    run.add_argument("--system", default=None, help="system prompt")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    run.add_argument("--quiet", action="store_true", help="no progress or notices on stderr")

    bench = sub.add_parser("bench", help="compare proposers and transformers' generate on a prompt set")
    _add_model_options(bench)
    bench.add_argument("--proposers", default="none,ngram,draft", help="comma-separated proposers to run")
    bench.add_argument("--prompts", default=None, help="JSON file: a list of {name, prompt} objects")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--no-hf", action="store_true", help="skip transformers' own generate modes")
    bench.add_argument("--out", default=None, help="write the JSON report here (default: bench-results/<time>.json)")

    sub.add_parser("models", help="list the models localspec knows")
    return parser


def spec_from(args: argparse.Namespace, proposer: str) -> SpecConfig:
    return SpecConfig(
        proposer=proposer, draft_len=args.draft_len, max_draft_len=args.max_draft_len,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max,
    )


def _read_prompt(arg: str) -> str:
    if arg != "-":
        return arg
    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LocalspecError(f"the prompt on stdin is not valid UTF-8 (byte {exc.start})") from exc


def cmd_run(args: argparse.Namespace) -> int:
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    limits = GenerationLimits(args.max_new_tokens, tuple(args.stop))
    spec = spec_from(args, args.proposer)
    prompt = _read_prompt(args.prompt)
    if not prompt.strip():
        raise LocalspecError("the prompt is empty")

    from localspec.session import open_session  # heavy imports only after the options are valid

    session = open_session(args.model, args.proposer, args.dtype, spec, quiet=args.quiet or args.json)
    if not (args.quiet or args.json):
        print(f"localspec: {session.proposer} proposer: {session.reason}; dtype: {session.dtype_reason}", file=sys.stderr)
    engine = session.engine
    text = []
    try:
        for event in engine.generate(prompt, sampling, limits, system=args.system):
            text.append(event.text)
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        engine.stats.stop_reason = "interrupted"
    stats = engine.stats
    if args.json:
        print(json.dumps({
            "text": "".join(text),
            "model": session.entry.name,
            "settings": {
                "proposer": session.proposer, "dtype": str(session.target.dtype).removeprefix("torch."),
                "dtype_reason": session.dtype_reason, "draft_len": args.draft_len,
                "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                "max_new_tokens": args.max_new_tokens, "system": args.system, "stop": args.stop,
            },
            "stats": stats.to_dict(),
        }, indent=1))
    else:
        sys.stdout.write("\n")
        if not args.quiet:
            print(stats.summary(), file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from localspec.registry import load_registry

    registry = load_registry()
    for name, entry in registry.models.items():
        size = f"{entry.mirror.size / 1e9:.2f} GB" if entry.mirror else "-"
        mark = " (default)" if name == registry.default else ""
        drafts = f" drafts: {', '.join(entry.drafts)}" if entry.drafts else ""
        print(f"{name:24} {entry.arch:8} {size:>9}  {entry.display}{mark}{drafts}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from localspec.bench import run_bench

    return run_bench(args, spec_from(args, "auto"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"run": cmd_run, "models": cmd_models, "bench": cmd_bench}[args.command](args)
    except LocalspecError as exc:
        print(f"localspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("localspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
