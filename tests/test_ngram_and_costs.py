"""Prompt lookup as a table of cases; the cost model's pass costs; the statistics."""

from __future__ import annotations

import pytest
import torch

from localspec.core.proposers.ngram import lookup
from localspec.core.stats import GenerationStats
from localspec.runtime.costs import CostModel
from localspec.store.measurements import load_calibrations, measured_costs


@pytest.mark.parametrize(
    "tokens, max_len, nmin, nmax, expected",
    [
        ([1, 2, 3, 4, 1, 2], 3, 1, 3, ([3, 4, 1], 2)),  # longest suffix [1, 2] matched, continuation follows
        ([1, 2, 3, 4, 1, 2], 1, 1, 3, ([3], 2)),  # capped at max_len
        ([1, 2, 3, 9, 2, 3, 7, 2, 3], 2, 1, 2, ([7, 2], 2)),  # the most recent match wins
        ([5, 1, 2, 8, 9, 1, 2], 4, 1, 3, ([8, 9, 1, 2], 2)),
        ([1, 2, 3], 4, 1, 3, ([], 0)),  # nothing repeats
        ([7, 7, 7], 4, 1, 3, ([7], 2)),  # overlapping match: [7, 7] at 0 is followed by one 7
        ([4, 5, 6, 1, 5, 6], 3, 3, 3, ([], 0)),  # only 2-gram matches, but min n is 3
        ([4, 5, 6, 1, 5, 6], 3, 2, 3, ([1, 5, 6], 2)),
        ([9, 4, 5, 6, 1, 4, 5, 6], 2, 1, 3, ([1, 4], 3)),  # the 3-token match beats shorter ones
        ([3], 4, 1, 2, ([], 0)),
        ([1, 2, 1], 0, 1, 2, ([], 0)),
    ],
)
def test_ngram_lookup_table(tokens, max_len, nmin, nmax, expected):
    assert lookup(tokens, max_len, nmin, nmax) == expected


def test_pass_cost_interpolates_between_and_beyond_calibrated_widths():
    steep = CostModel({1: 0.25, 2: 0.28, 3: 0.29, 4: 0.51, 8: 0.97}, draft_step_seconds=0.09)
    assert steep.verify(3) == pytest.approx(0.29)
    assert steep.verify(6) == pytest.approx((0.51 + 0.97) / 2)
    assert steep.verify(10) > steep.verify(8)


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    from conftest import tiny_model
    import localspec.runtime.costs as costs

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(costs, "agree", lambda samples: True)  # a busy machine: the test below
    model = tiny_model("llama")
    first = measured_costs("tiny", model, (1, 2, 4))
    assert set(first) == {1, 2, 4} and all(t > 0 for t in first.values())
    monkeypatch.setattr(costs, "time_passes", lambda *a, **k: pytest.fail("measured again"))
    assert measured_costs("tiny", model, (1, 2, 4)) == first
    assert (tmp_path / "calibration.json").exists()


def test_calibration_times_the_attention_and_contexts_generation_runs(tmp_path, monkeypatch):
    """make_engine measures after the target has the engine's row-exact attention (before, it
    measured SDPA), at two context lengths, under a key naming the attention path."""
    from conftest import tiny_model
    import localspec.runtime.costs as costs
    from localspec.base.config import SpecConfig
    from localspec.runtime.attention import NAME
    from localspec.store import session
    from localspec.store.loading import LoadedModel

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(session, "packs", lambda dtype: False)
    seen = []
    real = costs.time_passes

    def recording(model, widths, repeats=4, context=costs.CALIBRATION_PREFIX):
        seen.append((model.config._attn_implementation, context))
        return real(model, widths, repeats=1, context=context)

    monkeypatch.setattr(costs, "time_passes", recording)
    monkeypatch.setattr(costs, "agree", lambda samples: True)  # whatever else the machine is doing
    model = tiny_model("llama")
    assert model.config._attn_implementation != NAME
    target = LoadedModel("tiny", model, None, torch.float32, torch.device("cpu"), 512, 0.0, False)
    engine = session.make_engine(target, None, "ngram", SpecConfig(), "test")
    assert seen and {attention for attention, _ in seen} == {NAME}
    assert {context for _, context in seen} == set(costs.CONTEXTS)
    assert f"attention={NAME}" in next(iter(load_calibrations()))
    assert engine.policy.guard.costs is engine.costs  # the kill switch reads the same numbers


