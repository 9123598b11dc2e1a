"""Weight format choice: an explicit --dtype is the model the user asked for, even under --quant auto."""

from __future__ import annotations

import pytest
import torch

from conftest import CharTokenizer, tiny_model
from localspec.base.config import GenerationLimits, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.base.reasons import Reason
from localspec.store import machine, session
from localspec.store.loading import LoadedModel
from localspec.store.proposer_catalog import PROMPT_LOOKUP, Candidate
from localspec.store.registry import load_registry

CPU = torch.device("cpu")
FOUR_BIT = "qwen2.5-coder-1.5b"  # a Q4 GGUF mirror: auto would take w4a8 or w8a8 here


class Memory:
    def __init__(self, available):
        self.available = available


@pytest.fixture
def fast_int8_cpu(monkeypatch):
    """A CPU where auto takes an int8 format: the w4a8 kernel builds and int8 multiplies exactly."""
    monkeypatch.setattr(session, "_w4a8_kernel_name", lambda: "AVX2")
    monkeypatch.setattr(session, "w8a8_supported", lambda: True)


def test_an_explicit_dtype_keeps_float_weights_under_auto(fast_int8_cpu, monkeypatch):
    entry = load_registry().get(FOUR_BIT)
    monkeypatch.setattr(session.psutil, "virtual_memory", lambda: Memory(64e9))
    assert session.choose_quant(entry, "auto", CPU)[0] == "w4a8"  # what auto picks without a dtype
    for dtype in ("float32", "bfloat16"):
        assert session.choose_quant(entry, "auto", CPU, dtype) == ("none", f"--dtype {dtype} weights fit in memory")
    assert session.choose_quant(entry, "w8a8", CPU, "float32") == ("w8a8", "--quant w8a8")  # both explicit: --quant


def test_an_explicit_dtype_is_quantized_only_when_it_does_not_fit(fast_int8_cpu, monkeypatch):
    entry = load_registry().get(FOUR_BIT)  # 1.5B parameters: 6.2 GB in float32, 3.1 GB in bfloat16
    monkeypatch.setattr(session.psutil, "virtual_memory", lambda: Memory(5e9))
    quant, reason = session.choose_quant(entry, "auto", CPU, "float32")
    assert quant == "int8" and reason.startswith("--dtype float32 weights (6.2 GB) do not fit in 5.0 GB free")
    assert session.choose_quant(entry, "auto", CPU, "bfloat16")[0] == "none"
    monkeypatch.setattr(session.psutil, "virtual_memory", lambda: Memory(1e9))
    assert session.choose_quant(entry, "auto", CPU, "float32")[0] == "int4"


def test_the_first_line_says_float32_ran(fast_int8_cpu, monkeypatch):
    """load_models loads what choose_quant chose, and its reason (the first line) says so."""
    loads = []

    def load_model(entry, dtype, quant="none", device=None, progress=True):
        loads.append((dtype, quant))
        return LoadedModel(entry.name, tiny_model(), CharTokenizer(), dtype, CPU, 512, 0.0, False)

    monkeypatch.setattr(session, "load_model", load_model)
    monkeypatch.setattr(session, "pick_device", lambda: CPU)
    monkeypatch.setattr(session.psutil, "virtual_memory", lambda: Memory(64e9))
    entry = load_registry().get(FOUR_BIT)
    target, draft, reason = session.load_models(entry, None, "ngram", "float32", SpecConfig(), quiet=True)
    assert loads == [(torch.float32, "none")] and draft is None
    assert reason == "--dtype float32" and reason.short == "float32"


