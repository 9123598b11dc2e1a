"""The w4a8 CPU kernel in its three block formats (4-, 6- and 8-bit codes) against its torch reference,
row independence, per-group activation scales, the fallback when it cannot be built, and a real
model on it: memory-mapped blocks, repacking a damaged file, exact speculation."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_speculation_reproduces_greedy
from localspec.base.errors import LocalspecError
from localspec.kernels import cpu_w4a8
from localspec.kernels.cpu_build import KernelUnavailable
from localspec.kernels.int4_format import quantize_int4, unpack_int4
from localspec.runtime import quant as quantization
from localspec.runtime.attention import use_exact_attention


def kernel_or_none():
    try:
        return quantization.w4a8_kernel()
    except LocalspecError:
        return None


KERNEL = kernel_or_none()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the w4a8 kernel cannot be built or run here")
ISAS = [isa for isa in (3, 2, 1) if KERNEL is not None and KERNEL.isa >= isa]


BITS = [4, 6, 8]


def quantize_bytes(weight: torch.Tensor, bits: int = 8):
    """(N, K) float -> `bits`-bit codes uint8 (N, K), scales and mins (N, K/16): min/max per 16 inputs."""
    n, k = weight.shape
    top = 2**bits - 1
    groups = weight.reshape(n, k // cpu_w4a8.BYTE_GROUP, cpu_w4a8.BYTE_GROUP)  # (N, B, 16)
    mins = groups.amin(-1)
    scales = ((groups.amax(-1) - mins) / top).clamp_min(1e-8)
    codes = torch.round((groups - mins[..., None]) / scales[..., None]).clamp(0, top).to(torch.uint8)
    return codes.reshape(n, k), scales, mins


def random_layer(n: int, k: int, seed: int, bits: int = 4):
    """A random linear in the kernel's format of `bits`-bit codes: blocks, and the codes (N, K),
    scales and mins (N, K / block_inputs) the references take, and a bias."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    bias = torch.randn(n, generator=gen)
    if bits == 4:
        packed, scales, mins = quantize_int4(weight, cpu_w4a8.GROUP)
        return cpu_w4a8.pack(packed, scales, mins), unpack_int4(packed), scales, mins, bias
    codes, scales, mins = quantize_bytes(weight, bits)
    return cpu_w4a8.pack_codes(codes, scales, mins, bits), codes, scales, mins, bias


