"""`localspec bench --trace FILE`: a replayed editing or agent session, end to end through the API.

A trace is a JSON list of conversations, each {"name", "system" (optional), "turns": [user
message, ...]}. A turn may quote real source as `{source:module.qualname}` (a function or class
of any importable module, read with `inspect` when the trace is replayed), so a trace names the
code it edits instead of carrying a copy of it.

Every mode replays every conversation the way chat clients and agents talk to a server: each turn
is streamed from /v1/chat/completions (greedy, `max_tokens` each) with the whole conversation so
far resent, the mode's own earlier answers included. localspec's modes are engines on the same
loaded weights, each served in this process on a port of its own and each with an empty suffix
history of its own (so a mode learns only from the trace's earlier turns, never from another
mode or from the user's own conversations). With `--llama-cpp DIR`, llama-server runs the same
trace on the same GGUF, plain and with each speculative type its build lists (the registered
draft's GGUF for draft-simple), one process per mode, in the same run.

Reported per turn and overall: completion tokens per second end to end (request sent to the last
token, what a waiting agent sees), tokens per pass, where the accepted tokens came from (this
conversation, earlier ones, a model), and whether each mode's answers are localspec none's.
"""

from __future__ import annotations

import http.client
import importlib
import inspect
import json
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from localspec.base.config import SpecConfig
from localspec.base.errors import LocalspecError

SOURCE = re.compile(r"\{source:([A-Za-z_][\w.]*)\}")
STARTUP_SECONDS = 600
"""How long a server may take to load before the replay gives up on it."""


# -- the trace ------------------------------------------------------------------------------------


SHIPPED = Path(__file__).parent / "prompts"
"""Traces that come with localspec: `--trace edit-session` is prompts/trace-edit-session.json."""


def load_trace(path: str) -> list[dict]:
    """The trace's conversations, their `{source:...}` quotes filled in; one clear line for any
    file that is not a trace. A name without a file of that name is a shipped trace."""
    if not Path(path).exists() and (SHIPPED / f"trace-{path}.json").is_file():
        path = str(SHIPPED / f"trace-{path}.json")
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LocalspecError(f"--trace {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(raw, list) or not raw:
        raise LocalspecError(f"--trace {path}: expected a non-empty JSON list of conversations")
    conversations = []
    for i, conversation in enumerate(raw):
        turns = conversation.get("turns") if isinstance(conversation, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise LocalspecError(f"--trace {path}: conversation {i} needs a non-empty list of user turns (strings)")
        system = conversation.get("system")
        if system is not None and not isinstance(system, str):
            raise LocalspecError(f"--trace {path}: conversation {i}'s system prompt must be a string")
        conversations.append({"name": str(conversation.get("name") or f"conversation-{i}"), "system": system,
                              "turns": [SOURCE.sub(lambda m: quoted_source(m.group(1), path), t) for t in turns]})
    return conversations


def quoted_source(dotted: str, path: str) -> str:
    """The source of module.qualname (the longest importable prefix is the module)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                found = getattr(found, name)
            return inspect.getsource(found)
        except (AttributeError, OSError, TypeError):
            break
    raise LocalspecError(f"--trace {path}: cannot read the source of {dotted}")


# -- one client, as editors and agents are ---------------------------------------------------------


def stream_turn(port: int, messages: list[dict], max_tokens: int, model: str) -> dict:
    """One streamed chat completion: its text, completion tokens, end-to-end and first-token
    seconds (client clock), and the server's `timings` (llama-server's names; localspec adds its own)."""
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=STARTUP_SECONDS)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise LocalspecError(f"the server on port {port} answered {response.status}: {response.read()[:300]!r}")
    text, first, timings, usage = [], None, {}, {}
    for line in response:
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[len(b"data: "):])
        timings = chunk.get("timings") or timings
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            if content := (choice.get("delta") or {}).get("content"):
                first = first or time.perf_counter()
                text.append(content)
    seconds = time.perf_counter() - started
    connection.close()
    tokens = usage.get("completion_tokens", timings.get("predicted_n", 0))
    return {"text": "".join(text), "tokens": tokens, "seconds": seconds,
            "ttft_seconds": (first - started) if first else seconds, "timings": timings}


def replay(port: int, trace: list[dict], max_tokens: int, model: str, say) -> list[dict]:
    """Every conversation of the trace, turn by turn, the conversation so far resent each time."""
    turns = []
    for conversation in trace:
        messages = [{"role": "system", "content": conversation["system"]}] if conversation["system"] else []
        for number, user in enumerate(conversation["turns"], start=1):
            messages.append({"role": "user", "content": user})
            result = stream_turn(port, messages, max_tokens, model)
            messages.append({"role": "assistant", "content": result["text"]})
            turns.append({"conversation": conversation["name"], "turn": number, **result,
                          "tokens_per_second": result["tokens"] / result["seconds"] if result["seconds"] else 0.0,
                          **passes_of(result["timings"], result["tokens"])})
            say(f"{conversation['name']} turn {number}: {result['tokens']} tokens, "
                f"{turns[-1]['tokens_per_second']:.2f} tok/s end to end")
    return turns


def passes_of(timings: dict, tokens: int) -> dict:
    """Tokens per pass and where accepted tokens came from, from either server's timings."""
    accepted = timings.get("draft_n_accepted", 0) or 0
    passes = timings.get("passes") or max(tokens - accepted, 1)  # llama-server: each pass adds its accepted + 1
    return {"tokens_per_pass": tokens / passes if passes else 0.0, "drafted": timings.get("draft_n", 0) or 0,
            "accepted": accepted, "history_accepted": timings.get("history_n_accepted", 0)}


def summary(turns: list[dict]) -> dict:
    tokens, seconds = sum(t["tokens"] for t in turns), sum(t["seconds"] for t in turns)
    passes = sum(t["tokens"] / t["tokens_per_pass"] for t in turns if t["tokens_per_pass"])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds if seconds else 0.0,
            "tokens_per_pass": tokens / passes if passes else 0.0,
            "accepted": sum(t["accepted"] for t in turns), "history_accepted": sum(t["history_accepted"] for t in turns)}