@pytest.mark.parametrize(
    "from_gguf, kernel, exact_int8, free, quant, short, full",
    [
        (True, "AVX2", True, 64e9, "auto", "w4a8 · file's own 4/6/8-bit · AVX2 kernel", "by localspec's AVX2 kernel"),
        (True, None, True, 64e9, "auto", "int4 · file's own 4-bit", "nothing re-quantized"),
        (False, None, True, 64e9, "auto", "w8a8 · exact int8 on this CPU", "multiplies int8 exactly (VNNI)"),
        (False, None, False, 3e9, "auto", "int8 · 16-bit weights do not fit", "(16-bit weights (3.1 GB) do not fit in 3.0 GB free)"),
        (False, None, False, 1e9, "auto", "int4 · 8-bit weights do not fit", "even 8-bit weights do not fit in 1.0 GB free"),
        (True, "AVX2", True, 64e9, "w8a8", "w8a8 · asked for", "(--quant w8a8)"),
    ],
)
def test_the_weights_reason_in_a_few_words_and_in_full(monkeypatch, from_gguf, kernel, exact_int8, free, quant, short, full):
    from conftest import assert_at_a_glance

    monkeypatch.setattr(session, "reads_gguf", lambda entry: from_gguf)
    monkeypatch.setattr(session, "_w4a8_kernel_name", lambda: kernel)
    monkeypatch.setattr(session, "w8a8_supported", lambda: exact_int8)
    monkeypatch.setattr(session, "load_model", lambda entry, dtype, quant="none", device=None, progress=True:
                        LoadedModel(entry.name, tiny_model(), CharTokenizer(), dtype, CPU, 512, 0.0, False))
    monkeypatch.setattr(session, "pick_device", lambda: CPU)
    monkeypatch.setattr(session.psutil, "virtual_memory", lambda: Memory(free))
    entry = load_registry().get(FOUR_BIT)
    target, _, reason = session.load_models(entry, None, "ngram", "auto", SpecConfig(quant=quant), quiet=True)
    assert reason.short == short and full in reason
    assert_at_a_glance(reason.short)
    opened = session.Session(entry, load_registry(), target, None, reason)
    assert opened.weights_choice.short == f"{short} · cpu" and opened.weights_choice == f"weights: {reason}, on cpu"
    assert_at_a_glance(opened.weights_choice.short)


def test_the_dtype_reason_in_a_few_words(monkeypatch):
    entry = load_registry().get(FOUR_BIT)
    spec = SpecConfig()
    figures = "measured float32 9.00 tok/s, bfloat16 12.00 tok/s -> bfloat16"
    monkeypatch.setattr(session, "load_calibration", lambda key: {"dtype": "bfloat16", "reason": figures})
    dtype, reason = session.choose_dtype(entry, None, "ngram", spec, CPU, quiet=True)
    assert dtype == torch.bfloat16 and reason == figures and reason.short == "bfloat16 · measured faster here"
    for native, expected in ((True, (torch.bfloat16, "bfloat16")), (False, (torch.float16, "float16"))):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native)
        dtype, reason = session.choose_dtype(entry, None, "ngram", spec, torch.device("cuda"), quiet=True)
        assert (dtype, reason.short) == expected and "(" not in reason


@pytest.mark.parametrize("entry", [[], "x", {"context=128": []}, {"context=128": {"1": "fast"}}])
def test_a_measurement_edited_into_another_shape_is_measured_again(tmp_path, monkeypatch, entry):
    import json

    from localspec.runtime import costs

    from localspec.store import measurements

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    model = tiny_model()
    key = measurements.pass_cost_key("tiny", model)
    (tmp_path / "calibration.json").write_text(json.dumps({key: entry, measurements.dtype_key("t", None, "ngram"): []}))
    monkeypatch.setattr(costs, "time_passes", lambda model, widths, context: {w: [0.5, 0.5] for w in widths})
    assert measurements.measured_costs("tiny", model, (1,)) == {1: 0.5}
    assert measurements.load_calibration(key) == {"context=128": {"1": 0.5}}
    assert measurements.load_calibration(measurements.dtype_key("t", None, "ngram")) == {}