def assert_rows_alone_equal_rows_together_and_near(linear, x: torch.Tensor, widths, reference: torch.Tensor) -> None:
    """linear over the first m rows equals its rows among all of x bit for bit, for each m in
    widths; all rows within 1e-5 of each row's largest reference output."""
    together = linear(x)  # (M, N)
    for m in widths:
        assert torch.equal(linear(x[:m].contiguous()), together[:m]), m
    bound = 1e-5 * reference.abs().amax(dim=1, keepdim=True) + 1e-6
    assert ((together - reference).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("n, k", [(1, 32), (37, 64), (257, 96), (16, 1536), (300, 8960)])
def test_kernel_matches_reference_for_every_width_and_a_row_alone_equals_the_row_among_many(isa, n, k, bits):
    blocks, codes, scales, mins, bias = random_layer(n, k, seed=n + k, bits=bits)
    x = torch.randn(35, k, generator=torch.Generator().manual_seed(k)) * 3
    x[5] = 0.0  # an all-zero row: scales clamp, output is the bias
    x[6, 0] = 1e4  # an outlier row
    x[7, :32] = 0.0  # an all-zero group in a row
    # a row alone (one-token decoding) computes what it computes among 35 (a verify pass; with AMX
    # two sets of 16 on the tile unit, 3 rows on VNNI) bit for bit; integer sums are exact, then a
    # float32 sum over the K/32 (or K/16) blocks
    assert_rows_alone_equal_rows_together_and_near(lambda rows: KERNEL.linear(rows, blocks, n, bias, isa, bits=bits), x,
                                                   [*range(1, 18), 32, 33],
                                                   cpu_w4a8.w4a8_linear_reference(x, codes, scales, mins, bias))
    assert torch.equal(KERNEL.linear(x[5:6], blocks, n, bias, isa, bits=bits)[0], bias)


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
def test_the_instruction_sets_compute_the_same_bits_and_bias_is_optional(bits):
    """AVX2, VNNI and AMX (for whole sets of 16 rows) take the same exact integer sums and the same
    float steps in the same order, so a model computes the same numbers on any of these CPUs."""
    if len(ISAS) < 2:
        pytest.skip("this CPU runs only the AVX2 path")
    blocks, codes, scales, mins, _ = random_layer(70, 192, seed=3, bits=bits)
    x = torch.randn(37, 192)  # AMX: two sets of 16, then 5 rows on VNNI
    reference = cpu_w4a8.w4a8_linear_reference(x, codes, scales, mins, None)
    first = KERNEL.linear(x, blocks, 70, None, ISAS[0], bits=bits)
    assert (first - reference).abs().max() <= 1e-5 * reference.abs().max()
    for isa in ISAS[1:]:
        assert torch.equal(KERNEL.linear(x, blocks, 70, None, isa, bits=bits), first), isa


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
def test_the_tile_unit_computes_what_the_vector_units_compute_bit_for_bit(bits):
    """AMX takes whole sets of 16 rows; its integer sums and float steps are VNNI's, so a model
    computes the same numbers on a machine with AMX and on one without."""
    if 3 not in ISAS:
        pytest.skip("this CPU (or its kernel) has no AMX")
    blocks, _, _, _, bias = random_layer(300, 8960, seed=7, bits=bits)
    x = torch.randn(48, 8960) * 2
    assert torch.equal(KERNEL.linear(x, blocks, 300, bias, 3, bits=bits), KERNEL.linear(x, blocks, 300, bias, 2, bits=bits))


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("isa", ISAS)
def test_the_largest_codes_times_the_largest_activations_sum_exactly(isa, bits):
    """Every code at its top value against activations that all quantize to +127 or -127: the
    largest integer sums there are. The AVX2 path adds pairs of products in 16 bits before widening
    them (its bound: 8 pairs of 4-bit codes, 2 of 6-bit ones, only the top bits of byte codes), so
    a bound off by one pair wraps here and nowhere milder."""
    n, k = 32, 512
    top = 2**bits - 1
    codes = torch.full((n, k), top, dtype=torch.uint8)
    count = k // cpu_w4a8.block_inputs(bits)
    scales, mins = torch.full((n, count), 0.5), torch.zeros(n, count)
    if bits == 4:
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        blocks = cpu_w4a8.pack(packed, scales, mins)
    else:
        blocks = cpu_w4a8.pack_codes(codes, scales, mins, bits)
    signs = torch.ones(4, k)
    signs[1] = -1.0
    signs[2, ::2] = -1.0  # alternating: pairs that cancel
    signs[3, : k // 2] = -1.0  # each half of the row one sign
    got = KERNEL.linear(signs, blocks, n, None, isa, bits=bits)
    expected = cpu_w4a8.w4a8_linear_reference(signs, codes, scales, mins, None)
    assert ((got - expected).abs() <= 1e-5 * expected.abs().amax()).all()  # float32 steps over the blocks
    assert got[0, 0] == pytest.approx(top * k * 0.5)  # 127 steps of 1/127 per input


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
def test_activation_scales_are_per_group_of_32_so_one_huge_value_flattens_only_its_own_group(bits):
    """A row's one huge value (the first position's activations are such rows) sets the scale of its
    own 32 inputs only: the other groups keep their resolution, and the result stays within the
    per-group rounding bound of the float product, which one scale per row misses by far."""
    n, k = 48, 256
    blocks, _, _, _, bias = random_layer(n, k, seed=11, bits=bits)
    weight = cpu_w4a8.W4A8Linear(k, n, blocks, bias, KERNEL, bits=bits).dense_weight()  # (N, K)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(12))
    x[0, :32] = 0.0
    x[0, 0] = 1e4  # group 0 holds only it: 127 steps of 1e4 / 127
    exact = (x.double() @ weight.double().t() + bias.double()).float()  # (1, N)
    steps = x.reshape(k // 32, 32).abs().amax(-1) / 127  # (G,): each group's activation scale
    # at most half a step per input of groups 1..; group 0's one value is 127 of its steps (exact
    # but for float32 rounding, which the slack covers)
    rounding = (weight.abs().reshape(n, k // 32, 32).sum(-1) * steps / 2)[:, 1:].sum(-1)  # (N,)
    slack = 1e-5 * exact.abs().amax()
    got = KERNEL.linear(x, blocks, n, bias, bits=bits)
    assert ((got - exact).abs() <= rounding + slack).all()
    row_step = x.abs().amax() / 127  # one scale per row: every other group rounds to zero
    per_row = (torch.round(x / row_step) * row_step).double() @ weight.double().t() + bias.double()
    assert ((per_row.float() - exact).abs() > rounding + slack).float().mean() > 0.9


@needs_kernel
def test_silu_mul_matches_torch_on_the_strided_halves_of_a_fused_output_row_by_row():
    fused = torch.randn(9, 2 * 37, generator=torch.Generator().manual_seed(2)) * 6  # (M, 2I): gate | up
    fused[0, :5] = torch.tensor([-90.0, 90.0, 0.0, -0.0, 1e-3])
    gate, up = fused[:, :37], fused[:, 37:]
    got = cpu_w4a8.silu_mul(KERNEL, gate, up)  # (M, I)
    reference = cpu_w4a8.silu_mul_reference(gate.double(), up.double()).float()
    assert torch.allclose(got, reference, rtol=1e-6, atol=1e-37)  # float32 rounding, as torch's own float silu
    for r in range(9):
        assert torch.equal(cpu_w4a8.silu_mul(KERNEL, gate[r : r + 1], up[r : r + 1]), got[r : r + 1]), r


needs_prompt_path = pytest.mark.skipif(KERNEL is None or not KERNEL.prompt_usable, reason="this CPU has no AMX-BF16")


@needs_prompt_path
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n, k", [(1, 32), (37, 64), (257, 96), (300, 1536), (40, 8960)])
def test_prompt_path_matches_its_reference_and_a_row_alone_equals_the_row_among_many(monkeypatch, n, k, bits):
    monkeypatch.setattr(cpu_w4a8, "PROMPT_ROWS", 1)
    blocks, codes, scales, mins, bias = random_layer(n, k, seed=n * k, bits=bits)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(n)) * 3
    x[3] = 0.0
    with cpu_w4a8.prompt_pass():  # 70 rows: sets of 32 and 16, and a padded one
        # bf16 products are exact in float32; only the order of the float32 sum over K differs
        assert_rows_alone_equal_rows_together_and_near(lambda rows: KERNEL.linear(rows, blocks, n, bias, bits=bits), x,
                                                       (1, 5, 16, 17, 33, 64),
                                                       cpu_w4a8.w4a8_prompt_reference(x, codes, scales, mins, bias))
        assert torch.equal(KERNEL.linear(x[3:4], blocks, n, bias, bits=bits)[0], bias)


@needs_prompt_path
def test_only_a_prompt_pass_of_enough_rows_takes_the_prompt_path():
    """Decode and verify passes keep the decode path's numbers whatever their width: that is what
    makes speculation reproduce plain decoding. Only a prompt's pass may take the bf16 tiles."""
    blocks, codes, scales, mins, bias = random_layer(48, 256, seed=5)
    x = torch.randn(cpu_w4a8.PROMPT_ROWS, 256)
    decode = KERNEL.linear(x, blocks, 48, bias)
    short = x[:-1].contiguous()
    with cpu_w4a8.prompt_pass():
        prompt = KERNEL.linear(x, blocks, 48, bias)
        assert torch.equal(KERNEL.linear(short, blocks, 48, bias), decode[:-1]), "fewer rows: the decode path"
    assert not torch.equal(prompt, decode)
    assert torch.allclose(prompt, cpu_w4a8.w4a8_prompt_reference(x, codes, scales, mins, bias), rtol=1e-4, atol=1e-5)
    assert torch.equal(KERNEL.linear(x, blocks, 48, bias), decode), "outside prompt_pass: the decode path"


class ByteSource(torch.nn.Module):
    """What `fuse` takes for the 6- and 8-bit formats: a linear's codes, scales and mins per 16 inputs."""

    def __init__(self, out_features: int, in_features: int, seed: int, bits: int = 8) -> None:
        super().__init__()
        self.out_features, self.in_features, self.bits = out_features, in_features, bits
        _, self.codes, self.scales, self.mins, bias = random_layer(out_features, in_features, seed, bits=bits)
        self.bias = torch.nn.Parameter(bias, requires_grad=False)


def int4_source(out_features: int, in_features: int, seed: int) -> torch.nn.Module:
    from localspec.kernels.int4_linear import Int4Linear

    source = Int4Linear(in_features, out_features, True, 32, torch.float32)
    _, codes, scales, mins, bias = random_layer(out_features, in_features, seed)
    source.packed.copy_(codes[:, 0::2] | (codes[:, 1::2] << 4))
    source.scales.copy_(scales)
    source.mins.copy_(mins)
    source.bias.data.copy_(bias)
    return source


def source_of(bits: int, out_features: int, in_features: int, seed: int) -> torch.nn.Module:
    if bits == 4:
        return int4_source(out_features, in_features, seed)
    return ByteSource(out_features, in_features, seed, bits)


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
def test_linear_module_keeps_leading_dims_and_adds_bias(bits):
    source = source_of(bits, 48, 64, seed=1)
    layer = cpu_w4a8.fuse([source], KERNEL)[0]
    assert layer.bits == bits
    x = torch.randn(1, 5, 64, dtype=torch.bfloat16)
    out = layer(x)
    assert out.shape == (1, 5, 48) and out.dtype == torch.float32
    codes, scales, mins = cpu_w4a8.read_codes(layer.blocks, 48, 64, bits)
    expected = cpu_w4a8.w4a8_linear_reference(x.float(), codes, scales, mins, source.bias)
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max() + 1e-6


def test_pack_places_each_code_where_the_kernel_reads_it():
    n, k = 17, 64
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    scales, mins = torch.rand(n, 2), torch.rand(n, 2)
    blocks = cpu_w4a8.pack(packed, scales, mins).reshape(2, 2, 320)  # (tile, group, bytes)
    for out, inp in [(0, 0), (3, 5), (16, 63), (9, 17), (15, 48)]:
        tile, row, group, within = out // 16, out % 16, inp // 32, inp % 32
        half, p, t = within // 16, (within % 16) // 4, within % 4
        byte = int(blocks[tile, group, 64 * p + 4 * row + t])
        assert (byte >> 4 if half else byte & 15) == codes[out, inp]
        stored_scale = blocks[tile, group, 256 + 2 * row : 258 + 2 * row].view(torch.float16)
        assert stored_scale.item() == scales[out, group].half().item()
    assert blocks[1, 0, 4:64].eq(0).all(), "padded outputs are zero"


def test_pack_bytes_places_each_code_where_the_kernel_reads_it_and_unpack_bytes_reads_all_back():
    n, k = 17, 64
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8)
    scales, mins = torch.rand(n, 4), -torch.rand(n, 4)
    flat = cpu_w4a8.pack_bytes(codes, scales, mins)
    assert flat.numel() == cpu_w4a8.block_bytes(n, k, bits=8) == 2 * 4 * 320
    blocks = flat.reshape(2, 4, 320)  # (tile, block of 16 inputs, bytes)
    for out, inp in [(0, 0), (3, 5), (16, 63), (9, 17), (15, 48), (4, 30)]:
        tile, row, block, within = out // 16, out % 16, inp // 16, inp % 16
        p, t = within // 4, within % 4
        assert blocks[tile, block, 64 * p + 4 * row + t] == codes[out, inp]
        assert blocks[tile, block, 256 + 2 * row : 258 + 2 * row].view(torch.float16).item() == scales[out, block].half().item()
        assert blocks[tile, block, 288 + 2 * row : 290 + 2 * row].view(torch.float16).item() == mins[out, block].half().item()
    assert blocks[1, :, 4:64].eq(0).all() and blocks[1, :, 258:288].eq(0).all(), "padded outputs are zero"
    back, scales16, mins16 = cpu_w4a8.unpack_bytes(flat, n, k)
    assert torch.equal(back, codes) and torch.equal(scales16, scales.half()) and torch.equal(mins16, mins.half())
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_w4a8.pack_bytes(codes[:, :48], scales[:, :3], mins[:, :3])


def test_pack_six_places_each_code_where_the_kernel_reads_it_and_unpack_six_reads_all_back():
    n, k = 17, 64
    codes = torch.randint(0, 64, (n, k), dtype=torch.uint8)
    scales, mins = torch.rand(n, 4), -torch.rand(n, 4)
    flat = cpu_w4a8.pack_six(codes, scales, mins)
    assert flat.numel() == cpu_w4a8.block_bytes(n, k, bits=6) == 2 * 4 * 256
    blocks = flat.reshape(2, 4, 256)  # (tile, block of 16 inputs, bytes)
    for out, inp in [(0, 0), (3, 5), (16, 63), (9, 17), (15, 48), (4, 30), (7, 13)]:
        tile, row, block, within = out // 16, out % 16, inp // 16, inp % 16
        p, t = within // 4, within % 4
        nibble_byte = int(blocks[tile, block, 64 * (p % 2) + 4 * row + t])
        low = nibble_byte >> 4 if p >= 2 else nibble_byte & 15
        high = (int(blocks[tile, block, 128 + 4 * row + t]) >> (2 * p)) & 3
        assert low | (high << 4) == codes[out, inp]
        assert blocks[tile, block, 192 + 2 * row : 194 + 2 * row].view(torch.float16).item() == scales[out, block].half().item()
        assert blocks[tile, block, 224 + 2 * row : 226 + 2 * row].view(torch.float16).item() == mins[out, block].half().item()
    assert blocks[1, :, 4:64].eq(0).all() and blocks[1, :, 194:224].eq(0).all(), "padded outputs are zero"
    back, scales16, mins16 = cpu_w4a8.unpack_six(flat, n, k)
    assert torch.equal(back, codes) and torch.equal(scales16, scales.half()) and torch.equal(mins16, mins.half())
    with pytest.raises(ValueError, match="0..63"):
        cpu_w4a8.pack_six(codes + 64, scales, mins)


@needs_kernel
@pytest.mark.parametrize("isa", ISAS)
def test_6bit_blocks_compute_what_8bit_blocks_of_the_same_codes_compute_bit_for_bit(isa):
    """The 6-bit format only stores the same codes in fewer bytes: a Q6_K tensor gives the numbers it
    gave in 8-bit blocks (the perplexity measured on those holds), for 1 to 17 rows."""
    _, codes, scales, mins, bias = random_layer(70, 1536, seed=11, bits=6)
    six, eight = cpu_w4a8.pack_six(codes, scales, mins), cpu_w4a8.pack_bytes(codes, scales, mins)
    assert six.numel() * 10 == eight.numel() * 8
    x = torch.randn(17, 1536) * 2
    for m in (1, 2, 3, 16, 17):
        assert torch.equal(KERNEL.linear(x[:m], six, 70, bias, isa, bits=6), KERNEL.linear(x[:m], eight, 70, bias, isa, bits=8))


@needs_kernel
@pytest.mark.parametrize("bits", [6, 8])
def test_a_6_or_8bit_layer_reads_back_codes_times_scale_plus_min_and_that_is_what_the_kernel_multiplies(bits):
    n, k = 37, 96
    blocks, codes, scales, mins, bias = random_layer(n, k, seed=4, bits=bits)
    layer = cpu_w4a8.W4A8Linear(k, n, blocks, bias, KERNEL, bits=bits)
    expected = codes.float() * scales.half().float().repeat_interleave(16, dim=1) + mins.half().float().repeat_interleave(16, dim=1)
    assert torch.equal(layer.dense_weight(), expected)
    # one-hot rows (each the only non-zero of its group: exact in int8) give each input's column
    columns = layer(torch.eye(k)) - layer.bias  # (K, N)
    torch.testing.assert_close(columns, expected.t(), rtol=1e-5, atol=1e-6)


def test_without_a_compiler_the_kernel_says_why_and_auto_takes_another_format(monkeypatch, tmp_path, capsys):
    from localspec.store import session
    from localspec.store.registry import load_registry

    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    cpu_w4a8.load.cache_clear()
    session._say_once.cache_clear()
    try:
        with pytest.raises(LocalspecError, match="no C\\+\\+ compiler"):
            quantization.check_supported("w4a8", torch.device("cpu"))
        quant, reason = session.choose_quant(load_registry().get("qwen2.5-coder-1.5b"), "auto", torch.device("cpu"))
        assert quant in ("w8a8", "int4") and "w4a8" not in reason
        assert "no C++ compiler found" in capsys.readouterr().err
        monkeypatch.setenv("CXX", "false")  # a compiler that fails
        with pytest.raises(KernelUnavailable, match="building the w4a8 kernel"):
            cpu_w4a8.load(tmp_path / "other")
        assert not list((tmp_path / "other").glob("*.so*")), "a failed build leaves nothing behind"
    finally:
        cpu_w4a8.load.cache_clear()
        session._say_once.cache_clear()


@needs_kernel
def test_auto_takes_w4a8_for_a_4bit_model_on_a_cpu_that_builds_it():
    from localspec.store import session
    from localspec.store.registry import load_registry

    quant, reason = session.choose_quant(load_registry().get("qwen2.5-coder-1.5b"), "auto", torch.device("cpu"))
    assert quant == "w4a8" and KERNEL.name in reason
    with pytest.raises(LocalspecError, match="w4a8 is a CPU format"):
        quantization.check_supported("w4a8", torch.device("mps"))


@pytest.mark.real_model
@needs_kernel
def test_w4a8_runs_the_gguf_from_stored_blocks_and_speculation_reproduces_its_greedy_output():
    import localspec.store.loading as loading
    from localspec.store.paths import gguf_cache
    from localspec.store.registry import load_registry

    entry = load_registry().get("smollm2-135m")
    loaded = loading.load_model(entry, torch.bfloat16, quant="w4a8", progress=False)
    assert loaded.quant == "w4a8" and loaded.dtype == torch.float32
    (blocks_file,) = gguf_cache(entry).glob(quantization.W4A8_LAYOUT.replace(".pt", "-*.pt"))
    assert blocks_file in loaded.cache_files, "the kernel's blocks are stored beside the GGUF's header"
    layers = [m for m in loaded.model.modules() if isinstance(m, cpu_w4a8.W4A8Linear)]
    assert len(layers) == 30 * 7 + 1  # every projection and the output layer
    assert sum(isinstance(m, cpu_w4a8.GatedMLP) for m in loaded.model.modules()) == 30
    assert all(p.dtype == torch.float32 for n, p in loaded.model.named_parameters() if "embed_tokens" not in n)
    ids = assert_speculation_reproduces_greedy(loaded)
    # a warm load maps the stored blocks; a damaged file is packed again, to the same model
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids])).logits
    again = loading.load_model(entry, torch.bfloat16, quant="w4a8", progress=False)
    assert not again.cold
    use_exact_attention(again.model)  # as the engine left the first one
    with torch.no_grad():
        assert torch.equal(again.model(torch.tensor([ids])).logits, logits)
    del again
    blocks_file.write_bytes(b"garbage")
    repacked = loading.load_model(entry, torch.bfloat16, quant="w4a8", progress=False)
    use_exact_attention(repacked.model)
    with torch.no_grad():
        assert torch.equal(repacked.model(torch.tensor([ids])).logits, logits)
    assert blocks_file.stat().st_size > 1000


