"""The row-exact attention kernel against its torch reference: chains and trees, grouped heads,
odd head sizes, and a row computed alone equal bit for bit to the same row among others."""

from __future__ import annotations

import os

import pytest
import torch

from localspec.base.config import home_dir
from localspec.kernels import cpu_attention
from localspec.kernels.cpu_build import KernelUnavailable, compiler


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere): read apart from the
    kernel's own check, so a kernel that wrongly refuses a capable CPU is seen."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


MUST_BUILD = os.uname().machine in ("x86_64", "AMD64") and compiler() is not None and "fma" in cpu_flags() \
    and {"avx512f", "avx2"} & cpu_flags()
"""An x86 CPU with FMA and AVX-512F or AVX2, and a C++ compiler: here the kernel has no reason not to run."""


def kernel_or_reason():
    try:
        return cpu_attention.load(home_dir() / "kernels"), None
    except KernelUnavailable as exc:
        return None, str(exc)


KERNEL, WHY_NOT = kernel_or_reason()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"the attention kernel cannot run here: {WHY_NOT}")


def test_the_kernel_builds_and_runs_where_the_cpu_and_a_compiler_allow():
    if not MUST_BUILD:
        pytest.skip("no x86 CPU with FMA and AVX-512F or AVX2, or no C++ compiler: the torch loop computes the rows")
    assert KERNEL is not None, WHY_NOT  # a compile error, a library that does not load, a wrong CPU check


def test_a_failed_build_says_why_and_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")  # a compiler that runs and fails
    with pytest.raises(KernelUnavailable, match="building the attention kernel with .*false failed"):
        cpu_attention.load(tmp_path)
    assert not list(tmp_path.iterdir())


def cache_views(kv_heads: int, d: int, s: int, seed: int):
    """Keys/values as the engine's cache hands them over: views of a larger buffer."""
    gen = torch.Generator().manual_seed(seed)
    buffers = [torch.randn(1, kv_heads, s + 37, d, generator=gen) for _ in range(2)]
    return buffers[0][:, :, :s], buffers[1][:, :, :s]


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, d", [(12, 2, 128), (4, 2, 12), (3, 1, 20), (2, 2, 64), (8, 8, 256), (2, 1, 300)])
@pytest.mark.parametrize("s, t", [(1, 1), (40, 1), (300, 16), (23, 7)])
def test_causal_rows_match_reference_and_each_row_alone(heads, kv_heads, d, s, t):
    key, value = cache_views(kv_heads, d, s, seed=heads + d + s)
    query = torch.randn(1, t, heads, d).transpose(1, 2)  # (1, H, T, D) as the model makes it
    rows = cpu_attention.VisibleRows.causal(t, s)
    got = KERNEL(query, key, value, rows, d**-0.5)
    reference = cpu_attention.row_attention_reference(query, key, value, rows, d**-0.5)
    assert (got - reference).abs().max() <= 2e-6 * reference.abs().max() + 1e-6
    for i in range(t):  # the one-token step at that position computes the same bits
        alone = KERNEL(query[:, :, i : i + 1], key[:, :, : s - t + i + 1], value[:, :, : s - t + i + 1],
                       cpu_attention.VisibleRows.causal(1, s - t + i + 1), d**-0.5)
        assert torch.equal(alone[:, 0], got[:, i]), i


@needs_kernel
@pytest.mark.parametrize("d", [12, 64, 20])
def test_a_rows_bits_do_not_depend_on_how_its_slots_are_listed(d):
    """A mask-built plan lists a tree row's slots as extras from 0, a host-built one as a prefix and
    two extras: the same slots in the same order give the same bits (feature tails included)."""
    gen = torch.Generator().manual_seed(d)
    query = torch.randn(1, 4, 1, d, generator=gen)
    key, value = cache_views(2, d, 26, seed=d)
    listed = [cpu_attention.VisibleRows([0], [list(range(21)) + [24]]), cpu_attention.VisibleRows([20], [[20, 24]]),
              cpu_attention.VisibleRows([21], [[24]])]
    first, *others = [KERNEL(query, key, value, rows, 0.3) for rows in listed]
    for other in others:
        assert torch.equal(first, other)


@needs_kernel
def test_tree_rows_see_the_past_and_their_own_ancestors_only():
    heads, kv_heads, d, past = 6, 2, 32, 50
    parents = [-1, 0, 0, 1, 3, 2]  # node i's parent (-1: the root token at slot past)
    t = len(parents) + 1
    key, value = cache_views(kv_heads, d, past + t, seed=1)
    query = torch.randn(1, heads, t, d)
    extras = [[past]]
    for node, parent in enumerate(parents):
        extras.append(extras[parent + 1] + [past + 1 + node])
    rows = cpu_attention.VisibleRows([past] * t, extras)
    got = KERNEL(query, key, value, rows, 0.2)
    reference = cpu_attention.row_attention_reference(query, key, value, rows, 0.2)
    assert (got - reference).abs().max() <= 2e-6 * reference.abs().max() + 1e-6
    # a node computed on its own (as after accepting its path) gives the same bits
    for i in range(t):
        alone = KERNEL(query[:, :, i : i + 1], key, value, cpu_attention.VisibleRows([past], [extras[i]]), 0.2)
        assert torch.equal(alone[:, 0], got[:, i])
    # what a row cannot see does not matter to it
    changed = key.clone()
    changed[:, :, past + 2] += 5.0  # node 1: only rows under node 1 see it
    again = KERNEL(query, changed, value, rows, 0.2)
    for i, seen in enumerate(extras):
        assert torch.equal(again[:, i], got[:, i]) == (past + 2 not in seen), i


@needs_kernel
def test_wrong_layouts_are_refused():
    key, value = cache_views(2, 16, 8, seed=0)
    query = torch.randn(1, 4, 1, 16)
    with pytest.raises(ValueError, match="float32"):
        KERNEL(query.double(), key, value, cpu_attention.VisibleRows.causal(1, 8), 0.25)
    with pytest.raises(ValueError, match="contiguous rows"):
        KERNEL(query, torch.randn(1, 2, 8, 32)[..., :16], value, cpu_attention.VisibleRows.causal(1, 8), 0.25)


@needs_kernel
def test_a_model_with_the_kernel_and_with_the_torch_loop_agree_and_each_keeps_greedy_identity(monkeypatch):
    from conftest import PROMPT_IDS, hf_greedy, tiny_model
    from localspec.base.config import GenerationLimits, SpecConfig
    from localspec.core.engine import Engine
    from localspec.core.proposers import NgramProposer
    from localspec.runtime import attention

    model = tiny_model("qwen2", hidden=64)
    attention.use_exact_attention(model)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        with_kernel = model(ids).logits
    expected = hf_greedy(model, PROMPT_IDS, 24)
    runs = {}
    for path in ("kernel", "torch"):
        if path == "torch":
            monkeypatch.setattr(attention, "_cpu_kernel", lambda: None)
        engine = Engine(model, None, NgramProposer(), SpecConfig(draft_len=4))
        runs[path] = [p.token_id for ev in engine.generate(PROMPT_IDS, limits=GenerationLimits(24)) for p in ev.pieces]
    with torch.no_grad():
        with_torch = model(ids).logits
    assert (with_kernel - with_torch).abs().max() <= 1e-4 * with_torch.abs().max()
    assert runs["kernel"] == expected
    assert runs["torch"] == hf_greedy(model, PROMPT_IDS, 24)  # the reference path is exact on its own terms