def test_pass_costs_are_keyed_by_what_runs_the_pass(monkeypatch):
    """A changed CPU kernel or the lean pass is measured again, not read from the old entry."""
    from localspec.store import measurements

    windowed = tiny_model()
    windowed.config.sliding_window = 16  # the lean pass cannot run it: its passes take transformers' forward
    before = measurements.pass_cost_key("tiny", windowed)
    monkeypatch.setattr(measurements, "sources_digest", lambda: "changed")
    edited = measurements.pass_cost_key("tiny", windowed)
    assert edited != before and "kernels=changed" in edited
    assert measurements.pass_cost_key("tiny", tiny_model()) not in (before, edited)


# -- opening: one walk down the catalog's candidates -----------------------------------------------

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"  # a registered pair
HEAD_HERE = Reason("an EAGLE head is here", "head here")
DRAFT_FITS = Reason("the draft fits", "draft fits")


def loaded(name: str, model) -> LoadedModel:
    return LoadedModel(name, model, None, torch.float32, CPU, 512, 0.0, False)


@pytest.fixture
def opening(tmp_path, monkeypatch):
    """open_session over tiny models with the candidates, the loads and the pass costs stubbed (no
    real model loads; no EAGLE head here, so building one fails to load). Returns a function that
    opens with the given candidates and returns the session and the draft each load asked for."""
    from localspec.runtime.costs import CostModel

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(session, "situation", lambda registry, model: {})

    def open_with(ranked, requested="auto", draft_step=0.004, draft_out_of_memory=False, error=None):
        loads = []

        def load_models(entry, draft_entry, proposer, dtype, spec, quiet):
            loads.append(draft_entry.name if draft_entry else None)
            if error is not None:
                raise error
            if draft_entry is not None and draft_out_of_memory:
                raise torch.OutOfMemoryError("simulated: no room for the draft")
            draft = loaded(draft_entry.name, tiny_model("qwen2", seed=1, layers=1)) if draft_entry else None
            return loaded(entry.name, tiny_model("qwen2")), draft, Reason("test weights", "test")

        monkeypatch.setattr(session, "rank_proposers", lambda *a, **k: ranked)
        monkeypatch.setattr(session, "load_models", load_models)
        # against a 30 ms one-token pass, a 4 ms draft step pays and a 60 ms one cannot
        monkeypatch.setattr(session, "costs_for", lambda target, draft, widths=None: CostModel({1: 0.03, 16: 0.06}, draft_step if draft else 0.0))
        return session.open_session(TARGET, requested, "float32", registry=load_registry()), loads

    return open_with


def test_a_head_that_fails_to_load_gives_way_to_the_next_candidate_on_the_same_target(opening, capsys):
    no_draft = Reason("no registered draft", "no draft registered")
    ranked = [Candidate("eagle", HEAD_HERE), Candidate("ngram", PROMPT_LOOKUP, passed_over=(no_draft,))]
    opened, loads = opening(ranked)
    assert opened.proposer == "ngram" and opened.engine.proposer_name == "ngram"
    assert loads == [None], "the target loaded for the head runs prompt lookup"
    assert opened.reason.startswith(f"{PROMPT_LOOKUP} (the EAGLE head here cannot be loaded: the EAGLE head in ")
    assert opened.reason.endswith("; no registered draft)") and "\n" not in opened.reason
    assert opened.engine.proposer_reason == opened.reason
    assert opened.reason.short == "no draft registered", "in short, why the nearest one above was left out"
    said = capsys.readouterr().err
    assert "localspec: the EAGLE head here cannot be loaded: " in said and said.rstrip().endswith("; using prompt lookup instead")


def test_a_draft_out_of_memory_gives_way_and_the_target_is_loaded_alone(opening, capsys):
    ranked = [Candidate("draft", DRAFT_FITS, DRAFT), Candidate("ngram", PROMPT_LOOKUP)]
    opened, loads = opening(ranked, draft_out_of_memory=True)
    assert (opened.proposer, opened.draft) == ("ngram", None) and loads == [DRAFT, None]
    why = f"the draft {DRAFT} did not fit in memory (simulated: no room for the draft)"
    assert opened.reason == f"{PROMPT_LOOKUP} ({why})" and opened.reason.short == f"draft {DRAFT} did not fit in memory"
    assert f"localspec: {why}; using prompt lookup instead" in capsys.readouterr().err


