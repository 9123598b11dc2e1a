"""`bench --llama-cpp`: reading llama.cpp's output, running its tools, and the side-by-side ratios.

The output samples below were captured from llama.cpp's own tools (the build of
shared/tools/llamacpp-baseline.sh, Qwen2.5-Coder-1.5B Q4_K_M, on a machine shared with other work,
hence the slow figures). No llama.cpp is needed: fake tools in a temp folder print these samples.
"""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from localspec.apps.bench import print_llama_cpp
from localspec.apps.cli import main
from localspec.base.errors import LocalspecError
from localspec.apps.llamacpp import (
    LlamaCpp, best, measured_run, parse_bench, parse_completion, parse_spec_types, parse_speculative, ratios,
)

COMPLETION_ERR = """\
1.34.577.334 I common_perf_print:    sampling time =      10.06 ms
1.34.577.360 I common_perf_print:    samplers time =       2.36 ms /    68 tokens
1.34.577.378 I common_perf_print:        load time =   10167.10 ms
1.34.577.392 I common_perf_print: prompt eval time =    8087.15 ms /    52 tokens (  155.52 ms per token,     6.43 tokens per second)
1.34.577.405 I common_perf_print:        eval time =   73013.68 ms /    15 runs   ( 4867.58 ms per token,     0.21 tokens per second)
1.34.577.417 I common_perf_print:       total time =   81202.70 ms /    67 tokens
1.34.577.430 I common_perf_print: unaccounted time =      91.81 ms /   0.1 %      (total - sampling - prompt eval - eval) / (total)
1.34.577.441 I common_perf_print:    graphs reused =         14
"""

# llama-speculative-simple --spec-type draft-simple: its summary, then the target's perf lines
SPECULATIVE_ERR = """\
2.47.768.806 I encoded   52 tokens in   19.899 seconds, speed:    2.613 t/s
2.47.768.811 I decoded   16 tokens in   93.550 seconds, speed:    0.171 t/s
2.47.768.811 I 
2.47.768.812 I n_draft   = 3
2.47.768.812 I n_predict = 16
2.47.768.813 I n_drafted = 12
2.47.768.814 I n_accept  = 10
2.47.768.816 I accept    = 83.333%
2.47.768.817 I 
2.47.768.817 I draft:

2.47.768.868 I 
2.47.768.872 I target:

2.47.768.888 I common_perf_print: prompt eval time =   72145.84 ms /    69 tokens ( 1045.59 ms per token,     0.96 tokens per second)
2.47.768.890 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""

# --spec-type ngram-mod on a prompt where it found nothing to draft
NGRAM_NOTHING_ERR = """\
1.34.237.448 I encoded   54 tokens in    8.242 seconds, speed:    6.552 t/s
1.34.237.451 I decoded    9 tokens in   63.629 seconds, speed:    0.141 t/s
1.34.237.452 I n_draft   = 3
1.34.237.452 I n_predict = 9
1.34.237.453 I n_drafted = 0
1.34.237.453 I n_accept  = 0
1.34.237.454 I accept    = -nan%
"""

# llama-bench -p 1,4 -n 2 -d 8 -r 1 -o json (each row cut to the fields that matter here)
BENCH_JSON = """\
[
  {
    "model_type": "qwen2 1.5B Q4_K - Medium", "n_threads": 2, "poll": 50,
    "n_prompt": 1,
    "n_gen": 0,
    "n_depth": 8,
    "test_time": "2026-12-01T10:23:08Z",
    "avg_ns": 8039893267,
    "stddev_ns": 0,
    "avg_ts": 0.124380,
    "stddev_ts": 0.000000,
    "samples_ns": [ 8039893267 ],
    "samples_ts": [ 0.12438 ]
  },
  {
    "model_type": "qwen2 1.5B Q4_K - Medium", "n_threads": 2, "poll": 50,
    "n_prompt": 4,
    "n_gen": 0,
    "n_depth": 8,
    "test_time": "2026-12-01T10:23:26Z",
    "avg_ns": 2700580803,
    "stddev_ns": 0,
    "avg_ts": 1.481163,
    "stddev_ts": 0.000000,
    "samples_ns": [ 2700580803 ],
    "samples_ts": [ 1.48116 ]
  },
  {
    "model_type": "qwen2 1.5B Q4_K - Medium", "n_threads": 2, "poll": 50,
    "n_prompt": 0,
    "n_gen": 2,
    "n_depth": 8,
    "test_time": "2026-12-01T10:23:31Z",
    "avg_ns": 20531901648,
    "stddev_ns": 0,
    "avg_ts": 0.097409,
    "stddev_ts": 0.000000,
    "samples_ns": [ 20531901648 ],
    "samples_ts": [ 0.0974094 ]
  }
]
"""

SPEC_HELP = """\
--spec-draft-model, -md, --model-draft FNAME
                                        draft model for speculative decoding (default: unused)
