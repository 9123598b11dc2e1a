"""4-bit weights x 8-bit activations on x86 CPUs, made for the 1-16 rows of speculative decoding.

Why: a one-token decode step reads every weight once, so its cost is the weights' bytes over the
memory bandwidth, and a verify pass of several tokens should cost little more. 16-bit activations
make each extra row pay its own multiply-adds (llama.cpp's 16-token pass costs 5.5x its one-token
pass); oneDNN's int8 x int8 (`cpu_w8a8`) is flat but reads 8 bits per weight. This kernel reads
5 bits per weight (4-bit codes plus fp16 scale and min per group of 32), multiplies them against
every row of the pass with VNNI's u8 x s8 dot product (AVX2's maddubs elsewhere) while a tile of
weights is in cache, and sums exactly in int32. Where the CPU has AMX, whole sets of 16 rows take
their integer sums from the tile unit instead (one TDPBSSD per group and 16 outputs, against 128
VPDPBUSDs), with the same float steps after them, so the numbers are the same bit for bit.
Measured on a 2-core AVX-512 VNNI VM over the 1.5B's linears: 4 rows cost 1.1x what 1 row does
(bound by the bytes), 16 rows 2.1x on VNNI (bound by the dot products) and about 1.8x with AMX.

Arithmetic, for a row x of the pass and an output feature n (groups g of 32 inputs):
    x ~ s_x * a              a = round(x / s_x) in [-127, 127], s_x = absmax(x) / 127 (per row)
    w[n, k] = c[n, k] * scale[n, g] + min[n, g]     c in 0..15 (the int4 format of int4_format.py,
                                                     scale and min rounded to fp16)
    y[n] = s_x * sum_g (scale[n, g] * sum_k c a + min[n, g] * sum_k a) + bias[n]
The integer sums are exact; the float sum over groups runs in a fixed order per row, so a row's
result does not depend on the other rows of the pass (greedy identity between decoding and
verification holds by construction), nor on how the work is split between threads.

Layout (`pack`): outputs in tiles of 16 (the last one padded with zeros), each tile a run of one
320-byte block per group: 256 bytes of codes, byte 4n + t of 64-byte vector p holding the code of
input 4p + t in its low nibble and of input 16 + 4p + t in its high nibble, for output n of the
tile; then 16 fp16 scales; then 16 fp16 mins. `unpack` reads the int4 format back out of them.

Building: the C++ source beside this file is compiled on first use (`cpu_build`, about 2 s)
into the cache folder the caller names. Without a compiler, or on a CPU without AVX2, `load` says
why and the caller keeps another format.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from pathlib import Path

import torch

from localspec.kernels.cpu_build import KernelUnavailable, build
from localspec.kernels.cpu_w8a8 import quantize_rows
from localspec.kernels.int4_format import dequantize_int4, unpack_int4

GROUP = 32
TILE = 16
BLOCK_BYTES = 320
SOURCE = Path(__file__).with_name("cpu_w4a8.cpp")
ISA_NAMES = {3: "AMX + AVX-512 VNNI", 2: "AVX-512 VNNI", 1: "AVX2"}


@functools.cache
def load(cache_dir: Path) -> "Kernel":
    """The compiled kernel, built into cache_dir once; raises KernelUnavailable (one line) when it
    cannot be built or this CPU lacks AVX2."""
    return Kernel(build(SOURCE, cache_dir, "w4a8 kernel"))


class Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.isa = library.w4a8_isa()
        if self.isa == 0:
            raise KernelUnavailable("this CPU has neither AVX2 nor AVX-512 VNNI for the w4a8 kernel")
        self._linear = library.w4a8_linear
        self._linear.restype = None
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
        self.prompt_usable = bool(library.w4a8_prompt_usable())
        self._prompt = library.w4a8_prompt
        self._prompt.restype = None
        self._prompt.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr]
        self._silu_mul = library.w4a8_silu_mul
        self._silu_mul.restype = None
        self._silu_mul.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr]
        self._prompt_scratch = library.w4a8_prompt_scratch
        self._prompt_scratch.restype = i64
        self._prompt_scratch.argtypes = [i64, i64]
        self._local = threading.local()

    def _scratch(self, size: int) -> torch.Tensor:
        """A reused buffer (one per thread) for the quantized rows: allocating it on every call of
        ~200 per pass measured as much as the kernel's own work at one row for small layers."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None or buffer.numel() < size:
            buffer = self._local.scratch = torch.empty(size, dtype=torch.uint8)
        return buffer

    @property
    def name(self) -> str:
        return ISA_NAMES[self.isa]

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, n: int, bias: torch.Tensor | None, isa: int | None = None) -> torch.Tensor:
        """x (M, K) float32 contiguous, blocks from `pack`, bias (N,) float32 or None -> (M, N) float32."""
        m, k = x.shape
        out = torch.empty(m, n, dtype=torch.float32)  # (M, N)
        if self.prompt_usable and m >= PROMPT_ROWS and getattr(_prompt, "on", False) and isa is None:
            scratch = self._scratch(self._prompt_scratch(m, k))
            self._prompt(x.data_ptr(), m, k, blocks.data_ptr(), n, 0 if bias is None else bias.data_ptr(),
                         out.data_ptr(), scratch.data_ptr())
            return out
        scratch = self._scratch(scratch_bytes(m, k))
        self._linear(x.data_ptr(), m, k, blocks.data_ptr(), n, 0 if bias is None else bias.data_ptr(),
                     out.data_ptr(), scratch.data_ptr(), self.isa if isa is None else isa)
        return out