# -- localspec's modes ------------------------------------------------------------------------------


def free_port() -> socket.socket:
    from localspec.apps.serve.app import listen

    return listen("127.0.0.1", 0)


def localspec_modes(entry, registry, spec: SpecConfig, dtype: str, modes: list[str], trace: list[dict],
                    max_tokens: int, say) -> tuple[dict[str, list[dict]], dict]:
    """Each mode's replay on one load of the weights (and the draft, when a mode needs it)."""
    import uvicorn

    from localspec.apps.serve.app import create_app
    from localspec.apps.serve.turns import Served
    from localspec.store import proposer_catalog
    from localspec.store.machine import situation
    from localspec.store.session import costs_for, describe_weights, draft_entry_for, draft_pays, load_models, make_engine
    from localspec.store.token_history import empty_history

    spec = replace(spec, history=True)  # the suffix history is what a replayed session is about
    ranked = proposer_catalog.rank_proposers("auto", entry, registry, **situation(registry, entry.name))
    needs_draft = any(m != "auto" and proposer_catalog.kind(m).draft_model for m in modes) or (
        "auto" in modes and any(c.draft for c in ranked))
    draft_entry = draft_entry_for(registry, entry) if needs_draft and entry.drafts else None
    target, draft, dtype_reason = load_models(entry, draft_entry, "draft" if draft_entry else "suffix", dtype, spec, quiet=False)
    # what `--proposer auto` opens on these weights: the first ranked, a draft only where its measured step pays
    auto = next(c.proposer for c in ranked if not proposer_catalog.kind(c.proposer).draft_model
                or (draft is not None and draft_pays(costs_for(target, draft), spec.max_draft_len)))
    results: dict[str, list[dict]] = {}
    for mode in modes:
        proposer = auto if mode == "auto" else mode
        with empty_history():  # an empty suffix history for this mode alone
            engine = make_engine(target, draft, proposer, spec, f"bench --trace ({mode})")
            sock = free_port()
            server = uvicorn.Server(uvicorn.Config(create_app(lambda: Served(entry.name, engine)), log_level="warning"))
            thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
            thread.start()
            try:
                wait_ready(sock.getsockname()[1], lambda: thread.is_alive())
                say(f"localspec {mode}{f' ({proposer})' if mode == 'auto' else ''}:")
                results[mode] = replay(sock.getsockname()[1], trace, max_tokens, entry.name, say)
            finally:
                server.should_exit = True
                thread.join(timeout=30)
                if engine.proposer is not None:
                    engine.proposer.close()
    how = {"auto": auto, "dtype_reason": str(dtype_reason), "target_weights": describe_weights(target),
           "draft_model": draft.name if draft else None}
    return results, how


def wait_ready(port: int, alive) -> None:
    """Until /health answers 200 (a server loads its model first), or the server is gone."""
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if not alive():
            raise LocalspecError(f"the server for port {port} stopped before it was ready")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise LocalspecError(f"the server on port {port} was not ready within {STARTUP_SECONDS} s")


# -- llama-server's modes ---------------------------------------------------------------------------


