"""The Triton kernels (4-bit small-M matmul, fused rejection sampling, row attention) against their
torch references.

By default they run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), so machines
without a GPU check them; `TRITON_INTERPRET=0 pytest tests/test_triton_kernels.py` runs the same
checks compiled on a CUDA GPU. One test also compiles both kernels for a Hopper GPU (sm_90), which
needs no GPU, to catch what only the real compiler rejects. The interpreter is slow: shapes and
vocabularies are small.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

INTERPRET = os.environ.setdefault("TRITON_INTERPRET", "1") == "1"  # conftest sets it before triton loads
triton = pytest.importorskip("triton")
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA GPU", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

import localspec.kernels.triton_int4 as triton_int4  # noqa: E402
import localspec.kernels.triton_sampling as triton_sampling  # noqa: E402
from localspec.kernels.triton_row_attention import row_attention, row_attention_reference  # noqa: E402
from localspec.kernels.int4_format import (  # noqa: E402
    dequantize_int4,
    int4_matmul_reference,
    quantize_int4,
    unpack_int4,
)


def on_device(*values):
    """Tensors to the kernels' device (None and numbers pass through)."""
    return [v.to(DEVICE) if isinstance(v, torch.Tensor) else v for v in values]


# ---------------------------------------------------------------------------------------------
# int4 format


def test_quantize_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    weight = torch.randn(37, 128) * 3.0
    weight[0, :32] = 0.25  # a constant group: encoded exactly
    weight[1, 32:64] += 100.0  # a group far from zero: the error still scales with its spread only
    for group_size in (32, 64, 128):
        packed, scales, mins = quantize_int4(weight, group_size)
        assert packed.dtype == torch.uint8 and packed.shape == (37, 64)
        assert scales.dtype == mins.dtype == torch.float32 and scales.shape == (37, 128 // group_size)
        error = (dequantize_int4(packed, scales, mins, group_size) - weight).abs()  # (N, K)
        per_group = error.reshape(37, -1, group_size).amax(dim=-1)  # (N, G)
        # round to nearest: half a step, plus float32 rounding of w and of q * scale + min
        slack = 1e-6 * weight.abs().reshape(37, -1, group_size).amax(dim=-1)
        assert (per_group <= scales / 2 + slack).all()
    assert torch.equal(dequantize_int4(*quantize_int4(weight, 32), 32)[0, :32], weight[0, :32])


def test_packing_layout_low_nibble_first():
    codes = torch.tensor([list(range(16)) + list(range(15, -1, -1))], dtype=torch.float32)  # (1, 32)
    packed, scales, mins = quantize_int4(codes, 32)  # min 0, max 15: scale 1, q = w
    assert scales.item() == 1.0 and mins.item() == 0.0
    q = codes.to(torch.uint8)
    assert torch.equal(packed, q[:, 0::2] | (q[:, 1::2] << 4))
    assert packed[0, 0].item() == 0 | (1 << 4) and packed[0, 8].item() == 15 | (14 << 4)
    assert torch.equal(unpack_int4(packed), q)
    assert dequantize_int4(packed, scales, mins, 32, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("shape, group_size", [((4, 48), 32), ((4, 64), 7), ((4, 64), 0), ((64,), 32)])
def test_quantize_rejects_bad_layouts(shape, group_size):
    with pytest.raises(ValueError):
        quantize_int4(torch.randn(shape), group_size)


# ---------------------------------------------------------------------------------------------
# int4 matmul kernel

ROUNDING = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-7}
"""Relative error of rounding a float32 result to each dtype: half a unit in the last place; a whole
one for bfloat16, which Triton's interpreter truncates (a GPU rounds to nearest)."""


def assert_matmul_close(out, x, packed, scales, mins, group_size):
    """Bound: |out - exact| <= ROUNDING[dtype] * |exact| + 1e-5 * (|x| @ |W|.T).

    `exact` is the float32 reference from x upcast (the rounding to x.dtype is the first term); the
    second covers float32 sums taken in another order (K * eps32 * sum |x w| for K <= 128, with
    room), and the kernel's scale * (x @ q) + min * sum(x) in place of x @ (q * scale + min).
    """
    exact = int4_matmul_reference(x.float(), packed, scales, mins, group_size)  # (M, N)
    weight = dequantize_int4(packed, scales, mins, group_size)  # (N, K)
    bound = ROUNDING[x.dtype] * exact.abs() + 1e-5 * (x.float().abs() @ weight.abs().T)
    assert out.shape == exact.shape and out.dtype == x.dtype
    assert ((out.float() - exact).abs() <= bound).all(), (out.float() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 7, 16])