@pytest.mark.parametrize("requested", ["auto", "draft"])
def test_under_auto_a_draft_that_cannot_pay_gives_way_and_is_dropped(opening, capsys, requested):
    ranked = [Candidate("draft", DRAFT_FITS, DRAFT), Candidate("ngram", PROMPT_LOOKUP)]
    opened, loads = opening(ranked, requested, draft_step=0.06)
    assert loads == [DRAFT], "prompt lookup runs on the target already loaded"
    if requested == "draft":  # asked for: kept
        assert opened.proposer == "draft" and opened.draft is not None and opened.reason == "the draft fits"
        assert opened.proposer_choice.short == f"draft {DRAFT} · draft fits"
        return
    assert (opened.proposer, opened.draft) == ("ngram", None)
    why = ("the draft's measured step (60 ms) against the target's one-token pass (30 ms) cannot beat plain "
           "decoding by 15% even at 70% acceptance")
    assert opened.reason == f"{PROMPT_LOOKUP} ({why})" and opened.reason.short == "draft too slow here: 60 ms a step"
    assert f"{why}; using prompt lookup instead" in capsys.readouterr().err


def test_each_candidate_passed_over_is_named_where_it_ranked(opening, capsys):
    ranked = [
        Candidate("eagle", HEAD_HERE),
        Candidate("draft", DRAFT_FITS, DRAFT, passed_over=(Reason("first left out", "first"),)),
        Candidate("ngram", PROMPT_LOOKUP, passed_over=(Reason("first left out", "first"), Reason("second left out", "second"))),
    ]
    opened, loads = opening(ranked, draft_step=0.06)
    assert opened.proposer == "ngram"
    assert loads == [None, DRAFT], "the head's target alone, then the pair loaded anew for the draft"
    said = [part.split(":")[0] for part in opened.reason.removeprefix(f"{PROMPT_LOOKUP} (").split("; ")]
    assert said == ["the EAGLE head here cannot be loaded", "first left out",
                    "the draft's measured step (60 ms) against the target's one-token pass (30 ms) cannot beat "
                    "plain decoding by 15% even at 70% acceptance", "second left out)"]
    notices = capsys.readouterr().err.splitlines()
    assert notices[0].startswith("localspec: the EAGLE head here cannot be loaded: ")
    assert notices[0].endswith(f"; using draft {DRAFT} instead") and notices[1].endswith("; using prompt lookup instead")


def test_the_last_candidate_fails_as_it_is_and_other_failures_are_not_passed_over(opening):
    with pytest.raises(LocalspecError, match="the EAGLE head in .* cannot be used for"):
        opening([Candidate("eagle", Reason("--proposer eagle was asked for", "asked for"))], requested="eagle")
    ranked = [Candidate("draft", DRAFT_FITS, DRAFT), Candidate("ngram", PROMPT_LOOKUP)]
    with pytest.raises(RuntimeError, match="size mismatch"):
        opening(ranked, error=RuntimeError("size mismatch for lm_head.weight"))


def explained(text: str) -> Reason:
    return Reason(text, f"{text} in short")


def test_a_reason_after_refusals_keeps_the_ranking_order():
    first = Candidate("eagle", explained("head"), passed_over=(explained("a"),))
    second = Candidate("draft", explained("draft"), "d", passed_over=(explained("a"), explained("b")))
    last = Candidate("ngram", explained("lookup"), passed_over=(explained("a"), explained("b"), explained("c")))
    assert last.reason == "lookup (a; b; c)"
    assert last.reason_after([(first, explained("head failed")), (second, explained("draft failed"))]) == "lookup (a; head failed; b; draft failed; c)"
    assert (first.title, second.title, last.title) == ("the EAGLE head", "draft d", "prompt lookup")