def llama_server_modes(folder: str, gguf: Path, draft_gguf: Path | None, threads: int, context: int,
                       trace: list[dict], max_tokens: int, model: str, say) -> dict[str, list[dict]]:
    """llama-server plain and with each speculative type its build lists, on the same trace."""
    from localspec.apps.llamacpp import parse_spec_types

    server = Path(folder).expanduser() / "llama-server"
    if not server.is_file():
        raise LocalspecError(f"--llama-cpp {folder}: no llama-server there (build llama.cpp's llama-server target)")
    listed = parse_spec_types(subprocess.run([str(server), "--help"], capture_output=True, text=True).stdout) or []
    types = [t for t in listed if draft_gguf is not None or t != "draft-simple"]
    results: dict[str, list[dict]] = {}
    for mode in ["plain", *types]:
        sock = free_port()
        port = sock.getsockname()[1]
        sock.close()  # llama-server binds it itself
        cmd = [str(server), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
               "-c", str(context), "-np", "1", "--temp", "0"]
        if mode != "plain":
            cmd += ["--spec-type", mode]
        if mode == "draft-simple":
            cmd += ["-md", str(draft_gguf), "-td", str(threads)]
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(port, lambda: process.poll() is None)
            say(f"llama-server {mode}:")
            results[mode] = replay(port, trace, max_tokens, model, say)
        finally:
            process.terminate()
            process.wait(timeout=30)
    return results


# -- the whole comparison ---------------------------------------------------------------------------


def run_trace(args, spec: SpecConfig) -> int:
    import torch

    from localspec.apps.bench import machine_info, write_report
    from localspec.store.tokenizers import gguf_file
    from localspec.store.registry import load_registry
    from localspec.store.session import draft_entry_for

    def say(line: str) -> None:
        print(f"localspec: {line}", file=sys.stderr, flush=True)

    trace = load_trace(args.trace)
    registry = load_registry()
    entry = registry.get(args.model)
    from localspec.store import proposer_catalog

    asked = [p.strip() for p in (args.proposers or "").split(",") if p.strip()]
    for name in asked:
        if name != "auto":
            proposer_catalog.kind(name)  # an unknown one: one line, before anything loads
            if why_not := proposer_catalog.unavailable(name, entry):
                raise LocalspecError(f"--proposers: {why_not}")
    modes = ["none", "auto", *[p for p in asked if p not in ("none", "auto")]]
    llama = None
    if args.llama_cpp:  # checked before minutes of loading
        if entry.mirror is None and entry.gguf is None:
            raise LocalspecError(f"--llama-cpp runs llama.cpp on the model's GGUF file, and {entry.name} has none")
        draft = draft_entry_for(registry, entry) if entry.drafts else None
        llama = (gguf_file(entry), gguf_file(draft) if draft is not None and (draft.mirror or draft.gguf) else None)
    results, how = localspec_modes(entry, registry, spec, args.dtype, modes, trace, args.max_new_tokens, say)
    threads = torch.get_num_threads()
    report = {"model": entry.name, "trace": str(args.trace), "max_tokens_per_turn": args.max_new_tokens,
              "conversations": len(trace), "turns": sum(len(c["turns"]) for c in trace), "machine": machine_info(), **how,
              "localspec": {mode: {"overall": summary(turns), "turns": turns} for mode, turns in results.items()}}
    baseline = [t["text"] for t in results["none"]]
    for mode, turns in results.items():
        report["localspec"][mode]["same_answers_as_none"] = [t["text"] for t in turns] == baseline
    if llama is not None:
        runs = llama_server_modes(args.llama_cpp, *llama, threads, 8192, trace, args.max_new_tokens, entry.name, say)
        report["llama_server"] = {mode: {"overall": summary(turns), "turns": turns} for mode, turns in runs.items()}
        best = max(runs, key=lambda m: report["llama_server"][m]["overall"]["tokens_per_second"])
        rate = report["llama_server"][best]["overall"]["tokens_per_second"]
        report["vs_llama_server"] = {
            "best_mode": best, "best_tokens_per_second": rate,
            **{f"{mode}_vs_best": r["overall"]["tokens_per_second"] / rate for mode, r in report["localspec"].items()},
        }
    auto, none = report["localspec"]["auto"]["overall"], report["localspec"]["none"]["overall"]
    report["auto_vs_none"] = auto["tokens_per_second"] / none["tokens_per_second"] if none["tokens_per_second"] else None
    for t in (t for side in ("localspec", "llama_server") for r in report.get(side, {}).values() for t in r["turns"]):
        t.pop("text")
        t.pop("timings")
    print_trace(report)
    write_report(report, args.out, f"trace-{entry.name}")
    return 0


def print_trace(report: dict) -> None:
    print("| side | mode | tok/s end to end | tokens/pass | accepted (from history) | answers = none |")
    print("|---|---|---|---|---|---|")
    for side in ("localspec", "llama_server"):
        for mode, r in report.get(side, {}).items():
            o = r["overall"]
            same = r.get("same_answers_as_none", "")
            print(f"| {side} | {mode} | {o['tokens_per_second']:.2f} | {o['tokens_per_pass']:.2f} | "
                  f"{o['accepted']} ({o['history_accepted']}) | {same} |")
    if "vs_llama_server" in report:
        v = report["vs_llama_server"]
        print(f"auto {v['auto_vs_best']:.2f}x llama-server's best ({v['best_mode']}, {v['best_tokens_per_second']:.2f} tok/s); "
              f"auto {report['auto_vs_none']:.2f}x localspec none")