@pytest.mark.parametrize("out_features, in_features, group_size", [(33, 64, 32), (257, 96, 32), (40, 128, 64)])
def test_int4_matmul_matches_reference(dtype, rows, out_features, in_features, group_size):
    torch.manual_seed(rows * out_features)
    packed, scales, mins = quantize_int4(torch.randn(out_features, in_features), group_size)
    x = torch.randn(rows, in_features).to(dtype)
    out = triton_int4.int4_matmul(*on_device(x, packed, scales, mins), group_size).cpu()
    assert_matmul_close(out, x, packed, scales, mins, group_size)


def test_int4_matmul_fp16_strided_input_and_more_than_16_rows():
    torch.manual_seed(1)
    packed, scales, mins = quantize_int4(torch.randn(17, 64), 32)
    x = torch.randn(64, 20, dtype=torch.float16).T  # (20, 64), not contiguous: two row blocks
    out = triton_int4.int4_matmul(*on_device(x, packed, scales, mins), 32).cpu()
    assert_matmul_close(out, x, packed, scales, mins, 32)


def test_int4_matmul_rejects_what_it_cannot_run():
    packed, scales, mins = quantize_int4(torch.randn(8, 64), 16)
    with pytest.raises(ValueError, match="power of two >= 32"):
        triton_int4.int4_matmul(torch.randn(2, 64), packed, scales, mins, 16)
    packed, scales, mins = quantize_int4(torch.randn(8, 64), 32)
    with pytest.raises(ValueError, match="expected packed"):
        triton_int4.int4_matmul(torch.randn(2, 64), packed[:, :16], scales, mins, 32)


# ---------------------------------------------------------------------------------------------
# rejection sampling kernel


def random_case(gen: torch.Generator, nodes: int, vocab: int, tree: bool, with_q: bool):
    """A draft as a proposer would make it: tokens drawn from a q near the target's p, or guesses
    drawn from p itself (no q), so that walks stop at every depth."""
    if tree:
        parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(nodes)]  # any earlier node
    else:
        parents = list(range(-1, nodes - 1))
    sharpness = float(torch.rand((), generator=gen)) * 16.0  # from flat to one clear favourite
    target = torch.softmax(torch.randn(nodes + 1, vocab, generator=gen) * sharpness, dim=-1)  # (N+1, V)
    wanted = target[[parent + 1 for parent in parents]]  # (N, V): p where each node is proposed
    draft = torch.softmax(wanted.log() + torch.randn(nodes, vocab, generator=gen), dim=-1) if with_q else None
    source = draft if with_q else wanted  # (N, V)
    tokens = torch.multinomial(source, 1, generator=gen)[:, 0] if nodes else torch.zeros(0, dtype=torch.long)
    return (target, tokens, torch.tensor(parents, dtype=torch.long), draft,
            torch.rand(nodes, generator=gen), float(torch.rand((), generator=gen)))


@pytest.mark.parametrize("vocab, cases", [(50, 120), (3000, 24)])  # 3000: the kernel loops over blocks of V
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sample_matches_reference(vocab, cases, tree, with_q):
    gen = torch.Generator().manual_seed(vocab + 2 * tree + with_q)
    walks = set()
    for _ in range(cases):
        case = random_case(gen, int(torch.randint(0, 8, (), generator=gen)), vocab, tree, with_q)
        expected = triton_sampling.rejection_sample_reference(*case)
        assert triton_sampling.rejection_sample(*on_device(*case)) == expected
        walks.add(len(expected[0]))
    assert len(walks) >= 3  # the cases reached different depths: early, middle and full acceptance


def test_rejection_sample_edge_cases():
    target = torch.tensor([[0.0, 0.5, 0.3, 0.2, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0, 0.9, 0.0]])  # (2, 6)
    one_node = (torch.tensor([2]), torch.tensor([-1]))
    cases = [
        # no draft: the token comes from p at the root
        (target[:1], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), None, torch.zeros(0), 0.7),
        # u at the very top: the last token p allows, never a zero-probability one
        (target, *one_node, None, torch.tensor([0.99]), 1.0),
        # accepted up to a leaf: the bonus token comes from p at the leaf
        (target, *one_node, None, torch.tensor([0.1]), 0.5),
        # p <= q everywhere: the residual is empty, so p stays as it was
        (target, *one_node, target[:1] * 1.5, torch.tensor([0.9]), 0.6),
    ]
    expected = [([], 2), ([], 3), ([0], 4), ([], 2)]
    for case, answer in zip(cases, expected):
        assert triton_sampling.rejection_sample_reference(*case) == answer
        assert triton_sampling.rejection_sample(*on_device(*case)) == answer