def test_pass_cost_interpolates_between_context_lengths():
    model = CostModel({1: 1.0, 4: 2.0}, by_context={100: {1: 1.0, 4: 2.0}, 1100: {1: 2.0, 4: 4.0}})
    model.context = 100
    assert model.verify(1) == pytest.approx(1.0) and model.verify(4) == pytest.approx(2.0)
    model.context = 600
    assert model.verify(1) == pytest.approx(1.5) and model.verify(2) == pytest.approx(2.0)
    model.context = 2100  # beyond the last: the last slope
    assert model.verify(4) == pytest.approx(6.0)
    model.context = 0  # below the first: flat
    assert model.verify(1) == pytest.approx(1.0)


def test_statistics_derived_figures():
    stats = GenerationStats()
    stats.record_pass(drafted=4, accepted=4, draft_seconds=0.4, verify_seconds=1.0)
    stats.record_pass(drafted=4, accepted=1, draft_seconds=0.4, verify_seconds=1.0)
    stats.record_pass(drafted=2, accepted=0, draft_seconds=0.2, verify_seconds=1.0)
    stats.draft_steps = 10
    assert stats.acceptance_rate == pytest.approx(0.5)
    assert stats.mean_tokens_per_pass == pytest.approx(8 / 3)
    assert stats.acceptance_by_position == pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2])
    assert stats.cost_ratio == pytest.approx(0.1)
    # acceptance a = 0.5 over a mean draft of g = 10/3 at c = 0.1: (1 - a^(g+1)) / ((1 - a)(1 + g c))
    g = 10 / 3
    assert stats.predicted_speedup == pytest.approx((1 - 0.5 ** (g + 1)) / (0.5 * (1 + g * 0.1)))


def test_a_calibration_made_while_the_machine_is_busy_holds_for_the_run_only(tmp_path, monkeypatch):
    """Repeated passes that disagree (other work on the machine) are measured once more; still
    disagreeing, the costs serve this run and are not saved, so the next quiet run measures."""
    from conftest import tiny_model
    import localspec.runtime.costs as costs

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    from localspec.store import measurements

    monkeypatch.setattr(measurements, "_BUSY_SAID", set())
    said, tries = [], []
    busy = {1: [0.010, 0.031, 0.029, 0.012], 2: [0.020, 0.021, 0.020, 0.020]}  # width 1's median 2.9x its best
    quiet = {1: [0.011, 0.011, 0.012, 0.011], 2: [0.020, 0.021, 0.020, 0.020]}

    def passes(samples):
        return lambda *a, **k: tries.append(1) or samples

    monkeypatch.setattr(costs, "time_passes", passes(busy))
    model = tiny_model("llama")
    assert measured_costs("tiny", model, (1, 2), say=said.append) == {1: 0.010, 2: 0.020}
    assert len(tries) == 2 and len(said) == 1 and "busy" in said[0] and not load_calibrations()
    measured_costs("tiny", model, (1, 2), say=said.append)
    assert len(said) == 1, "said once"
    tries.clear()
    monkeypatch.setattr(costs, "time_passes", passes(quiet))
    assert measured_costs("tiny", model, (1, 2), say=said.append) == {1: 0.011, 2: 0.020}
    assert len(tries) == 1 and len(said) == 1 and load_calibrations(), "agreeing passes are kept"
    assert costs.agree({1: [1e-4, 5e-4, 6e-4]}), "timer jitter on a tiny pass is no busy machine"