PROMPT_ROWS = 16
"""Fewest rows for which a prompt's pass takes the bf16 tiles. Each weight tile is de-quantized once
per call: over the 1.5B's linears that repays itself from about 32 rows and costs about 40 ms more
at 16. It is taken from 16 for fidelity: next-token log-probabilities over a 500-token prompt were
within a mean KL of 0.0004 of the float32-activation int4 model on this path, against 0.033 with
int8 rows, whose per-row scale flattens the first position's huge activations (KL 9.9 there)."""

_prompt = threading.local()


@contextlib.contextmanager
def prompt_pass():
    """Inside, w4a8 layers compute a pass of at least PROMPT_ROWS rows in bf16 on the tile unit
    (CPUs with AMX-BF16): the pass that fills the cache with a prompt, where every weight serves
    hundreds of rows. Decode and verify passes run outside it, so their rows keep the decode
    path's numbers whatever their width; plain and speculative decoding fill the cache the same way."""
    before = getattr(_prompt, "on", False)
    _prompt.on = True
    try:
        yield
    finally:
        _prompt.on = before


def silu_mul(kernel: Kernel, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for float32 (..., I) tensors whose last dimension is contiguous (the two
    halves of a fused gate/up call, read where they lie). Compiled with AVX-512, torch's ops on
    AVX2-only CPUs: one function per machine, so a row's result does not depend on the pass."""
    if kernel.isa < 2:
        return silu_mul_reference(gate, up)
    g, u = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])  # (M, I) views
    out = torch.empty(g.shape, dtype=torch.float32)  # (M, I)
    kernel._silu_mul(g.data_ptr(), u.data_ptr(), g.shape[0], g.shape[1], g.stride(0), u.stride(0), out.data_ptr())
    return out.reshape(gate.shape)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def scratch_bytes(m: int, k: int) -> int:
    """Quantized rows (64-byte aligned), then per-row group sums and scales (float32)."""
    return -(-m * k // 64) * 64 + 4 * m * (k // GROUP + 1)


def pack(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The int4 format (packed uint8 (N, K/2), scales and mins (N, K/32)) -> the kernel's blocks,
    uint8 (ceil(N/16) * K/32 * 320,)."""
    codes = unpack_int4(packed)  # (N, K)
    n, k = codes.shape
    groups = k // GROUP
    pad = -n % TILE
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))  # (Np, K)
    scales16 = torch.nn.functional.pad(scales.to(torch.float16), (0, 0, 0, pad))  # (Np, G)
    mins16 = torch.nn.functional.pad(mins.to(torch.float16), (0, 0, 0, pad))
    tiles = codes.shape[0] // TILE
    c = codes.reshape(tiles, TILE, groups, 2, 4, 4)  # (tile, n, g, half, p, t): input = 16 half + 4p + t
    c = c.permute(0, 2, 4, 1, 5, 3)  # (tile, g, p, n, t, half)
    vectors = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, groups, 256)  # low nibble: first half
    s = scales16.reshape(tiles, TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)  # (tile, g, 32)
    mn = mins16.reshape(tiles, TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)
    return torch.cat((vectors, s, mn), dim=-1).reshape(-1).contiguous()  # (tiles * G * 320,)


def unpack(blocks: torch.Tensor, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's blocks -> the int4 format they hold: packed uint8 (N, K/2), and the fp16 scales
    and mins (N, K/32) the kernel multiplies by (`pack` rounded them to fp16)."""
    groups = in_features // GROUP
    tiles = -(-out_features // TILE)
    b = blocks.reshape(tiles, groups, BLOCK_BYTES)  # (tile, g, 320)
    vectors = b[..., :256].reshape(tiles, groups, 4, TILE, 4)  # (tile, g, p, n, t)
    c = torch.stack((vectors & 0x0F, vectors >> 4), dim=-1)  # (tile, g, p, n, t, half): input = 16 half + 4p + t
    codes = c.permute(0, 3, 1, 5, 2, 4).reshape(tiles * TILE, in_features)[:out_features]  # (N, K)
    steps = b[..., 256:].contiguous().view(torch.float16).reshape(tiles, groups, 2, TILE)  # (tile, g, scale|min, n)
    scales16, mins16 = steps.permute(2, 0, 3, 1).reshape(2, tiles * TILE, groups)[:, :out_features]  # (N, G) each
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scales16, mins16


def w4a8_linear_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The plain torch meaning of the kernel: exact integer sums per group, in float64 after."""
    rows = x.reshape(-1, x.shape[-1]).float()
    a, row_scales = quantize_rows(rows)  # (M, K) integer-valued, (M, 1)
    m, k = a.shape
    codes = unpack_int4(packed).to(torch.int64).reshape(-1, k // GROUP, GROUP)  # (N, G, 32)
    a = a.to(torch.int64).reshape(m, k // GROUP, GROUP)  # (M, G, 32)
    sums = torch.einsum("mgk,ngk->mng", a, codes).double()  # (M, N, G) exact
    group_sums = a.sum(-1).double()  # (M, G)
    s = scales.to(torch.float16).double()  # (N, G)
    mn = mins.to(torch.float16).double()
    y = (sums * s).sum(-1) + group_sums @ mn.t()  # (M, N)
    y = y * row_scales.double()
    if bias is not None:
        y = y + bias.double()
    return y.float().reshape(*x.shape[:-1], -1)


def w4a8_prompt_reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The plain torch meaning of the prompt path: weights de-quantized in float32 and rounded to
    bf16, rows rounded to bf16, their products summed in float64 (the kernel sums in float32)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).double()  # (M, K)
    n, k = packed.shape[0], packed.shape[1] * 2
    codes = unpack_int4(packed).float().reshape(n, k // GROUP, GROUP)  # (N, G, 32)
    weight = codes * scales.to(torch.float16).float()[..., None] + mins.to(torch.float16).float()[..., None]
    y = rows @ weight.reshape(n, k).to(torch.bfloat16).double().t()  # (M, N)
    if bias is not None:
        y = y + bias.double()
    return y.float().reshape(*x.shape[:-1], n)


class W4A8Linear(torch.nn.Module):
    """nn.Linear run by the kernel: int4 weights (the kernel's blocks) x per-row int8 activations,
    float32 in and out. Members of a `SharedInput` take their columns of one call for all of them."""

    def __init__(self, in_features: int, out_features: int, blocks: torch.Tensor, bias: torch.Tensor | None,
                 kernel: Kernel, shared: "SharedInput | None" = None, start: int = 0) -> None:
        super().__init__()
        if in_features % GROUP or (shared is not None and out_features % TILE):
            raise ValueError(f"in_features={in_features} must be a multiple of {GROUP} (and a shared layer's "
                             f"out_features={out_features} of {TILE})")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("blocks", blocks)  # (tiles * G * 320,) uint8, often memory-mapped
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.kernel = kernel
        self.shared, self.start = shared, start

    def dense_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight the kernel multiplies by, read back from its blocks."""
        return dequantize_int4(*unpack(self.blocks, self.out_features, self.in_features), GROUP)

    def extra_repr(self) -> str:
        fused = f", shares its input from column {self.start}" if self.shared is not None else ""
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel.name}{fused}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out) float32
        if self.shared is not None:
            out = self.shared.columns(x, self.start, self.out_features)  # (M, out)
        else:
            rows = x.reshape(-1, self.in_features).float().contiguous()  # (M, in)
            out = self.kernel.linear(rows, self.blocks, self.out_features, self.bias)  # (M, out)
        return out.reshape(*x.shape[:-1], self.out_features)


class SharedInput:
    """Linears that read the same input (a layer's q/k/v projections, its gate/up projections) as
    one kernel call: the input is quantized once, the call is wider (better split between the
    cores) and a pass makes ~200 fewer calls. The first member called with an input computes every
    member's output; the others, called with that same tensor, take their columns. Each output
    column is computed exactly as in a call of its own, so fusing changes no number; a member
    called with another input simply computes the whole call again."""

    def __init__(self, blocks: torch.Tensor, out_features: int, bias: torch.Tensor | None, kernel: Kernel, members: int) -> None:
        self.blocks, self.out_features, self.bias, self.kernel, self.members = blocks, out_features, bias, kernel, members
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None  # (M, all members' out_features)
        self._served = 0

    def columns(self, x: torch.Tensor, start: int, width: int) -> torch.Tensor:
        if x is not self._input:
            rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # (M, in)
            self._input, self._served = x, 0
            self._output = self.kernel.linear(rows, self.blocks, self.out_features, self.bias)
        out = self._output[:, start : start + width]  # (M, width), a view: copying the columns out measured ~3 ms of a 16-token pass
        self._served += 1
        if self._served == self.members:  # everyone has theirs: hold no tensors between passes
            self._input = self._output = None
        return out


class GatedMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)) on w4a8 linears, the same submodules as the model's MLP: SiLU and
    the product run in one pass over the fused gate/up output, where torch's two ops read its
    strided halves (one 512 x 8960 product: 1.7 against 4.2 ms; a 512-token prefill of the 1.5B:
    1.62 against 1.96 s)."""

    def __init__(self, gate_proj: W4A8Linear, up_proj: W4A8Linear, down_proj: W4A8Linear) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., hidden) -> (..., hidden) float32
        return self.down_proj(silu_mul(self.gate_proj.kernel, self.gate_proj(x), self.up_proj(x)))


def fuse(sources: list[torch.nn.Module], kernel: Kernel, blocks: torch.Tensor | None = None) -> list[W4A8Linear]:
    """Int4Linears that read the same input -> W4A8Linears sharing one kernel call. `blocks`: the
    members' blocks one after the other (what `fused_blocks` makes, or read back from disk); each
    member's own blocks are a view into it, so the tile-major layout makes the concatenation the
    blocks of the stacked weight."""
    if blocks is None:
        blocks = fused_blocks(sources)
    biases = [s.bias for s in sources]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.float() if b is not None else torch.zeros(s.out_features) for b, s in zip(biases, sources)])
    shared = SharedInput(blocks, sum(s.out_features for s in sources), bias, kernel, len(sources))
    layers, start, offset = [], 0, 0
    for source in sources:
        size = block_bytes(source.out_features, source.in_features)
        layers.append(W4A8Linear(source.in_features, source.out_features, blocks[offset : offset + size], source.bias,
                                 kernel, shared if len(sources) > 1 else None, start))
        start, offset = start + source.out_features, offset + size
    return layers


def fused_blocks(sources: list[torch.nn.Module]) -> torch.Tensor:
    return torch.cat([pack(s.packed, s.scales, s.mins) for s in sources])


def block_bytes(out_features: int, in_features: int) -> int:
    return -(-out_features // TILE) * (in_features // GROUP) * BLOCK_BYTES