@pytest.mark.parametrize("with_q", [False, True])
def test_reference_output_is_distributed_as_the_target(with_q):
    """Lossless: the first committed token follows p at the root, whatever the draft proposes.

    Tree: two candidates for the first position (independent draws from q, or two distinct fixed
    guesses), one with a child. 4,000 walks, Pearson's chi-square over V = 5 tokens (4 degrees of
    freedom) against 18.47, its 0.1% critical value; the seed is fixed, so the test is deterministic.
    """
    gen = torch.Generator().manual_seed(7)
    target = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05], [0.2] * 5, [0.2] * 5, [0.2] * 5])  # (N+1, V)
    draft = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3]]).expand(3, 5) if with_q else None  # (N, V)
    parents = torch.tensor([-1, -1, 0])
    samples = 4000
    counts = torch.zeros(5)
    for _ in range(samples):
        if with_q:
            tokens = torch.multinomial(draft, 1, replacement=True, generator=gen)[:, 0]  # (N,)
        else:
            tokens = torch.tensor([3, 0, 1])  # fixed guesses, distinct among siblings
        accepted, next_token = triton_sampling.rejection_sample_reference(
            target, tokens, parents, draft, torch.rand(3, generator=gen), float(torch.rand((), generator=gen))
        )
        counts[int(tokens[accepted[0]]) if accepted else next_token] += 1
    expected = samples * target[0]
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 18.47, (counts / samples, chi_square)


# ---------------------------------------------------------------------------------------------
# row attention kernel


def table(rows: list[list[int]], width: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """count (T,) and seen (T, E) for rows[i] = the pass's rows that row i sees."""
    width = width or max(map(len, rows))
    return (torch.tensor([len(r) for r in rows]), torch.tensor([r + [0] * (width - len(r)) for r in rows]))


def tree_rows(parents: list[int]) -> list[list[int]]:
    """Row 0 the root, row i + 1 node i: each sees the root, its ancestors and itself."""
    rows = [[0]]
    for i, parent in enumerate(parents, start=1):
        rows.append([*rows[parent + 1], i])
    return rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("past", [0, 31, 70])  # the rows' keys fall in one block, across two, in the third
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(12, 4, 2), (64, 4, 4)])  # 12: not a power of two
def test_row_attention_matches_reference(dtype, past, head_dim, heads, kv_heads):
    torch.manual_seed(past + head_dim)
    rows = tree_rows([-1, 0, 0, 1, -1, 4])
    t, capacity = len(rows), past + len(rows) + 9  # the cache has room beyond the pass: never read
    query = torch.randn(1, heads, t, head_dim).to(dtype)
    key, value = (torch.randn(1, kv_heads, capacity, head_dim).to(dtype) for _ in range(2))
    case = on_device(query, key, value, torch.tensor([past]), *table(rows))
    out = row_attention(*case, head_dim**-0.5).cpu()
    expected = row_attention_reference(query, key, value, torch.tensor([past]), *table(rows), head_dim**-0.5)
    assert out.shape == (1, t, heads, head_dim) and out.dtype == dtype
    assert torch.allclose(out.float(), expected.float(), atol=ROUNDING[dtype] * 4 + 1e-6, rtol=0)


@pytest.mark.parametrize("width", [16, 64])
def test_a_row_gives_the_same_bits_alone_and_in_a_pass(width):
    """A tree node verified among `width` rows, its ancestors at scattered slots, against its
    one-token step once its path is committed and compacted, in a cache of another capacity."""
    torch.manual_seed(width)
    heads, kv_heads, d, past = 4, 2, 64, 45
    parents = [-1] + [int(torch.randint(-1, i, ())) for i in range(width - 2)]  # any earlier node
    rows = tree_rows(parents)
    query = torch.randn(1, heads, width, d, dtype=torch.bfloat16)
    key, value = (torch.randn(1, kv_heads, past + width, d, dtype=torch.bfloat16) for _ in range(2))
    scale = d**-0.5
    in_pass = row_attention(*on_device(query, key, value, torch.tensor([past]), *table(rows, width)), scale).cpu()
    for i in (0, 1, width // 2, width - 1):
        path = rows[i]  # the pass's rows the node sees: its path from the root, itself last
        committed = past + len(path) - 1  # entries before its one-token step
        cache_k, cache_v = (torch.zeros(1, kv_heads, committed + 1 + 50, d, dtype=torch.bfloat16) for _ in range(2))
        for cache, source in ((cache_k, key), (cache_v, value)):
            cache[:, :, :past] = source[:, :, :past]
            cache[:, :, past : committed + 1] = source[:, :, [past + j for j in path]]
        alone = row_attention(*on_device(query[:, :, i : i + 1], cache_k, cache_v, torch.tensor([committed]), *table([[0]])), scale)
        assert torch.equal(alone.cpu()[:, 0], in_pass[:, i]), i


def test_a_row_is_the_same_with_its_keys_listed_from_slot_zero():
    """A plan read from a mask lists every visible slot (past 0); the engine's lists only the pass's
    rows after the cache's entries: the same keys in the same order, so the same bits."""
    torch.manual_seed(3)
    past, rows = 37, tree_rows([-1, 0, -1, 2, 3])
    query = torch.randn(1, 4, len(rows), 16)
    key, value = torch.randn(1, 2, 60, 16), torch.randn(1, 2, 60, 16)
    relative = row_attention(*on_device(query, key, value, torch.tensor([past]), *table(rows)), 0.25)
    absolute = row_attention(*on_device(query, key, value, torch.tensor([0]), *table([[*range(past), *(past + j for j in r)] for r in rows])), 0.25)
    assert torch.equal(relative, absolute)


# ---------------------------------------------------------------------------------------------
# without the interpreter


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from localspec.kernels.triton_int4 import _int4_matmul_kernel
from localspec.kernels.triton_row_attention import _row_attention_kernel
from localspec.kernels.triton_sampling import _rejection_sample_kernel

def build(kernel, types, constexprs):
    signature = dict(zip(kernel.arg_names, types + ["constexpr"] * len(constexprs)))
    compiled = triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    return compiled.asm["ptx"]

for dtype, precision in (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "ieee")):
    ptx = build(_int4_matmul_kernel, [f"*{dtype}", "*u8", "*fp32", "*fp32", f"*{dtype}"] + ["i32"] * 8,
                dict(GROUP=64, BLOCK_M=16, BLOCK_N=32, DOT_PRECISION=precision))
    assert ("mma" in ptx) == (precision == "tf32"), dtype  # tensor cores unless fp32 activations
