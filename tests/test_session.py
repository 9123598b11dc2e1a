"""Weight format choice: an explicit --dtype is the model the user asked for, even under --quant auto."""

from __future__ import annotations

import pytest
import torch

from conftest import CharTokenizer, tiny_model
from localspec.store import session
from localspec.base.config import SpecConfig
from localspec.store.loading import LoadedModel
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
    assert reason == "--dtype float32"


@pytest.mark.parametrize("entry", [[], "x", {"context=128": []}, {"context=128": {"1": "fast"}}])
def test_a_measurement_edited_into_another_shape_is_measured_again(tmp_path, monkeypatch, entry):
    import json

    from localspec.runtime import costs

    from localspec.store import measurements

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    model = tiny_model()
    key = measurements.pass_cost_key("tiny", model)
    (tmp_path / "calibration.json").write_text(json.dumps({key: entry, measurements.dtype_key("t", None, "ngram"): []}))
    monkeypatch.setattr(costs, "time_forward", lambda model, widths, context: {w: 0.5 for w in widths})
    assert measurements.measured_costs("tiny", model, (1,)) == {1: 0.5}
    assert measurements.load_calibration(key) == {"context=128": {"1": 0.5}}
    assert measurements.load_calibration(measurements.dtype_key("t", None, "ngram")) == {}


def test_pass_costs_are_keyed_by_what_runs_the_pass(monkeypatch):
    """A changed CPU kernel or the lean pass is measured again, not read from the old entry."""
    from localspec.store import measurements
    from localspec.runtime.attention import use_exact_attention
    from localspec.runtime.decoder import use_lean_forward

    model = tiny_model()
    use_exact_attention(model)
    before = measurements.pass_cost_key("tiny", model)
    monkeypatch.setattr(measurements, "sources_digest", lambda: "changed")
    edited = measurements.pass_cost_key("tiny", model)
    assert edited != before and "kernels=changed" in edited
    use_lean_forward(model)
    assert measurements.pass_cost_key("tiny", model) not in (before, edited)