--spec-type none,draft-simple,draft-eagle3,draft-mtp,draft-dflash,draft-dspark,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache
                                        comma-separated list of types of speculative decoding to use (default:
                                        none)
--spec-ngram-mod-n-min N                minimum number of ngram tokens to use for ngram-based speculative
"""


def test_completion_timings():
    got = parse_completion(COMPLETION_ERR)
    assert got["prompt_tokens"] == 52 and got["tokens"] == 15
    assert got["prompt_seconds"] == pytest.approx(8.08715)
    # computed from ms and count, not the rounded rate printed beside them
    assert got["decode_tokens_per_second"] == pytest.approx(15 / 73.01368)
    assert got["prompt_tokens_per_second"] == pytest.approx(52 / 8.08715)


def test_speculative_summary_not_the_target_perf_lines():
    got = parse_speculative(SPECULATIVE_ERR)
    assert got["tokens"] == 16 and got["decode_tokens_per_second"] == pytest.approx(16 / 93.55)
    assert got["prompt_tokens"] == 52 and got["prompt_seconds"] == pytest.approx(19.899)
    assert (got["drafted"], got["accepted"]) == (12, 10) and got["acceptance_rate"] == pytest.approx(10 / 12)


def test_speculative_that_drafted_nothing():
    got = parse_speculative(NGRAM_NOTHING_ERR)
    assert got["acceptance_rate"] == 0.0 and got["decode_tokens_per_second"] == pytest.approx(9 / 63.629)


def test_bench_json_pass_costs_and_decode():
    got = parse_bench(BENCH_JSON)
    assert got["pass_ms"] == pytest.approx({1: 8039.893267, 4: 2700.580803})
    assert got["decode_tokens_per_second"] == pytest.approx({2: 0.097409})


@pytest.mark.parametrize(
    "parse, text, message",
    [
        (parse_completion, "main: error: unable to load model\n", "cannot read the prompt eval / eval timings from llama-completion"),
        (parse_completion, COMPLETION_ERR.replace("eval time", "evaluation"), "llama-completion"),
        (parse_speculative, COMPLETION_ERR, "cannot read the encoded / decoded"),
        (parse_bench, "| model | size |\n", "cannot read the JSON results from llama-bench"),
        (parse_bench, '[{"n_prompt": 1}]', "llama-bench"),
        (parse_bench, "[]", "any pp or tg result"),
    ],
)
def test_unreadable_output_is_one_clear_error(parse, text, message):
    with pytest.raises(LocalspecError, match="cannot read") as info:
        parse(text)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_spec_types_from_help():
    assert parse_spec_types(SPEC_HELP) == ["draft-simple", "ngram-simple", "ngram-mod"]
    # a name that is only the prefix of a listed one does not count
    assert parse_spec_types("--spec-type none,draft-simple-x,ngram-mod2\n") == []
    assert parse_spec_types("-md, --model-draft FNAME   draft model\n") is None  # before --spec-type existed


# --- the tools, faked ---------------------------------------------------------------------------


def fake_tools(folder: Path, outputs: dict[str, tuple[str, str, int]]) -> Path:
    """Executables that record their arguments (one per line) and print the given stdout/stderr."""
    folder.mkdir(exist_ok=True)
    for name, (stdout, stderr, status) in outputs.items():
        (folder / f"{name}.out").write_text(stdout)
        (folder / f"{name}.err").write_text(stderr)
        script = folder / name
        script.write_text(
            f"#!{sys.executable}\n"
            "import sys\n"
            f"open({str(folder / (name + '.args'))!r}, 'w').write(repr(sys.argv[1:]))\n"
            f"sys.stdout.write(open({str(folder / (name + '.out'))!r}).read())\n"
            f"sys.stderr.write(open({str(folder / (name + '.err'))!r}).read())\n"
            f"sys.exit({status})\n"
        )
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return folder


def args_of(folder: Path, name: str) -> list[str]:
    import ast

    return ast.literal_eval((folder / f"{name}.args").read_text())


ALL_OK = {
    "llama-completion": ("generated text", COMPLETION_ERR, 0),
    "llama-speculative-simple": (SPEC_HELP, SPECULATIVE_ERR, 0),
    "llama-bench": (BENCH_JSON, "", 0),
}


def test_missing_tools_are_named(tmp_path):
    fake_tools(tmp_path, {"llama-bench": ALL_OK["llama-bench"]})
    with pytest.raises(LocalspecError, match=r"no llama-completion, llama-speculative-simple there"):
        LlamaCpp.at(tmp_path, 2)
    with pytest.raises(LocalspecError, match="no such folder"):
        LlamaCpp.at(tmp_path / "nope", 2)


def test_bench_refuses_a_wrong_folder_before_loading_anything(capsys):
    assert main(["bench", "--model", "smollm2-135m", "--llama-cpp", "/nonexistent/llama.cpp/bin"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "localspec: error: --llama-cpp /nonexistent/llama.cpp/bin: no such folder (give llama.cpp's build/bin)"


def test_runs_pass_the_prompt_exactly_greedy_same_threads(tmp_path):
    tools = LlamaCpp.at(fake_tools(tmp_path, ALL_OK), 3)
    prompt = "<|im_start|>user\nprint('a\\nb')<|im_end|>\n<|im_start|>assistant\n"  # a backslash-n and a final newline
    plain = tools.generate(Path("t.gguf"), prompt, 64)
    assert plain["mode"] == "plain" and plain["tokens"] == 15
    argv = args_of(tmp_path, "llama-completion")
    assert argv[argv.index("-p") + 1] == prompt and "--no-escape" in argv and "-no-cnv" in argv
    assert argv[argv.index("-n") + 1] == "64" and argv[argv.index("-t") + 1] == "3" and argv[argv.index("--temp") + 1] == "0"

    spec = tools.generate(Path("t.gguf"), prompt, 64, "draft-simple", Path("d.gguf"))
    argv = args_of(tmp_path, "llama-speculative-simple")
    assert spec["mode"] == "draft-simple" and spec["accepted"] == 10
    assert argv[argv.index("-md") + 1] == "d.gguf" and argv[argv.index("-td") + 1] == "3"
    assert argv[argv.index("--spec-type") + 1] == "draft-simple"
    tools.generate(Path("t.gguf"), prompt, 64, "ngram-mod")
    assert "-md" not in args_of(tmp_path, "llama-speculative-simple")


def test_spec_types_run_are_what_the_build_accepts(tmp_path):
    tools = LlamaCpp.at(fake_tools(tmp_path, ALL_OK), 2)
    assert tools.spec_types(has_draft=True) == ["draft-simple", "ngram-simple", "ngram-mod"]
    assert tools.spec_types(has_draft=False) == ["ngram-simple", "ngram-mod"]


def test_pass_costs_ask_for_the_widths_and_context(tmp_path):
    tools = LlamaCpp.at(fake_tools(tmp_path, ALL_OK), 2)
    got = tools.pass_costs(Path("t.gguf"), (1, 16), 128, 64)
    argv = args_of(tmp_path, "llama-bench")
    assert argv[argv.index("-p") + 1] == "1,16" and argv[argv.index("-d") + 1] == "128" and argv[argv.index("-n") + 1] == "64"
    assert argv[argv.index("-o") + 1] == "json" and got["pass_ms"][1] == pytest.approx(8039.893267)


def test_a_failing_tool_says_why_in_one_line(tmp_path):
    failing = {**ALL_OK, "llama-completion": ("", "llama_model_load: error loading model\nmain: error: unable to load model\n", 1)}
    tools = LlamaCpp.at(fake_tools(tmp_path, failing), 2)
    with pytest.raises(LocalspecError) as info:
        tools.generate(Path("t.gguf"), "hi", 8)
    assert str(info.value) == "llama-completion: llama-completion exited with status 1: main: error: unable to load model"


def test_measured_run_reports_this_childs_peak_memory():
    ballast = bytearray(400 * 2**20)  # this process is big (as the benchmark is, holding models) ...
    ballast[::4096] = b"1" * len(ballast[::4096])
    run = measured_run([sys.executable, "-c", "x = bytearray(200 * 2**20); x[::4096] = b'1' * len(x[::4096])"], "probe")
    assert run.peak_rss_mb is not None and 200 <= run.peak_rss_mb < 300
    small = measured_run([sys.executable, "-c", "pass"], "probe")
    assert small.peak_rss_mb < 100  # ... which the child's count must not start from
    del ballast


def test_measured_run_times_the_program_within_the_call():
    start = time.perf_counter()
    run = measured_run([sys.executable, "-c", "import time; time.sleep(0.3)"], "probe")
    # the program's run holds its sleep and lies inside the call (monotonic clocks, nested spans)
    assert 0.3 <= run.seconds <= time.perf_counter() - start


def test_a_program_that_cannot_start(tmp_path):
    with pytest.raises(LocalspecError, match=r"^probe: cannot start .*nope: .*No such file"):
        measured_run([str(tmp_path / "nope")], "probe")


# --- ratios and the report -------------------------------------------------------------------------


def r(rate: float) -> dict:
    return {"decode_tokens_per_second": rate}


def test_ratios_best_against_best_plain_included():
    ours = {"none": r(10.0), "ngram": r(14.0), "draft": r(21.0)}
    theirs = {"plain": r(25.0), "draft-simple": r(17.5), "ngram-mod": r(28.0)}
    got = ratios(ours, theirs, "none")
    assert (got["localspec_best_mode"], got["llama_cpp_best_mode"]) == ("draft", "ngram-mod")
    assert got["best_vs_best"] == pytest.approx(21 / 28) and got["none_vs_plain"] == pytest.approx(10 / 25)
    assert got["llama_cpp_best_speculative_mode"] == "ngram-mod"

    # every speculative mode loses: llama.cpp's best is its plain decoding
    slow = {"plain": r(30.0), "draft-simple": r(15.0)}
    got = ratios(ours, slow, "none")
    assert got["llama_cpp_best_mode"] == "plain" and got["best_vs_best"] == pytest.approx(21 / 30)
    assert got["llama_cpp_best_speculative"] == 15.0

    # only plain, and nothing decoded (one new token): no ratio rather than a division by zero
    got = ratios({"none": r(0.0)}, {"plain": r(0.0)}, "none")
    assert got["llama_cpp_best_speculative_mode"] is None and got["best_vs_best"] is None and got["none_vs_plain"] is None
    assert best({"a": r(1.0), "b": r(2.0)})[0] == "b"


def test_report_prints_the_ratios_per_prompt(capsys):
    per_prompt = [
        {"prompt": "code-edit", **ratios({"none": r(10.0), "draft": r(20.0)}, {"plain": r(25.0), "ngram-mod": r(16.0)}, "none")},
        {"prompt": "chat", **ratios({"none": r(10.0), "draft": r(12.0)}, {"plain": r(24.0)}, "none")},
    ]
    report = {
        "prompts": [{"name": "code-edit"}, {"name": "chat"}],
        "llama_cpp": {
            "threads": 2, "ratios": per_prompt,
            "pass_costs": {"context_tokens": 128, "localspec_ms": {"w8a8": {1: 83.0, 16: 154.0}},
                           "llama_cpp_ms": {1: 34.0, 16: 188.0}, "llama_cpp_decode_tokens_per_second": {64: 29.9}},
            "prompt_processing": {"localspec": {"w8a8": {"prompt_tokens": 536, "ttft_seconds": 2.5}},
                                  "llama_cpp": {"prompt_tokens": 536, "seconds": 1.0}},
            "one_shot": {"prompt": "code-edit", "tokens": 64, "localspec": {"seconds": 23.3, "peak_rss_mb": 5120.0},
                         "llama_cpp": {"seconds": 4.2, "peak_rss_mb": 2764.8},
                         "localspec_resident": {"seconds": 3.5, "ttft_seconds": 0.3, "decode_seconds": 3.2,
                                                "wall_over_decode": 3.5 / 3.2}},
        },
    }
    json.dumps(report)  # the report is written as JSON too
    print_llama_cpp(report)
    out = capsys.readouterr().out
    assert "| best localspec / best llama.cpp | 0.80x | 0.50x |" in out
    assert "| none / llama.cpp plain | 0.40x | 0.42x |" in out
    assert "| llama.cpp best speculative | 16.00 (ngram-mod) | - |" in out
    assert "| localspec (w8a8) | 83 | 154 | 1.86x |" in out and "| llama.cpp | 34 | 188 | 5.53x |" in out
    assert "localspec run 23.3 s vs llama-completion 4.2 s (5.55x), peak memory 5.00 GB vs 2.70 GB (1.85x)" in out
    assert ("one-shot through the resident engine: 3.50 s, first token after 0.30 s, 1.09x its own decode time "
            "(3.20 s); 0.83x llama-completion's wall clock") in out


def test_bench_side_with_fake_tools(tmp_path, monkeypatch, capsys):
    import localspec.apps.bench as bench

    monkeypatch.setattr(bench, "localspec_one_shot", lambda model, prompt: {"seconds": 20.0, "peak_rss_mb": 4000.0})
    monkeypatch.setattr(bench, "localspec_resident_one_shot", lambda model, prompt: {"skipped": "not here"})
    tools = LlamaCpp.at(fake_tools(tmp_path, ALL_OK), 2)
    # localspec read 53 tokens where the fake llama.cpp says 52: the comparison is flagged
    side = bench.LlamaCppSide(tools, Path("t.gguf"), Path("d.gguf"), ["<text>"], [53], "long", "<long text>")
    results = {
        "none": [{"prompt": "code-edit", "decode_tokens_per_second": 0.1}],
        "ngram": [{"prompt": "code-edit", "decode_tokens_per_second": 0.4}],
        "hf-plain": [{"prompt": "code-edit", "decode_tokens_per_second": 9.0}],  # not a localspec mode
    }
    weights = {"auto": {"vs_llama_cpp": {"weights": "w4a8", "pass_ms": {1: 700.0, 16: 1600.0},
                                         "long_prompt_tokens": 52, "ttft_seconds": 10.0}}}
    entry = SimpleNamespace(name="qwen2.5-coder-1.5b")
    got = bench.bench_llama_cpp(side, entry, [{"name": "code-edit", "prompt": "..."}], 64, results, "none", weights)
    assert list(got["results"]) == ["plain", "draft-simple", "ngram-simple", "ngram-mod"]
    ratio = got["ratios"][0]
    # the fake speculation (16 tokens in 93.55 s) is slower than the fake plain run (15 in 73.01 s)
    assert ratio["localspec_best_mode"] == "ngram" and ratio["llama_cpp_best_mode"] == "plain"
    assert ratio["best_vs_best"] == pytest.approx(0.4 / (15 / 73.01368))
    assert got["pass_costs"]["llama_cpp_ms"][1] == pytest.approx(8039.893267)
    assert got["prompt_processing"]["llama_cpp"] == {"prompt_tokens": 52, "seconds": pytest.approx(8.08715)}
    assert "warning: llama.cpp read 52 prompt tokens of code-edit, localspec 53" in capsys.readouterr().err
    report = {"prompts": [{"name": "code-edit"}], "llama_cpp": got}
    json.dumps(report)
    bench.print_llama_cpp(report)
    assert "| localspec (w4a8) | 700 | 1600 | 2.29x |" in capsys.readouterr().out
