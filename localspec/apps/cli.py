"""Command line: `localspec run / bench / models / chat / pull / rm / pair / train-eagle / serve`.

Errors the user can act on print one line (`localspec: error: ...`) and exit 2, never a traceback.
Each command imports what loads torch (sessions, downloads, the UI) only when it runs, so that
`--help` and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from localspec.base import timings
from localspec.base.config import DRAFT_QUANTS, DTYPES, QUANTS, GenerationLimits, SamplingConfig, SpecConfig, eagle_head_dir
from localspec.base.errors import LocalspecError
from localspec.core.prompt import check_text
from localspec.store import proposer_catalog
from localspec.store.history import pair_key
from localspec.store.registry import load_registry

PROPOSER_HELP = "; ".join(f"{kind.name}: {kind.about}" for kind in proposer_catalog.KINDS.values())


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="registry name, the path of your own .gguf file or folder of Hugging Face "
                   "safetensors, or a hub GGUF as org/repo/file.gguf or org/repo:Q4_K_M (registered on first use; "
                   "default: the registry's default model)")
    p.add_argument("--draft", default=None, help="the draft model to pair with: a registry name, your own .gguf or folder "
                   "(saved as the target's draft in your models.toml; its tokenizer is checked against the target's)")
    p.add_argument("--name", dest="own_name", default=None, help="with --model PATH: the name to register it under "
                   "(default: from the file name)")
    p.add_argument("--dtype", default="auto", choices=DTYPES, help="compute dtype (auto: measured on this machine); an explicit one also keeps float weights "
                   "under --quant auto, quantized only if they do not fit in memory")
    p.add_argument("--draft-len", type=int, default=None, help="fixed draft length (default: adaptive, from measured costs)")
    p.add_argument("--max-draft-len", type=int, default=15, help="upper bound for the adaptive draft length")
    p.add_argument("--quant", default="auto", metavar="|".join(QUANTS),
                   help="target weights (auto on a CPU: w4a8, localspec's 4-bit x int8 kernel, when the published "
                   "model is 4-bit; else w8a8 where int8 multiplies exactly; else 4-bit for a 4-bit model; else "
                   "only to fit memory); "
                   "bench takes a comma list to compare them side by side")
    p.add_argument("--draft-quant", default="auto", choices=DRAFT_QUANTS, help="draft weights (auto: the fastest measured step)")
    p.add_argument("--tree-top-k", type=int, default=8, help="EAGLE: children per expanded node")
    p.add_argument("--tree-nodes", type=int, default=None, help="EAGLE: fixed tree size (default: from measured costs)")
    p.add_argument("--tree-depth", type=int, default=None, help="EAGLE: fixed depth (default: while a level pays)")
    p.add_argument("--ngram-min", type=int, default=1, help="shortest suffix prompt lookup matches")
    p.add_argument("--ngram-max", type=int, default=4, help="longest suffix prompt lookup tries first")
    p.add_argument("--no-lookup", action="store_true",
                   help="draft/EAGLE: do not add suffix decoding's guesses to the model's (default: add them)")


def _add_history_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-history", action="store_true", help="suffix decoding: neither guess from nor keep this "
                   "model's earlier conversations on this machine (`localspec forget` clears what is kept)")
    # one path a flag: a list of them would swallow the prompt written after it
    p.add_argument("--context", dest="context_paths", action="append", default=[], metavar="PATH", help="suffix decoding "
                   "also guesses from this file (a folder: its text files), for this session (repeatable)")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=512)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument("--daemon", action="store_true", help="answer through this home's resident engine, starting one "
                       "in the background if none runs, so the next prompt finds the model loaded (also: LOCALSPEC_DAEMON=1)")
    where.add_argument("--no-daemon", action="store_true", help="answer in this process, even when a resident engine "
                       "runs (default: use one that runs with the same model and options; also: LOCALSPEC_DAEMON=0)")
    p.add_argument("--keep-alive", default="5m", metavar="DURATION", help="with --daemon: how long the engine it starts "
                   "keeps the model loaded after the last answer (30s, 5m, 1h, 0, forever; default 5m)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localspec", description="Lossless speculative decoding on your own machine.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="answer one prompt, streaming to stdout")
    run.add_argument("prompt", help="the prompt, or - to read it from stdin")
    _add_model_options(run)
    _add_history_options(run)
    run.add_argument("--proposer", default="auto", choices=proposer_catalog.CHOICES,
                     help=f"who guesses the next tokens (auto: the fastest that can run here); {PROPOSER_HELP}")
    _add_sampling_options(run)
    run.add_argument("--system", default=None, help="system prompt")
    run.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    run.add_argument("--quiet", action="store_true", help="no progress or notices on stderr")
    run.add_argument("--verbose", action="store_true",
                     help="after the first line's few words, why these weights and this proposer in full")
    run.add_argument("--timings", action="store_true",
                     help="after the answer, where the wall clock went: imports, registry, tokenizer, loads, "
                     "calibration, prefill, decode (also in --json)")
    _add_engine_options(run)

    bench = sub.add_parser("bench", help="compare proposers and transformers' generate on a prompt set")
    _add_model_options(bench)
    bench.add_argument("--proposers", default=None, help="comma-separated proposers to run (those that cannot run "
                       f"for the model are skipped; default: {','.join(reversed(proposer_catalog.KINDS))}; "
                       "with --trace: none,auto and these)")
    bench.add_argument("--trace", default=None, metavar="FILE", help="replay a session instead: a JSON list of "
                       "conversations (user turns) streamed through the OpenAI API, history resent each turn")
    bench.add_argument("--prompts", default=None, help="JSON file: a list of {name, prompt} objects")
    bench.add_argument("--max-new-tokens", type=int, default=128)
    bench.add_argument("--no-hf", action="store_true", help="skip transformers' own generate modes")
    bench.add_argument("--llama-cpp", default=None, metavar="DIR",
                       help="llama.cpp's bin folder: also run its plain and speculative decoding on the same GGUF "
                       "and prompts, and report the ratios")
    bench.add_argument("--perplexity", default=None, metavar="TEXT",
                       help="measure quality instead of speed: perplexity on this text file (llama-perplexity's method) "
                       "for each --quant format beside the float32 model of the same file, and llama.cpp's with --llama-cpp")
    bench.add_argument("--context", type=int, default=512, help="--perplexity: tokens per chunk")
    bench.add_argument("--chunks", type=int, default=4, help="--perplexity: at most this many chunks")
    bench.add_argument("--out", default=None, help="write the JSON report here (default: bench-results/<time>.json)")

    sub.add_parser("models", help="list the models localspec knows, which are downloaded, and their pairings")

    pull = sub.add_parser("pull", help="download a model (Hugging Face Hub, else the offline mirror)")
    pull.add_argument("name", help="registry name")
    pull.add_argument("--offline", action="store_true",
                      help="no network: only the mirror's files already here (also: HF_HUB_OFFLINE=1)")
    pull.add_argument("--weights", default="auto", choices=("auto", "gguf", "float"),
                      help="for a model with a 4-bit GGUF on the hub: gguf takes it, float the 16-bit files; auto "
                      "takes the GGUF on a CPU and where the 16-bit weights would not fit")

    forget = sub.add_parser("forget", help="remove what suffix decoding kept of earlier conversations here")
    forget.add_argument("--model", default=None, help="only this model's (default: every model's)")

    rm = sub.add_parser("rm", help="delete a model's downloads and converted copies")
    rm.add_argument("name", help="registry name")

    pair = sub.add_parser("pair", help="measure the proposers for a target here and keep the fastest")
    pair.add_argument("target", nargs="?", default=None, help="registry name (default: choose among those that fit)")
    pair.add_argument("--prompts", default=None, help="JSON file: a list of {name, prompt} objects to measure on")
    pair.add_argument("--max-new-tokens", type=int, default=64)
    pair.add_argument("--dtype", default="auto", choices=DTYPES)
    pair.add_argument("--offline", action="store_true", help="no network: only models already downloaded")

    train = sub.add_parser("train-eagle", help="train an EAGLE head for a target on this machine (resumable)")
    train.add_argument("--target", default=None, help="registry name or .gguf path (default: the registry's default model)")
    train.add_argument("--out", default=None, help="output folder (default: where --proposer eagle/auto look for it)")
    train.add_argument("--data", action="append", default=None, help="text/code file or folder (repeatable; default: the Python standard library)")
    train.add_argument("--self-distill", type=int, default=0, metavar="N", help="also train on the target's own answers to N prompts")
    train.add_argument("--eagle1", action="store_true", help="EAGLE-1 layout (final hidden state, target's lm_head) instead of EAGLE-3")
    train.add_argument("--max-tokens", type=int, default=60_000, help="training tokens taken from the files")
    train.add_argument("--epochs", type=int, default=4)
    train.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocabulary size")
    train.add_argument("--ttt-steps", type=int, default=3, help="unrolled training-time-test steps")
    train.add_argument("--intermediate-size", type=int, default=None, help="the head's MLP width (default: the target's)")
    train.add_argument("--answer-tokens", type=int, default=160, help="longest self-distilled answer")
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--quant", default="auto", metavar="|".join(QUANTS), help="target weights, as it will run")
    train.add_argument("--dtype", default="auto", choices=DTYPES)

    chat = sub.add_parser("chat", help="terminal chat with live speculation statistics (also: bare `localspec`)")
    _add_model_options(chat)
    _add_history_options(chat)
    chat.add_argument("--proposer", default="auto", choices=proposer_catalog.CHOICES)
    _add_sampling_options(chat)
    chat.add_argument("--system", default="", help="system prompt")
    chat.add_argument("--fake-engine", action="store_true", help=argparse.SUPPRESS)  # scripted answers, for tests
    _add_engine_options(chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server for editors, agents and web UIs")
    _add_model_options(serve)
    _add_history_options(serve)
    serve.add_argument("--proposer", default="auto", choices=proposer_catalog.CHOICES)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $LOCALSPEC_API_KEY)")
    serve.add_argument("--insecure", action="store_true", help="allow a non-local --host without an API key")
    serve.add_argument("--cors", action="append", default=[], metavar="ORIGIN", help="let browsers from ORIGIN call the API (repeatable)")
    serve.add_argument("--queue", type=int, default=8, help="requests that may wait while one generates (beyond: 429)")
    serve.add_argument("--keep-alive", default="5m", metavar="DURATION", help="unload the model after this long without "
                       "a request; the next one loads it again (30s, 5m, 1h, 0, forever; default 5m)")
    serve.add_argument("--exit-when-idle", action="store_true", help="stop the server when the keep-alive unloads the model")
    return parser


def spec_from(args: argparse.Namespace, proposer: str) -> SpecConfig:
    missing = [path for path in getattr(args, "context_paths", ()) if not Path(path).expanduser().exists()]
    if missing:  # before any model loads
        raise LocalspecError(f"--context: {missing[0]} does not exist")
    return SpecConfig(
        proposer=proposer, draft_len=args.draft_len, max_draft_len=args.max_draft_len,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, draft_quant=args.draft_quant,
        quant=getattr(args, "quant", "auto"), tree_top_k=args.tree_top_k, tree_nodes=args.tree_nodes,
        tree_depth=args.tree_depth, lookup=not args.no_lookup,
        # run, chat and serve have the history options; bench never guesses from earlier answers
        history=not getattr(args, "no_history", True),
        context=tuple(str(Path(path).expanduser().resolve()) for path in getattr(args, "context_paths", ())),
    )


def _read_prompt(arg: str) -> str:
    if arg != "-":
        try:  # bytes that are not UTF-8 arrive as lone surrogates, which no tokenizer can encode
            arg.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise LocalspecError(f"the prompt argument is not valid UTF-8 (character {exc.start})") from None
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
    check_text(prompt)  # before any model loads
    say = (lambda line: None) if args.quiet or args.json else (lambda line: print(f"localspec: {line}", file=sys.stderr))
    timings.record("imports", timings.since_process_start())

    if (engine := _resident_engine(args, spec, say)) is not None:
        from localspec.apps import resident

        try:
            return _answer(args, engine.generate(prompt, sampling, limits, system=args.system), lambda: engine.about,
                           resident=engine.record.pid)
        except resident.EngineLost as lost:
            if not args.json:
                print()  # the partial answer's line ends; the whole answer follows
            say(f"{lost}; answering in-process")
            resident.find_engine(say)  # a killed engine's file goes now

    with timings.phase("imports"):
        from localspec.store.session import open_session

    session = open_session(args.model, args.proposer, args.dtype, spec, quiet=args.quiet or args.json)
    details = session.details()
    _first_lines(args, details)
    return _answer(args, session.engine.generate(prompt, sampling, limits, system=args.system), lambda: details,
                   record=session.record)


def _resident_engine(args: argparse.Namespace, spec: SpecConfig, say):
    """The resident engine to answer through (started first with --daemon), or None: in-process."""
    from localspec.apps import resident

    model = load_registry().get(args.model).name
    record = resident.connect(model, args.dtype, spec, _daemon_choice(args), args.keep_alive, say)
    if record is None:
        return None
    return resident.ResidentEngine(record, say, on_start=lambda about: _first_lines(args, about, record.pid))


def _daemon_choice(args: argparse.Namespace) -> bool | None:
    """--daemon: True (start one if none runs); --no-daemon: False; neither: None (the setting decides)."""
    return True if args.daemon else False if args.no_daemon else None


def _first_lines(args: argparse.Namespace, details: dict, resident: int | None = None) -> None:
    """The model and, in a few words, its weights and proposer (in full with --verbose)."""
    if args.quiet or args.json:
        return
    where = f" · resident engine, pid {resident}" if resident else ""
    print(f"localspec: {details['model']}; {details['summary']}{where}", file=sys.stderr)
    if args.verbose:
        print(f"localspec: {details['weights_choice']}\nlocalspec: {details['proposer_choice']}", file=sys.stderr)


def _answer(args: argparse.Namespace, events, details, record=lambda stats: None, resident: int | None = None) -> int:
    """Stream the events to stdout (or gather them for --json), then the statistics; `details`
    gives what runs once the answer has started."""
    from localspec.core.stats import GenerationStats

    text = []
    stats = GenerationStats()  # what an answer stopped before its first pass reports
    generation_started = time.perf_counter()
    try:
        for event in events:
            stats = event.fold(stats)
            text.append(event.text)
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    finally:
        events.close()
    timings.record("prefill", stats.ttft_seconds)
    timings.record("decode", time.perf_counter() - generation_started - stats.ttft_seconds)
    about = details() or {}
    if not stats.passes and about:  # stopped before its first pass: still this proposer's answer
        stats.proposer, stats.reason = about["proposer"], about["reason"]
    record(stats)
    if args.json:
        print(json.dumps({
            "text": "".join(text),
            "model": about.get("model"),
            "settings": {
                **{key: about.get(key) for key in ("proposer", "dtype", "target_weights", "draft_weights", "dtype_reason",
                                                   "device", "weights_short", "proposer_short")},
                "engine": f"resident (pid {resident})" if resident else "in-process",
                "draft_len": args.draft_len,
                "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                "max_new_tokens": args.max_new_tokens, "system": args.system, "stop": args.stop,
            },
            "stats": stats.to_dict(),
            **({"timings": timings.breakdown()} if args.timings else {}),
        }, indent=1))
    else:
        sys.stdout.write("\n")
        if not args.quiet:
            for notice in stats.notices:
                print(f"localspec: {notice}", file=sys.stderr)
            print(stats.summary(), file=sys.stderr)
        if args.timings:
            print(f"localspec: {timings.summary(timings.breakdown())}", file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from localspec.store import hub, paths

    registry = load_registry()
    print(f"{'name':20} {'arch':6} {'params':>7} {'download':>9} {'on disk':>15}  about")
    for name, entry in registry.models.items():
        on_disk = hub.disk_size(entry)
        local = f"{on_disk / 1e9:.2f} GB" if on_disk else "-"
        if on_disk and not paths.is_downloaded(entry):
            local += " partial"
        about = [entry.display]
        if name == registry.default:
            about.append("(default)")
        if entry.gguf_hub:
            about.append(f"or {entry.gguf_size / 1e9:.1f} GB as the hub's {entry.gguf_hub}")
        if entry.drafts:
            about.append(f"drafts: {', '.join(entry.drafts)}")
        if entry.paired:
            p = entry.paired
            about.append(f"paired: {pair_key(p.proposer, p.draft)}, draft length {p.draft_len}, {p.speedup:.2f}x")
        print(f"{name:20} {entry.arch:6} {entry.params:6.2f}B {entry.size / 1e9:6.2f} GB {local:>15}  {'; '.join(about)}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from localspec.store.hub import pull

    pulled = pull(load_registry().get(args.name), offline=args.offline, weights=args.weights)
    via = f" ({pulled.note})" if pulled.note else ""
    print(f"{args.name}: {pulled.source}{via}: {pulled.path}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from localspec.store.hub import rm

    freed = rm(load_registry().get(args.name))
    print(f"{args.name}: removed, {freed / 1e9:.2f} GB freed")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from localspec.store.token_history import forget, history_dir

    name = args.model  # a registry name, or one removed from it since: its history may still be here
    removed = forget(name)
    what = f"{name}'s earlier conversations" if name else "every model's earlier conversations"
    print(f"forgot {what}: {len(removed)} file{'' if len(removed) == 1 else 's'} removed from {history_dir()}")
    return 0


def cmd_pair(args: argparse.Namespace) -> int:
    from localspec.apps.pairing import pair

    pair(
        args.target, prompts_file=args.prompts, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
        offline=args.offline, ask=input if sys.stdin.isatty() else None,
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.perplexity:
        from localspec.apps.perplexity import run_perplexity

        return run_perplexity(args, load_registry().get(args.model))
    if args.trace:
        from localspec.apps.trace_bench import run_trace

        return run_trace(args, spec_from(args, "auto"))
    from localspec.apps.bench import run_bench

    return run_bench(args, spec_from(args, "auto"))


def cmd_train_eagle(args: argparse.Namespace) -> int:
    from localspec.apps.train_eagle import TrainSettings, train_eagle
    from localspec.store.session import load_models

    settings = TrainSettings(
        version=1 if args.eagle1 else 3, max_tokens=args.max_tokens, self_distill=args.self_distill,
        draft_vocab=args.draft_vocab, epochs=args.epochs, ttt_steps=args.ttt_steps, lr=args.lr,
        intermediate_size=args.intermediate_size, answer_tokens=args.answer_tokens,
    )
    if settings.epochs < 1 or settings.ttt_steps < 1 or settings.max_tokens < 0 or settings.self_distill < 0:
        raise LocalspecError("--epochs and --ttt-steps must be at least 1; --max-tokens and --self-distill at least 0")
    entry = load_registry().get(args.target)
    target, _, how = load_models(entry, None, "eagle", args.dtype, SpecConfig(quant=args.quant), quiet=False)
    out = Path(args.out) if args.out else eagle_head_dir(entry.name)
    print(f"localspec: training an EAGLE-{settings.version} head for {entry.name} ({how}) into {out}", file=sys.stderr)
    data = [Path(p) for p in args.data] if args.data else None
    summary = train_eagle(target, out, data, settings)
    print(json.dumps(summary, indent=1))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from localspec.apps.tui import ChatSettings, run_chat

    settings = ChatSettings(
        model=args.model, dtype=args.dtype, spec=spec_from(args, args.proposer),
        sampling=SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed),
        limits=GenerationLimits(args.max_new_tokens), system=args.system,
    )
    return run_chat(settings, fake_engine=args.fake_engine, daemon=_daemon_choice(args), keep_alive=args.keep_alive)


def cmd_serve(args: argparse.Namespace) -> int:
    from localspec.apps.resident import parse_duration
    from localspec.apps.serve.app import serve, session_loader
    from localspec.apps.serve.config import ServeConfig

    config = ServeConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get("LOCALSPEC_API_KEY") or None,
                         insecure=args.insecure, cors=tuple(args.cors), queue=args.queue,
                         keep_alive=parse_duration(args.keep_alive), exit_when_idle=args.exit_when_idle)
    model, spec = load_registry().get(args.model).name, spec_from(args, args.proposer)
    return serve(config, session_loader(model, args.proposer, args.dtype, spec), model, args.dtype, spec)


def _register_own_files(args: argparse.Namespace) -> None:
    """--model / --target given as a file: registered on first use, then named like any model."""
    from localspec.store.own_models import resolve

    for attr in ("model", "target"):
        if isinstance(getattr(args, attr, None), str):
            setattr(args, attr, resolve(getattr(args, attr), getattr(args, "own_name", None)))
    if getattr(args, "draft", None):
        from localspec.store.registry import save_user_model

        registry = load_registry()
        target = registry.get(args.model)
        draft = registry.get(resolve(args.draft)).name
        if draft == target.name:
            raise LocalspecError(f"--draft {args.draft}: a model cannot draft for itself")
        if target.drafts[:1] != (draft,):
            save_user_model(target.name, {"drafts": [draft, *(d for d in target.drafts if d != draft)]})
            print(f"localspec: {target.name} now drafts with {draft} (saved in your models.toml)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv or ["chat"])  # bare `localspec` opens the chat
    try:
        _register_own_files(args)
        return {"run": cmd_run, "models": cmd_models, "bench": cmd_bench, "chat": cmd_chat,
                "pull": cmd_pull, "rm": cmd_rm, "forget": cmd_forget, "pair": cmd_pair, "train-eagle": cmd_train_eagle,
                "serve": cmd_serve}[args.command](args)
    except LocalspecError as exc:
        print(f"localspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("localspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # whoever read stdout stopped (`| head`): end quietly, as a program killed by SIGPIPE
        # would; stdout goes to /dev/null so that the exit's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
