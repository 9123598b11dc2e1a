"""llama.cpp beside localspec in one benchmark run (`localspec bench --llama-cpp DIR`).

The user points at their own llama.cpp build; its tools run as subprocesses on the same GGUF
files, the same prompt text (already rendered through the model's chat template, so both sides
decode the same tokens), greedy, with the same thread count. Figures are read from the tools'
own timing lines, which is why every parser here fails with one clear line rather than guessing.
No torch: this module only runs programs and reads their output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from localspec.base.errors import LocalspecError

COMPLETION, SPECULATIVE, BENCH = "llama-completion", "llama-speculative-simple", "llama-bench"
TOOLS = (COMPLETION, SPECULATIVE, BENCH)
# the speculative modes compared, when the build lists them under --spec-type: the draft model,
# and the two n-gram lookups that need no second model
SPEC_TYPES = ("draft-simple", "ngram-simple", "ngram-mod")

_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")
_ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")


@dataclass
class Measured:
    """One finished tool run: its output, wall clock, and peak resident memory (None where the
    OS cannot say for one child)."""

    stdout: str
    stderr: str
    seconds: float
    peak_rss_mb: float | None


# The kernel starts a child's peak-memory count at its parent's size when it was spawned, so a
# tool spawned straight from the benchmark (which holds the models) would report the benchmark's
# gigabytes. This launcher, a few MB itself, spawns the tool and reports what wait4 says of it.
_LAUNCHER = """
import os, sys, time
start = time.perf_counter()
pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(f"{time.perf_counter() - start} {usage.ru_maxrss} {os.waitstatus_to_exitcode(status)}")
"""


def measured_run(cmd: list[str], what: str) -> Measured:
    """Run a program to its end; a failure is one line naming `what` and the program's last words.

    Wall clock and peak memory are those of the program alone, as the kernel accounts them
    (not sampled, so a short spike is not missed). Without wait4 (Windows) only the wall clock.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r", suffix=".rusage") as usage:
        exact = hasattr(os, "wait4") and hasattr(os, "posix_spawnp")
        argv = [sys.executable, "-c", _LAUNCHER, usage.name, *cmd] if exact else cmd
        start = time.perf_counter()
        try:
            status = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err).returncode
        except OSError as exc:
            raise LocalspecError(f"{what}: cannot start {cmd[0]}: {exc}") from exc
        seconds, peak = time.perf_counter() - start, None
        if exact:
            try:
                child_seconds, maxrss, status = usage.read().split()
            except ValueError:  # the launcher itself failed: the program could not be started
                err.seek(0)
                last = err.read().decode("utf-8", "replace").strip().splitlines()[-1:] or ["no message"]
                raise LocalspecError(f"{what}: cannot start {cmd[0]}: {last[0]}") from None
            scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
            seconds, peak, status = float(child_seconds), int(maxrss) * scale / 2**20, int(status)
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        stderr = err.read().decode("utf-8", "replace")
    if status != 0:
        last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "no message")
        raise LocalspecError(f"{what}: {Path(cmd[0]).name} exited with status {status}: {last}")
    return Measured(stdout, stderr, seconds, peak)


def _unreadable(tool: str, what: str) -> LocalspecError:
    return LocalspecError(f"cannot read {what} from {tool}'s output (a llama.cpp version this parser does not know?)")


def parse_completion(text: str) -> dict:
    """llama-completion's timing lines -> prompt and decode figures."""
    prompt, decode = _PROMPT_EVAL.search(text), _EVAL.search(text)
    if prompt is None or decode is None:
        raise _unreadable(COMPLETION, "the prompt eval / eval timings")
    prompt_ms, prompt_tokens = float(prompt[1]), int(prompt[2])
    eval_ms, runs = float(decode[1]), int(decode[2])
    return {
        "prompt_tokens": prompt_tokens, "prompt_seconds": prompt_ms / 1000,
        "prompt_tokens_per_second": prompt_tokens / prompt_ms * 1000 if prompt_ms > 0 else 0.0,
        "tokens": runs, "decode_tokens_per_second": runs / eval_ms * 1000 if eval_ms > 0 else 0.0,
    }