def test_a_short_reason_is_the_candidates_own_unless_it_stands_in_for_those_above():
    head = Candidate("eagle", explained("head"))
    draft = Candidate("draft", explained("draft"), "d", passed_over=(explained("a"),))
    lookup = Candidate("ngram", explained("lookup"), passed_over=(explained("a"), explained("b")))
    assert draft.reason.short == "draft in short", "a model proposer runs on its own merit"
    assert lookup.reason.short == "b in short", "prompt lookup runs because the nearest above it was left out"
    assert lookup.reason_after([(head, explained("head failed")), (draft, explained("draft failed"))]).short == "b in short"
    assert lookup.reason_after([(draft, explained("draft failed"))]).short == "b in short"
    assert Candidate("ngram", explained("lookup")).reason.short == "lookup in short", "nothing above it: its own"
    refused_last = Candidate("ngram", explained("lookup"), passed_over=(explained("a"),))
    assert refused_last.reason_after([(draft, explained("draft failed"))]).short == "draft failed in short"


# -- switching the proposer on the weights in hand ---------------------------------------------------


@pytest.fixture
def ngram_session(opening, monkeypatch):
    """A session opened with prompt lookup; the draft's load, tokenizer check and cleanup recorded."""
    opened, _ = opening([Candidate("ngram", PROMPT_LOOKUP)], requested="ngram")
    seen = {"drafts": [], "checked": [], "discarded": [], "closed": []}
    draft = loaded(DRAFT, tiny_model("qwen2", seed=1, layers=1))
    monkeypatch.setattr(session, "load_draft", lambda entry, dtype, device, spec, quiet: seen["drafts"].append((entry.name, dtype, quiet)) or draft)
    monkeypatch.setattr(session, "check_tokenizers", lambda *names_and_tokenizers: seen["checked"].append(names_and_tokenizers[::2]))
    monkeypatch.setattr(session, "discard_unused", lambda *models: seen["discarded"].append(models))
    monkeypatch.setattr(opened.engine.proposer, "close", lambda: seen["closed"].append(opened.proposer))
    return opened, seen


def test_switching_to_the_draft_loads_it_as_opening_does_then_closes_the_old_engine(ngram_session):
    opened, seen = ngram_session
    old, statuses = opened.engine, []
    engine = opened.switch_proposer("draft", SpecConfig(), explained("draft was chosen"), statuses.append)
    assert engine is opened.engine is not old and engine.proposer_name == "draft"
    assert (opened.proposer, opened.reason, opened.draft.name) == ("draft", "draft was chosen", DRAFT)
    assert opened.proposer_choice.short == f"draft {DRAFT} · draft was chosen in short"
    assert seen["drafts"] == [(DRAFT, torch.float32, False)], "through load_draft (its measured format), at the target's dtype, as loud as the opening"
    assert seen["checked"] == [(TARGET, DRAFT)] and seen["discarded"] == [(opened.target, opened.draft)]
    assert seen["closed"] == ["ngram"]
    assert statuses == [f"loading draft model {DRAFT}", "measuring pass costs (cached after the first time)"]
    opened.switch_proposer("ngram", SpecConfig(), explained("back"))
    assert opened.draft is not None and len(seen["drafts"]) == 1, "the draft stays loaded for the next switch"
    assert opened.proposer_choice.short == "ngram · back in short", "the draft loaded beside it is not named"


def test_a_refused_switch_leaves_the_old_engine_working(ngram_session, monkeypatch):
    opened, seen = ngram_session
    old = opened.engine
    monkeypatch.setattr(session, "check_tokenizers", lambda *a: "token 7 is 'a' in x but 'b' in y")
    with pytest.raises(LocalspecError, match="token 7 is 'a' in x but 'b' in y; the draft proposer cannot pair them"):
        opened.switch_proposer("draft", SpecConfig(), explained("draft was chosen"))
    with pytest.raises(LocalspecError, match="the EAGLE head in .* cannot be used for"):
        opened.switch_proposer("eagle", SpecConfig(), explained("eagle was chosen"))
    assert opened.engine is old and (opened.proposer, opened.draft) == ("ngram", None) and seen["closed"] == []