for has_q in (False, True):
    build(_rejection_sample_kernel, ["*fp32", "i32", "*fp32", "i32", "*i32", "*i32", "*fp32", "*fp32", "*i32", "*i32", "i32", "i32"],
          dict(HAS_Q=has_q, BLOCK_V=1024))
for dtype in ("bf16", "fp16", "fp32"):
    build(_row_attention_kernel, [f"*{dtype}"] * 4 + ["*i64"] * 3 + ["i32", "fp32"] + ["i32"] * 11,
          dict(D=128, GROUPS=6, BLOCK_D=128, BLOCK_N=32))
print("compiled")
"""


def test_kernels_compile_for_a_gpu():
    """The interpreter runs any Python; the GPU compiler is stricter (types across branches, dot
    shapes). Compiling for sm_90 needs only triton's own ptxas, no GPU."""
    result = run_python(COMPILE_FOR_HOPPER)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]


def test_modules_import_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "from localspec.kernels import triton_int4, triton_row_attention, triton_sampling, triton_support\n"
        "assert not triton_support.triton_available()\n"
        "for kernel, args in ((triton_sampling.rejection_sample, 6), (triton_row_attention.row_attention, 7)):\n"
        "    try:\n"
        "        kernel(*[None] * args)\n"
        "    except RuntimeError as e:\n"
        "        print(e)\n"
    )
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.count("needs triton") == 2, result.stderr[-3000:]


# ---------------------------------------------------------------------------------------------
# the kernel inside verify.py's rule


def test_verify_sampling_gives_the_same_verdicts_fused_and_on_the_host():
    """verify_sampling's CUDA path (the kernel) and its host walk draw the same uniforms from the
    same generator, so they must agree verdict for verdict; here under the interpreter."""
    from localspec.base.config import SamplingConfig
    from localspec.core.sampling import make_generator
    from localspec.core.tree import Draft
    from localspec.core.verify import verify_sampling

    gen = torch.Generator().manual_seed(11)
    vocab = 40
    sampling = SamplingConfig(temperature=0.9, top_k=30)
    endings = set()
    for seed in range(30):
        # a sampled chain with its own q, and a fixed guess grafted beside it (one-hot q)
        q = torch.softmax(torch.randn(3, vocab, generator=gen) * 2, dim=-1).to(DEVICE)
        tokens = torch.multinomial(q.cpu(), 1, generator=gen)[:, 0].tolist()
        draft = Draft([*tokens, (tokens[0] + 1) % vocab], [-1, 0, 1, -1], [*q, None])
        logits = (torch.randn(len(draft) + 1, vocab, generator=gen) * 2).to(DEVICE)
        host = verify_sampling(draft, logits, sampling, make_generator(seed, DEVICE), fused=False)
        fused = verify_sampling(draft, logits, sampling, make_generator(seed, DEVICE), fused=True)
        assert (fused.accepted, fused.next_token) == (host.accepted, host.next_token)
        endings.add(tuple(host.accepted))
    assert len(endings) >= 3  # rejections at different places, and the grafted branch