@pytest.mark.real_model
@needs_prompt_path
def test_a_long_prompt_fills_the_cache_through_the_prompt_path_and_speculation_still_reproduces_plain_decoding(monkeypatch):
    from conftest import CODE_PROMPT
    from localspec.base.config import GenerationLimits, SpecConfig
    from localspec.core.engine import Engine
    from localspec.core.proposers import DraftModelProposer, NgramProposer
    import localspec.store.loading as loading
    from localspec.store.registry import load_registry

    loaded = loading.load_model(load_registry().get("smollm2-135m"), torch.bfloat16, quant="w4a8", progress=False)
    kernel = next(m.kernel for m in loaded.model.modules() if isinstance(m, cpu_w4a8.W4A8Linear))
    prompt_calls = []
    real = kernel._prompt
    monkeypatch.setattr(kernel, "_prompt", lambda *a: prompt_calls.append(a[1]) or real(*a))
    ids = loaded.tokenizer(CODE_PROMPT * 8, return_tensors="pt").input_ids[0].tolist()
    assert len(ids) > cpu_w4a8.PROMPT_ROWS

    def run(proposer):
        engine = Engine(loaded.model, None, proposer, SpecConfig(draft_len=6))
        return [p.token_id for ev in engine.generate(ids, limits=GenerationLimits(24)) for p in ev.pieces]

    plain = run(None)
    assert prompt_calls and min(prompt_calls) == len(ids) - 1, "the prompt's pass took the prompt path"
    for proposer in (NgramProposer(), DraftModelProposer(loaded.model)):
        assert run(proposer) == plain, proposer