def test_the_chat_switches_through_the_session(ngram_session):
    from localspec.apps.tui.backend import ChatSettings, SessionBackend

    opened, seen = ngram_session
    backend = SessionBackend(load_registry(), session=opened)
    shown = backend.open(ChatSettings(model=TARGET, spec=SpecConfig(proposer="draft")), lambda stage: None)
    assert shown.engine.engine is opened.engine and shown.engine.record == opened.record and shown.proposer == "draft"
    assert shown.proposer_choice == "draft proposer: draft was chosen in the chat"
    assert shown.proposer_choice.short == f"draft {DRAFT} · chosen here" and shown.weights.short == "test · cpu"
    assert seen["drafts"] and seen["checked"] and seen["closed"] == ["ngram"]


# -- between turns: the thread pool and a calibration gone stale ---------------------------------

class Load:
    """Other programs' load as a session's turn reads it."""

    busy = 0.0

    def __init__(self):
        self.started = -1e9  # long ago: the idle gap is long enough to size the pool on

    def cores(self):
        return Load.busy


@pytest.fixture
def turns(opening, monkeypatch):
    """A session on prompt lookup whose pass costs are in calibration.json; other programs' load is
    `Load.busy`."""
    from localspec.store import measurements

    monkeypatch.setattr(session, "OthersLoad", Load)
    monkeypatch.setattr(Load, "busy", 0.0)
    opened, _ = opening([Candidate("ngram", PROMPT_LOOKUP)], requested="ngram")
    opened._idle = Load()
    key = measurements.pass_cost_key(opened.target.name, opened.target.model)
    measurements.save_calibration(key, {"context=128": {"1": 0.03}})
    return opened, lambda: key in measurements.load_calibrations()


def answered(opened, passes, seconds_each):
    """A finished answer as the engine counted it: `passes` verify passes of `seconds_each` against
    the calibrated 30 ms."""
    opened.begin_turn()
    own = opened.engine.stats
    own.passes, own.verify_seconds, own.expected_verify_seconds = passes, passes * seconds_each, passes * 0.03
    opened.record(own)


def test_an_answer_whose_passes_ran_far_from_their_calibration_on_a_quiet_machine_has_them_measured_again(turns, capsys):
    opened, calibrated = turns
    answered(opened, 40, 0.036)  # 1.2x: a pass's usual wander and its acceptance rule
    answered(opened, 10, 0.09)  # 3x, but too few passes to judge by
    assert calibrated() and "calibrated time" not in capsys.readouterr().err
    answered(opened, 40, 0.075)  # 2.5x
    assert not calibrated()
    assert "passes took 2.50x their calibrated time on a quiet machine" in capsys.readouterr().err


def test_a_busy_machine_or_another_thread_count_does_not_judge_the_calibration(turns, monkeypatch):
    opened, calibrated = turns
    monkeypatch.setattr(Load, "busy", 0.8)
    answered(opened, 40, 0.075)  # slow because another program ran beside it
    assert calibrated()
    monkeypatch.setattr(Load, "busy", 0.0)
    opened.calibrated_threads = machine.THREADS + 1  # measured on a thread count the pool does not have now
    answered(opened, 40, 0.075)
    assert calibrated()


def test_the_engine_asks_the_session_before_each_answer_and_counts_what_the_costs_expected(turns, monkeypatch):
    opened, _ = turns
    begun = []
    monkeypatch.setattr(opened, "begin_turn", lambda: begun.append(True))
    opened.engine.before_turn = opened.begin_turn
    list(opened.engine.generate([1, 2, 3] * 6, limits=GenerationLimits(12)))
    own = opened.engine.stats
    assert begun == [True] and own.passes > 1
    # the stubbed costs: 30 ms for one token, 2 ms more for each further one up to 16
    assert own.expected_verify_seconds == pytest.approx(0.03 * own.passes + 0.002 * own.drafted)