def parse_speculative(text: str) -> dict:
    """llama-speculative-simple's summary -> prompt and decode figures and its acceptance."""
    found = [pattern.search(text) for pattern in (_ENCODED, _DECODED, _DRAFTED, _ACCEPTED)]
    if not all(found):
        raise _unreadable(SPECULATIVE, "the encoded / decoded / n_drafted / n_accept lines")
    encoded, decoded, drafted, accepted = found
    prompt_s, decode_s = float(encoded[2]), float(decoded[2])
    n_drafted = int(drafted[1])
    return {
        "prompt_tokens": int(encoded[1]), "prompt_seconds": prompt_s,
        "prompt_tokens_per_second": int(encoded[1]) / prompt_s if prompt_s > 0 else 0.0,
        "tokens": int(decoded[1]), "decode_tokens_per_second": int(decoded[1]) / decode_s if decode_s > 0 else 0.0,
        "drafted": n_drafted, "accepted": int(accepted[1]),
        "acceptance_rate": int(accepted[1]) / n_drafted if n_drafted else 0.0,
    }


def parse_bench(text: str) -> dict:
    """llama-bench -o json -> milliseconds of a pass per prompt width, and decode tok/s per length."""
    try:
        rows = json.loads(text)
        pass_ms = {int(r["n_prompt"]): r["avg_ns"] / 1e6 for r in rows if r["n_gen"] == 0}
        decode = {int(r["n_gen"]): float(r["avg_ts"]) for r in rows if r["n_prompt"] == 0}
    except (ValueError, TypeError, KeyError) as exc:
        raise _unreadable(BENCH, "the JSON results") from exc
    if not pass_ms and not decode:
        raise _unreadable(BENCH, "any pp or tg result")
    return {"pass_ms": pass_ms, "decode_tokens_per_second": decode}


def parse_spec_types(help_text: str) -> list[str] | None:
    """The speculative modes of SPEC_TYPES that llama-speculative-simple lists under --spec-type;
    None when it has no --spec-type at all (an older build: the draft model is its only mode)."""
    line = next((line for line in help_text.splitlines() if "--spec-type" in line), None)
    if line is None:
        return None
    return [t for t in SPEC_TYPES if re.search(rf"(?<![\w-]){re.escape(t)}(?![\w-])", line)]