@needs_kernel
@pytest.mark.parametrize("bits", BITS)
def test_linears_sharing_an_input_compute_in_one_call_exactly_what_each_computes_alone(monkeypatch, bits):
    sources = [source_of(bits, n, 96, seed=10 + i) for i, n in enumerate((64, 32, 32))]  # q, k, v
    alone = [cpu_w4a8.fuse([s], KERNEL)[0] for s in sources]
    shared = cpu_w4a8.fuse(sources, KERNEL)
    assert all(layer.shared is shared[0].shared for layer in shared) and shared[0].shared.bits == bits
    calls = []
    real = KERNEL.linear
    monkeypatch.setattr(KERNEL, "linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, other = torch.randn(1, 7, 96), torch.randn(1, 7, 96)
    outputs = [layer(x) for layer in shared]
    assert len(calls) == 1, "one kernel call for the three"
    for got, layer in zip(outputs, alone):
        assert torch.equal(got, layer(x))
    assert torch.equal(shared[1](other), alone[1](other)), "another input is computed, not served stale"
    shared[0](other)
    assert shared[0].shared._output is not None
    shared[2](other)
    assert shared[0].shared._output is None, "no tensors held once every member has its output"


@needs_kernel
def test_linears_of_different_block_formats_do_not_share_a_call():
    sources = [int4_source(32, 64, seed=1), ByteSource(32, 64, seed=2)]
    with pytest.raises(ValueError, match="one block format"):
        cpu_w4a8.fuse(sources, KERNEL)
    shared = cpu_w4a8.fuse([ByteSource(32, 64, seed=3), ByteSource(16, 64, seed=4)], KERNEL)[0].shared
    with pytest.raises(ValueError, match="4-bit layer cannot share a call of 8-bit blocks"):
        cpu_w4a8.W4A8Linear(64, 32, cpu_w4a8.fused_blocks(sources[:1]), None, KERNEL, shared, 0, bits=4)


def test_a_damaged_kernel_library_in_the_cache_is_built_again(tmp_path):
    from localspec.kernels.cpu_build import build

    first = build(cpu_w4a8.SOURCE, tmp_path / "a", "w4a8 kernel")
    (built,) = (tmp_path / "a").glob("*.so")
    library = tmp_path / "b" / built.name  # where the next process finds it: damaged (a full disk, an edit)
    library.parent.mkdir()
    library.write_bytes(b"not a shared library")
    assert build(cpu_w4a8.SOURCE, tmp_path / "b", "w4a8 kernel").w4a8_isa() == first.w4a8_isa()
    assert library.read_bytes()[:4] == b"\x7fELF"
