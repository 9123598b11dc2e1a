"""The CUDA-graph runner's bookkeeping, on the CPU: static inputs copied in, the cache's lengths
moved as the eager pass moves them, what it covers and when it turns off. `no_capture` stands in
for the capture (replaying = calling the same `lean_forward` on the static inputs), and the
Triton row attention runs under the interpreter, so a replay here computes what a CUDA replay
does; tests/test_cuda.py checks the captured graphs themselves.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import PROMPT_IDS, tiny_model

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("runs the Triton rows on CPU tensors, under the interpreter", allow_module_level=True)

from localspec.base.config import GenerationLimits, SpecConfig  # noqa: E402
from localspec.core.engine import Engine  # noqa: E402
from localspec.core.proposers import DraftModelProposer, NgramProposer  # noqa: E402
from localspec.core.tree import Draft, verify_inputs, visible_rows  # noqa: E402
from localspec.runtime import target_pass  # noqa: E402
from localspec.runtime.attention import RowPlan, RowTable, use_exact_attention  # noqa: E402
from localspec.runtime.decoder import lean_forward  # noqa: E402
from localspec.runtime.graphs import MAX_WIDTH, GraphRunner, no_capture, unavailable_reason  # noqa: E402
from localspec.runtime.kv import KVCache, extend_to  # noqa: E402
from localspec.runtime.target_pass import TargetPass  # noqa: E402

CPU = torch.device("cpu")


def target(arch: str = "llama"):
    model = tiny_model(arch)
    use_exact_attention(model)
    return model


def prefilled(model, n: int = 20, slots: int = 64) -> tuple[KVCache, list[int]]:
    kv = KVCache(slots)
    tokens = [(7 * i + 3) % 90 for i in range(n)]
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), cache=kv.cache, use_cache=True)
    return kv, tokens


def chain(past: int, width: int):
    ids = torch.tensor([[(5 * i + past) % 90 for i in range(width)]])
    return ids, torch.arange(past, past + width)[None], None


def tree(past: int):
    draft = Draft(tokens=[11, 12, 13, 21, 22], parents=[-1, 0, 1, -1, 3])
    ids, positions, _ = verify_inputs(draft, 9, past)
    return ids, positions, RowPlan.from_rows(past, visible_rows(draft), CPU)


def eager_table_pass(model, kv: KVCache, ids, positions, plan) -> torch.Tensor:
    """The eager pass with the same kernels as a replay: lean_forward over a table built for it."""
    past = len(kv)
    logits = lean_forward(model, ids, kv.cache, position_ids=positions, table=RowTable.build(past, ids.shape[1], plan, CPU))
    extend_to(kv.cache, past + ids.shape[1])
    return logits[0]  # (T, V)


def cache_state(kv: KVCache) -> list[torch.Tensor]:
    return [t.clone() for layer in kv.cache.layers for t in (layer.keys, layer.values)]


@torch.inference_mode()
def test_a_replay_is_the_eager_pass_bit_for_bit_for_chains_and_trees(arch):
    model = target(arch)
    runner = GraphRunner(model, capture=no_capture)
    replayed_kv, tokens = prefilled(model)
    eager_kv, _ = prefilled(model)
    # passes of each kind one after another: a width's second pass reuses its static inputs
    for make in (lambda p: chain(p, 1), lambda p: chain(p, 4), tree, lambda p: chain(p, 1), tree, lambda p: chain(p, 4)):
        past = len(replayed_kv)
        ids, positions, plan = make(past)
        got = runner.run(replayed_kv, ids, positions, plan, logit_rows=ids.shape[1])
        expected = eager_table_pass(model, eager_kv, ids, positions, plan)
        assert got is not None and torch.equal(got, expected)
        assert len(replayed_kv) == len(eager_kv) == past + ids.shape[1]
        for a, b in zip(cache_state(replayed_kv), cache_state(eager_kv)):
            assert torch.equal(a, b)
        # keep the pass's first row, as verification keeps the root; the next pass starts after it
        replayed_kv.truncate(past + 1)
        eager_kv.truncate(past + 1)
    assert sorted(runner.passes) == [1, 4, 6]


@torch.inference_mode()
def test_the_table_pass_computes_what_the_cpu_pass_computes(arch):
    """The Triton rows against the CPU kernel / torch loop the CPU runs (not the same bits:
    another order of sums), chain and tree, and the same cache lengths afterwards."""
    model = target(arch)
    kv, tokens = prefilled(model)
    for ids, positions, plan in (chain(len(tokens), 5), tree(len(tokens))):
        table_logits = eager_table_pass(model, kv, ids, positions, plan)
        kv.truncate(len(tokens))
        reference = model(input_ids=ids, position_ids=positions, cache=kv.cache, row_plan=plan).logits[0]
        assert len(kv) == len(tokens) + ids.shape[1]
        kv.truncate(len(tokens))
        assert torch.allclose(table_logits, reference, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_what_the_runner_leaves_to_the_eager_pass():
    model = target()
    runner = GraphRunner(model, capture=no_capture)
    assert runner.run(KVCache(64), *chain(0, 1), logit_rows=1) is None  # nothing cached yet: no buffers to capture against
    kv, tokens = prefilled(model, slots=32)
    past = len(tokens)
    assert runner.run(kv, *chain(past, 4)[:2], None, logit_rows=1) is None  # a prefill chunk keeps one row
    assert runner.run(kv, *chain(past, MAX_WIDTH + 1)[:2], None, logit_rows=MAX_WIDTH + 1) is None  # wider than captured
    assert runner.run(kv, *chain(past, 13)[:2], None, logit_rows=13) is None  # would not fit the cache's 32 slots
    ids, positions, _ = tree(past)
    from_mask = RowPlan.from_rows(0, [[*range(past), *(past + j for j in row)] for row in visible_rows(Draft([11, 12], [-1, -1]))], CPU)
    assert runner.run(kv, ids[:, :3], positions[:, :3], from_mask, logit_rows=3) is None  # a plan not after the cache's entries
    assert len(kv) == past and not runner.passes and runner.off is None


@torch.inference_mode()
def test_a_grown_cache_is_captured_again():
    model = target()
    runner = GraphRunner(model, capture=no_capture)
    kv, tokens = prefilled(model, slots=24)
    eager_kv, _ = prefilled(model, slots=24)
    assert runner.run(kv, *chain(len(kv), 2), logit_rows=2) is not None and sorted(runner.passes) == [2]
    eager_table_pass(model, eager_kv, *chain(len(eager_kv), 2))
    for cache in (kv, eager_kv):  # an eager pass past the 24 slots grows the cache
        model(input_ids=torch.tensor([list(range(10))]), cache=cache.cache, use_cache=True)
    assert kv.cache.layers[0].key_slots.buffer is not runner.buffers[0]
    got = runner.run(kv, *chain(len(kv), 1), logit_rows=1)
    assert sorted(runner.passes) == [1]  # the width-2 pass was captured against the old buffers: dropped
    assert runner.buffers[0] is kv.cache.layers[0].key_slots.buffer
    assert torch.equal(got, eager_table_pass(model, eager_kv, *chain(len(eager_kv), 1)))


@torch.inference_mode()
def test_a_failed_capture_turns_the_runner_off_with_a_reason():
    def failing(step, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    model = target()
    runner = GraphRunner(model, capture=failing)
    kv, tokens = prefilled(model)
    assert runner.run(kv, *chain(len(tokens), 3), logit_rows=3) is None
    assert runner.off.startswith("CUDA graphs off") and "3-token" in runner.off and "\n" not in runner.off
    assert len(kv) == len(tokens) and runner.run(kv, *chain(len(tokens), 1), logit_rows=1) is None


def test_models_whose_passes_a_replay_cannot_stand_for():
    from test_eagle import random_head
    from localspec.core.proposers.eagle import EagleProposer

    model = target()
    assert unavailable_reason(model) is None
    windowed = target()
    windowed.config.sliding_window = 16  # a model the lean pass cannot run
    assert "lean pass" in unavailable_reason(windowed)
    proposer = EagleProposer(random_head(model, 1, draft_vocab=64), model, top_k=4, depth=2)
    assert "hooks" in unavailable_reason(model)
    proposer.close()
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: out.float())  # quant.py's cast: recorded
    assert unavailable_reason(model) is None


@pytest.fixture
def replays_on_cpu(monkeypatch):
    """Every `TargetPass` built from here tries a runner first, as on CUDA: the engine's, the draft
    model's, the calibration's."""
    monkeypatch.setattr(target_pass, "graph_capture", lambda device: no_capture)


def test_speculation_through_the_runner_reproduces_plain_decoding_through_it(replays_on_cpu):
    """Greedy identity with every pass that fits replayed: prompt lookup and a draft model against
    plain decoding, all on the same (Triton) rows."""
    model = target()
    plain = Engine(model, None, None)
    expected = [p.token_id for ev in plain.generate(PROMPT_IDS, limits=GenerationLimits(24)) for p in ev.pieces]
    assert sorted(plain.target_pass.graphs.passes) == [1]
    for proposer in (NgramProposer(), DraftModelProposer(tiny_model("llama", seed=1))):
        engine = Engine(model, None, proposer, SpecConfig(draft_len=4))
        got = [p.token_id for ev in engine.generate(PROMPT_IDS, limits=GenerationLimits(24)) for p in ev.pieces]
        assert got == expected, proposer.name
        runner = engine.target_pass.graphs
        assert runner.off is None and max(runner.passes) > 1 and engine.stats.drafted
    assert sorted(proposer.step.graphs.passes) == [1], "the draft model's steps replay too"


def test_the_engine_says_once_why_graphs_are_off(replays_on_cpu):
    engine = Engine(target(), None, None)
    engine.target_pass.graphs.off = "CUDA graphs off: test"
    list(engine.generate(PROMPT_IDS, limits=GenerationLimits(4)))
    assert engine.target_pass.graphs is None and engine.stats.notices == ["CUDA graphs off: test"]


def test_calibration_times_the_passes_through_the_runner_where_generation_replays_them(replays_on_cpu, monkeypatch):
    """On CUDA the engine's passes replay from graphs, so the cost model must time replays: the
    calibration runs the same `TargetPass`, which tries a runner wherever generation's does."""
    from localspec.runtime import costs

    model = target()
    runs = []
    real = GraphRunner.run

    def counting(self, kv, ids, positions, plan, logit_rows):
        runs.append(ids.shape[1])
        if len(kv):  # past the prefix: the passes timed
            assert kv.cache.layers[0].key_slots.buffer.shape[-2] >= len(kv) + ids.shape[1], "a cache that keeps its buffers"
        return real(self, kv, ids, positions, plan, logit_rows)

    monkeypatch.setattr(GraphRunner, "run", counting)
    seconds = costs.time_forward(model, (1, 4), repeats=2, context=24)
    assert set(seconds) == {1, 4} and all(s > 0 for s in seconds.values())
    assert runs == [24] + [1, 4] * 3, "the prefix (left to the eager pass), every timed pass and the warm-up went through it"
    assert TargetPass(model).name.endswith("+graphs"), "the calibration key says its passes replay"
    monkeypatch.undo()
    assert not TargetPass(model).name.endswith("+graphs") and TargetPass(model).graphs is None, \
        "on the CPU generation runs eagerly, and so does its calibration"