@dataclass
class LlamaCpp:
    """A llama.cpp bin folder and the thread count both sides use."""

    bin_dir: Path
    threads: int

    @classmethod
    def at(cls, folder: str | Path, threads: int) -> "LlamaCpp":
        """Checked up front, so a wrong folder fails before any model is loaded."""
        bin_dir = Path(folder).expanduser()
        if not bin_dir.is_dir():
            raise LocalspecError(f"--llama-cpp {folder}: no such folder (give llama.cpp's build/bin)")
        # which, not a bare path: on Windows the programs are llama-completion.exe and so on
        missing = [t for t in TOOLS if shutil.which(t, path=str(bin_dir)) is None]
        if missing:
            raise LocalspecError(f"--llama-cpp {folder}: no {', '.join(missing)} there (build llama.cpp's {', '.join(TOOLS)} targets)")
        return cls(bin_dir, threads)

    def _tool(self, name: str) -> str:
        return str(self.bin_dir / name)

    def spec_types(self, has_draft: bool) -> list[str]:
        """The speculative modes to run: those this build accepts, the draft's only with a draft GGUF."""
        types = parse_spec_types(measured_run([self._tool(SPECULATIVE), "--help"], f"{SPECULATIVE} --help").stdout)
        if types is None:
            types = ["draft"]  # before --spec-type, speculative-simple always speculated with -md
        return [t for t in types if has_draft or t not in ("draft", "draft-simple")]

    def _common(self, gguf: Path, prompt_text: str, max_new: int) -> list[str]:
        # -p with --no-escape: the prompt's bytes exactly (-f drops a final newline, and escapes
        # such as a literal backslash-n in code would otherwise be rewritten); greedy
        return ["-m", str(gguf), "-p", prompt_text, "--no-escape", "-n", str(max_new), "-t", str(self.threads),
                "--temp", "0"]

    def generate(self, gguf: Path, prompt_text: str, max_new: int, spec: str | None = None,
                 draft: Path | None = None) -> dict:
        """Greedy decoding of one prompt: plain (llama-completion) or with a speculative mode."""
        common = self._common(gguf, prompt_text, max_new)
        if spec is None:
            # -no-cnv: the prompt is already in the chat template, and no interactive turn follows
            run = measured_run([self._tool(COMPLETION), *common, "-no-cnv"], COMPLETION)
            return {**parse_completion(run.stderr + run.stdout), "mode": "plain"}
        cmd = [self._tool(SPECULATIVE), *common]
        if spec in ("draft", "draft-simple"):
            cmd += ["-md", str(draft), "-td", str(self.threads)]
        if spec != "draft":
            cmd += ["--spec-type", spec]
        run = measured_run(cmd, f"{SPECULATIVE} ({spec})")
        return {**parse_speculative(run.stderr + run.stdout), "mode": spec}

    def pass_costs(self, gguf: Path, widths: tuple[int, ...], depth: int, decode_len: int) -> dict:
        """llama-bench: one pass over each width after `depth` tokens of context, and decode speed."""
        cmd = [self._tool(BENCH), "-m", str(gguf), "-t", str(self.threads), "-p", ",".join(map(str, widths)),
               "-n", str(decode_len), "-d", str(depth), "-r", "3", "-o", "json"]
        return parse_bench(measured_run(cmd, BENCH).stdout)

    def one_shot(self, gguf: Path, prompt_text: str, max_new: int) -> dict:
        """What a one-shot user waits for: llama-completion start to end, its other settings default."""
        run = measured_run([self._tool(COMPLETION), *self._common(gguf, prompt_text, max_new), "-no-cnv"], COMPLETION)
        return {"seconds": run.seconds, "peak_rss_mb": run.peak_rss_mb}


def best(runs: dict[str, dict]) -> tuple[str, dict]:
    """The mode with the highest decode tok/s among `runs` (mode -> one prompt's result)."""
    mode = max(runs, key=lambda m: runs[m]["decode_tokens_per_second"])
    return mode, runs[mode]


def ratios(localspec: dict[str, dict], llama: dict[str, dict], baseline: str) -> dict:
    """One prompt's side-by-side figures, in decode tok/s: localspec's best mode over llama.cpp's
    best (plain included: a speculative mode that loses to plain is not llama.cpp's best), and
    localspec's `baseline` (plain decoding) over llama.cpp plain."""
    ours, our_best = best(localspec)
    spec_modes = {m: r for m, r in llama.items() if m != "plain"}
    theirs, their_best = best(llama)
    spec = best(spec_modes) if spec_modes else (None, None)
    plain = llama["plain"]["decode_tokens_per_second"]
    their_rate = their_best["decode_tokens_per_second"]
    return {
        "localspec_none": localspec[baseline]["decode_tokens_per_second"],
        "localspec_best_mode": ours, "localspec_best": our_best["decode_tokens_per_second"],
        "llama_cpp_plain": plain,
        "llama_cpp_best_speculative_mode": spec[0],
        "llama_cpp_best_speculative": spec[1]["decode_tokens_per_second"] if spec[1] else None,
        "llama_cpp_best_mode": theirs, "llama_cpp_best": their_rate,
        # None where llama.cpp decoded nothing to divide by (one new token has no decode time)
        "best_vs_best": our_best["decode_tokens_per_second"] / their_rate if their_rate else None,
        "none_vs_plain": localspec[baseline]["decode_tokens_per_second"] / plain if plain else None,
    }
