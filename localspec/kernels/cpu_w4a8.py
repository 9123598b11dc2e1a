"""4-, 6- or 8-bit weights x 8-bit activations on x86 CPUs, made for the 1-16 rows of speculative decoding.

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
The same library runs two more block formats, each with a scale and min per 16 inputs: 6-bit codes
(8 bits per weight), which GGUF's Q5_0, Q5_1, Q5_K and Q6_K tensors load into without
re-quantizing, unpacked to bytes in registers (on the vector units only); and 8-bit codes (10 bits
per weight) for Q8_0 (TDPBSUD on the tile unit: signed activations, unsigned codes). Before the
6-bit format the 1.5B's Q6_K tensors (a quarter of its weights) read as 8-bit blocks, which cost
its one-token pass about a fifth more bytes.

Arithmetic, for a row x of the pass and an output feature n. Activations: one scale per group G of
32 inputs of the row; weights: one scale and min per block b of 32 inputs (4-bit codes) or 16
inputs (8-bit codes), each block inside one group G(b):
    x[k] ~ s[G] * a[k]       a = round(x / s[G]) in [-127, 127], s[G] = absmax(x over G) / 127
                             (at least 1e-12 / 127: an all-zero group quantizes to zeros)
    w[n, k] = c[n, k] * scale[n, b] + min[n, b]     c in 0..15 (the int4 format of int4_format.py),
                                                     0..63 or 0..255; scale and min rounded to fp16
    y[n] = sum_b (scale[n, b] s[G(b)] * sum_k c a + min[n, b] * s[G(b)] sum_k a) + bias[n]
A row's large values flatten only the 31 others of their group, not the whole row. The integer sums
are exact; each block adds its two float32 multiply-adds to the output in block order, with
scale * s rounded once and s * sum_k a once (the quantizer stores both per row and block), so a
row's result does not depend on the other rows of the pass (greedy identity between decoding and
verification holds by construction), nor on how the work is split between threads, nor on the
instruction set: AVX2, VNNI and AMX give the same bits.

Layout: outputs in tiles of 16 (the last one padded with zeros), each tile a run of one block per
32 inputs (4-bit) or 16 inputs (6- and 8-bit): the codes in 64-byte vectors, then 16 fp16 scales,
then 16 fp16 mins, for the tile's outputs n in order (320 bytes; 256 for 6-bit codes). 4-bit
(`pack`): byte 4n + t of vector p (0..3) holds the code of input 4p + t in its low nibble and of
input 16 + 4p + t in its high nibble; `unpack` reads the int4 format back out of them. 8-bit
(`pack_bytes`): byte 4n + t of vector p (0..3) is the code of input 4p + t. 6-bit (`pack_six`):
byte 4n + t of vector v (0, 1) holds the low four bits of the codes of inputs 4v + t (low nibble)
and 8 + 4v + t (high nibble), byte 4n + t of vector 2 the top two bits of the codes of inputs
4p + t at bits 2p, 2p + 1. `read_codes` reads any format's codes, scales and mins back.

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
from localspec.kernels.int4_format import unpack_int4

GROUP = 32
"""Inputs per block of 4-bit codes, and per activation scale of a row (every format)."""
BYTE_GROUP = 16
"""Inputs per block of 6- and 8-bit codes: 16 outputs x 16 byte codes fill the same 256 bytes."""
TILE = 16
FORMATS = (4, 6, 8)
"""The code widths the kernel's blocks hold."""
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
        self._linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
        self.prompt_usable = bool(library.w4a8_prompt_usable())
        self._prompt = library.w4a8_prompt
        self._prompt.restype = None
        self._prompt.argtypes = [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
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

    def linear(self, x: torch.Tensor, blocks: torch.Tensor, n: int, bias: torch.Tensor | None, isa: int | None = None,
               bits: int = 4) -> torch.Tensor:
        """x (M, K) float32 contiguous, blocks of `bits`-bit codes (`pack`: 4, `pack_six`: 6,
        `pack_bytes`: 8), bias (N,) float32 or None -> (M, N) float32. isa: force one path
        (ISA_NAMES), never the prompt path."""
        m, k = x.shape
        block_inputs(bits)  # a format the library knows, or ValueError before any pointer is read
        out = torch.empty(m, n, dtype=torch.float32)  # (M, N)
        if self.prompt_usable and m >= PROMPT_ROWS and getattr(_prompt, "on", False) and isa is None and bits != 6:
            scratch = self._scratch(self._prompt_scratch(m, k))
            self._prompt(x.data_ptr(), m, k, blocks.data_ptr(), n, 0 if bias is None else bias.data_ptr(),
                         out.data_ptr(), scratch.data_ptr(), bits)
            return out
        scratch = self._scratch(scratch_bytes(m, k, bits))
        self._linear(x.data_ptr(), m, k, blocks.data_ptr(), n, 0 if bias is None else bias.data_ptr(),
                     out.data_ptr(), scratch.data_ptr(), self.isa if isa is None else isa, bits)
        return out


PROMPT_ROWS = 16
"""Fewest rows for which a prompt's pass takes the bf16 tiles. Each weight tile is de-quantized once
per call: over the 1.5B's linears that repays itself from about 32 rows and costs about 40 ms more
at 16. It is taken from 16 for fidelity: next-token log-probabilities over a 500-token prompt were
within a mean KL of 0.0004 of the float32-activation int4 model on this path, against 0.033 with
int8 rows under the one scale per row the decode path then had, which flattened the first
position's huge activations (KL 9.9 there; its scales are per 32 inputs now)."""

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


def block_inputs(bits: int) -> int:
    """Inputs per block in the format of `bits`-bit codes (4, 6 or 8)."""
    if bits not in FORMATS:
        raise ValueError(f"the w4a8 kernel's blocks hold 4-, 6- or 8-bit codes, not {bits}-bit")
    return GROUP if bits == 4 else BYTE_GROUP


def code_bytes(bits: int) -> int:
    """Bytes of codes in one block of the format (then 32 of scales and 32 of mins)."""
    return 192 if bits == 6 else 256


def format_block_bytes(bits: int) -> int:
    return code_bytes(bits) + 64


def scratch_bytes(m: int, k: int, bits: int = 4) -> int:
    """Quantized rows (64-byte aligned), then per row and block its activation scale and that
    scale times the block's activation sum (float32)."""
    return -(-m * k // 64) * 64 + 8 * m * (k // block_inputs(bits))


def pack(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The int4 format (packed uint8 (N, K/2), scales and mins (N, K/32)) -> the kernel's blocks,
    uint8 (ceil(N/16) * K/32 * 320,)."""
    codes = _pad_outputs(unpack_int4(packed))  # (Np, K)
    tiles, groups = codes.shape[0] // TILE, codes.shape[1] // GROUP
    c = codes.reshape(tiles, TILE, groups, 2, 4, 4)  # (tile, n, g, half, p, t): input = 16 half + 4p + t
    c = c.permute(0, 2, 4, 1, 5, 3)  # (tile, g, p, n, t, half)
    vectors = (c[..., 0] | (c[..., 1] << 4)).reshape(tiles, groups, 256)  # low nibble: first half
    return _with_steps(vectors, scales, mins)


def _check_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, what: str) -> None:
    n, k = codes.shape
    if codes.dtype != torch.uint8 or k % GROUP or scales.shape != (n, k // BYTE_GROUP) or mins.shape != scales.shape:
        raise ValueError(f"{what} takes uint8 codes (N, K) with K a multiple of {GROUP} and scales and mins "
                         f"(N, K/{BYTE_GROUP}), got {codes.dtype} {tuple(codes.shape)}, {tuple(scales.shape)}, {tuple(mins.shape)}")


def pack_six(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """6-bit codes (uint8 (N, K) in 0..63, K a multiple of 32) with scales and mins (N, K/16), w =
    code * scale + min -> the kernel's blocks, uint8 (ceil(N/16) * K/16 * 256,)."""
    _check_codes(codes, scales, mins, "pack_six")
    if codes.numel() and int(codes.max()) > 63:
        raise ValueError(f"pack_six takes codes in 0..63, got {int(codes.max())}")
    codes = _pad_outputs(codes)  # (Np, K)
    tiles, count = codes.shape[0] // TILE, codes.shape[1] // BYTE_GROUP
    c = codes.reshape(tiles, TILE, count, 4, 4).permute(0, 2, 3, 1, 4)  # (tile, j, p, n, t): input = 16j + 4p + t
    low, high = c & 0x0F, c >> 4
    nibbles = low[:, :, :2] | (low[:, :, 2:] << 4)  # (tile, j, v, n, t): inputs 4v + t and 8 + 4v + t
    pairs = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # (tile, j, n, t)
    vectors = torch.cat((nibbles.reshape(tiles, count, 128), pairs.reshape(tiles, count, 64)), dim=-1)
    return _with_steps(vectors, scales, mins)


def unpack_six(blocks: torch.Tensor, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's blocks of 6-bit codes -> codes uint8 (N, K) and the fp16 scales and mins (N, K/16)."""
    count = in_features // BYTE_GROUP
    tiles = -(-out_features // TILE)
    b = blocks.reshape(tiles, count, format_block_bytes(6))  # (tile, j, 256)
    nibbles = b[..., :128].reshape(tiles, count, 2, TILE, 4)  # (tile, j, v, n, t)
    pairs = b[..., 128:192].reshape(tiles, count, 1, TILE, 4)  # (tile, j, 1, n, t)
    low = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2)  # (tile, j, p, n, t)
    high = (pairs >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None, None]) & 3  # (tile, j, p, n, t)
    codes = (low | (high << 4)).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, in_features)[:out_features]  # (N, K)
    return (codes, *_steps(b, out_features))


def unpack(blocks: torch.Tensor, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's blocks -> the int4 format they hold: packed uint8 (N, K/2), and the fp16 scales
    and mins (N, K/32) the kernel multiplies by (`pack` rounded them to fp16)."""
    groups = in_features // GROUP
    tiles = -(-out_features // TILE)
    b = blocks.reshape(tiles, groups, format_block_bytes(4))  # (tile, g, 320)
    vectors = b[..., :256].reshape(tiles, groups, 4, TILE, 4)  # (tile, g, p, n, t)
    c = torch.stack((vectors & 0x0F, vectors >> 4), dim=-1)  # (tile, g, p, n, t, half): input = 16 half + 4p + t
    codes = c.permute(0, 3, 1, 5, 2, 4).reshape(tiles * TILE, in_features)[:out_features]  # (N, K)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4), *_steps(b, out_features))


def pack_bytes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """8-bit codes (uint8 (N, K), K a multiple of 32) with scales and mins (N, K/16), w = code *
    scale + min -> the kernel's blocks, uint8 (ceil(N/16) * K/16 * 320,)."""
    n, k = codes.shape
    _check_codes(codes, scales, mins, "pack_bytes")
    codes = _pad_outputs(codes)  # (Np, K)
    tiles, count = codes.shape[0] // TILE, k // BYTE_GROUP
    c = codes.reshape(tiles, TILE, count, 4, 4).permute(0, 2, 3, 1, 4)  # (tile, j, p, n, t): input = 16j + 4p + t
    return _with_steps(c.reshape(tiles, count, 256), scales, mins)


def unpack_bytes(blocks: torch.Tensor, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's blocks of 8-bit codes -> codes uint8 (N, K) and the fp16 scales and mins (N, K/16)
    the kernel multiplies by."""
    count = in_features // BYTE_GROUP
    tiles = -(-out_features // TILE)
    b = blocks.reshape(tiles, count, format_block_bytes(8))  # (tile, j, 320)
    vectors = b[..., :256].reshape(tiles, count, 4, TILE, 4)  # (tile, j, p, n, t): input = 16j + 4p + t
    codes = vectors.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, in_features)[:out_features]  # (N, K)
    return (codes, *_steps(b, out_features))


def _pad_outputs(codes: torch.Tensor) -> torch.Tensor:  # (N, K) -> (N rounded up to TILE, K), zeros below
    return torch.nn.functional.pad(codes, (0, 0, 0, -codes.shape[0] % TILE))


def _with_steps(vectors: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Code vectors (tile, block, code bytes) and scales, mins (N, blocks) -> the flat blocks: each
    block's codes, then its 16 scales and 16 mins as fp16 (zero for padded outputs)."""
    tiles, count = vectors.shape[:2]
    pad = tiles * TILE - scales.shape[0]

    def fp16_bytes(steps: torch.Tensor) -> torch.Tensor:  # (N, blocks) -> (tile, block, 32)
        steps = torch.nn.functional.pad(steps.to(torch.float16), (0, 0, 0, pad))  # (Np, blocks)
        return steps.reshape(tiles, TILE, count).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat((vectors, fp16_bytes(scales), fp16_bytes(mins)), dim=-1).reshape(-1).contiguous()  # (tiles * blocks * bytes,)


def _steps(blocks: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (tile, block, bytes) -> their fp16 scales and mins (the last 64 bytes), (N, blocks) each."""
    tiles, count = blocks.shape[:2]
    steps = blocks[..., -64:].contiguous().view(torch.float16).reshape(tiles, count, 2, TILE)  # (tile, j, scale|min, n)
    scales16, mins16 = steps.permute(2, 0, 3, 1).reshape(2, tiles * TILE, count)[:, :out_features]  # (N, blocks) each
    return scales16, mins16


def read_codes(blocks: torch.Tensor, out_features: int, in_features: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Any format's blocks -> codes uint8 (N, K) and fp16 scales and mins (N, K / block_inputs(bits))."""
    if bits == 4:
        packed, scales16, mins16 = unpack(blocks, out_features, in_features)
        return unpack_int4(packed), scales16, mins16
    return (unpack_six if bits == 6 else unpack_bytes)(blocks, out_features, in_features)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """codes (N, K) with a scale and min per block of K / blocks inputs ((N, blocks) each) -> the
    float32 weight code * scale + min (N, K)."""
    n, k = codes.shape
    blocks = codes.float().reshape(n, scales.shape[1], -1)  # (N, blocks, 32 or 16)
    return (blocks * scales.float()[..., None] + mins.float()[..., None]).reshape(n, k)


def quantize_groups(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (M, K) float32 holding integers in [-127, 127], and (M, K/32) scales, one per
    group of 32 inputs of a row (absmax / 127, at least 1e-12 / 127), in the kernel's float32 steps."""
    m, k = rows.shape
    groups = rows.float().reshape(m, k // GROUP, GROUP)  # (M, G, 32)
    scales = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0  # (M, G, 1)
    return torch.round(groups / scales).clamp_(-127, 127).reshape(m, k), scales.squeeze(-1)


def w4a8_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The plain torch meaning of the kernel: exact integer sums per block, in float64 after. codes
    (N, K) in 0..15, 0..63 or 0..255 with scales and mins (N, blocks): blocks of 32 inputs (4-bit)
    or 16 (6- and 8-bit), read from the shapes."""
    rows = x.reshape(-1, x.shape[-1]).float()
    a, group_scales = quantize_groups(rows)  # (M, K) integer-valued, (M, K/32)
    m, k = a.shape
    n, count = scales.shape
    size = k // count  # inputs per block
    c = codes.to(torch.int64).reshape(n, count, size)  # (N, B, size)
    a = a.to(torch.int64).reshape(m, count, size)  # (M, B, size)
    sums = torch.einsum("mbk,nbk->mnb", a, c).double()  # (M, N, B) exact
    s = group_scales.double().repeat_interleave(GROUP // size, dim=1)  # (M, B): each block's group scale
    weighted_sums = a.sum(-1).double() * s  # (M, B)
    y = (sums * s[:, None, :] * scales.to(torch.float16).double()).sum(-1) + weighted_sums @ mins.to(torch.float16).double().t()  # (M, N)
    if bias is not None:
        y = y + bias.double()
    return y.float().reshape(*x.shape[:-1], -1)


def w4a8_prompt_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """The plain torch meaning of the prompt path (codes, scales, mins as for w4a8_linear_reference):
    weights de-quantized in float32 and rounded to bf16, rows rounded to bf16, their products summed
    in float64 (the kernel sums in float32)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).double()  # (M, K)
    weight = dequantize(codes, scales.to(torch.float16), mins.to(torch.float16))  # (N, K)
    y = rows @ weight.to(torch.bfloat16).double().t()  # (M, N)
    if bias is not None:
        y = y + bias.double()
    return y.float().reshape(*x.shape[:-1], -1)


class W4A8Linear(torch.nn.Module):
    """nn.Linear run by the kernel: 4-, 6- or 8-bit weights (the kernel's blocks of `bits`-bit codes) x
    int8 activations (a scale per 32 inputs of a row), float32 in and out. Members of a
    `SharedInput` take their columns of one call for all of them."""

    def __init__(self, in_features: int, out_features: int, blocks: torch.Tensor, bias: torch.Tensor | None,
                 kernel: Kernel, shared: "SharedInput | None" = None, start: int = 0, bits: int = 4) -> None:
        super().__init__()
        block_inputs(bits)
        if shared is not None and shared.bits != bits:
            raise ValueError(f"a {bits}-bit layer cannot share a call of {shared.bits}-bit blocks")
        if in_features % GROUP or (shared is not None and out_features % TILE):
            raise ValueError(f"in_features={in_features} must be a multiple of {GROUP} (and a shared layer's "
                             f"out_features={out_features} of {TILE})")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("blocks", blocks)  # (tiles * blocks * block bytes,) uint8, often memory-mapped
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        self.kernel = kernel
        self.shared, self.start, self.bits = shared, start, bits

    def dense_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight the kernel multiplies by, read back from its blocks."""
        return dequantize(*read_codes(self.blocks, self.out_features, self.in_features, self.bits))

    def extra_repr(self) -> str:
        fused = f", shares its input from column {self.start}" if self.shared is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, kernel={self.kernel.name}{fused}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out) float32
        if self.shared is not None:
            out = self.shared.columns(x, self.start, self.out_features)  # (M, out)
        else:
            rows = x.reshape(-1, self.in_features).float().contiguous()  # (M, in)
            out = self.kernel.linear(rows, self.blocks, self.out_features, self.bias, bits=self.bits)  # (M, out)
        return out.reshape(*x.shape[:-1], self.out_features)


class SharedInput:
    """Linears that read the same input (a layer's q/k/v projections, its gate/up projections) as
    one kernel call: the input is quantized once, the call is wider (better split between the
    cores) and a pass makes ~200 fewer calls. The first member called with an input computes every
    member's output; the others, called with that same tensor, take their columns. Each output
    column is computed exactly as in a call of its own, so fusing changes no number; a member
    called with another input simply computes the whole call again. All members hold blocks of one
    format (`bits`)."""

    def __init__(self, blocks: torch.Tensor, out_features: int, bias: torch.Tensor | None, kernel: Kernel, members: int,
                 bits: int = 4) -> None:
        self.blocks, self.out_features, self.bias, self.kernel, self.members = blocks, out_features, bias, kernel, members
        self.bits = bits
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None  # (M, all members' out_features)
        self._served = 0

    def columns(self, x: torch.Tensor, start: int, width: int) -> torch.Tensor:
        if x is not self._input:
            rows = x.reshape(-1, x.shape[-1]).float().contiguous()  # (M, in)
            self._input, self._served = x, 0
            self._output = self.kernel.linear(rows, self.blocks, self.out_features, self.bias, bits=self.bits)
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
    """Linears that read the same input -> W4A8Linears sharing one kernel call. A source is an
    Int4Linear (4-bit codes), or any module with in_features, out_features, bias and `bits` 6 or 8
    holding `codes`, `scales` and `mins` as `pack_six` / `pack_bytes` take them; all sources must have one
    format (ValueError otherwise). `blocks`: the members' blocks one after the other (what
    `fused_blocks` makes, or read back from disk); each member's own blocks are a view into it, so
    the tile-major layout makes the concatenation the blocks of the stacked weight."""
    formats = {source_bits(s) for s in sources}
    if len(formats) > 1:
        raise ValueError(f"linears sharing one call must hold one block format, got {sorted(formats)}-bit codes")
    (bits,) = formats
    if blocks is None:
        blocks = fused_blocks(sources)
    biases = [s.bias for s in sources]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.float() if b is not None else torch.zeros(s.out_features) for b, s in zip(biases, sources)])
    shared = SharedInput(blocks, sum(s.out_features for s in sources), bias, kernel, len(sources), bits)
    layers, start, offset = [], 0, 0
    for source in sources:
        size = block_bytes(source.out_features, source.in_features, bits)
        layers.append(W4A8Linear(source.in_features, source.out_features, blocks[offset : offset + size], source.bias,
                                 kernel, shared if len(sources) > 1 else None, start, bits))
        start, offset = start + source.out_features, offset + size
    return layers


def source_bits(source: torch.nn.Module) -> int:
    """The block format a source of `fuse` packs into: its `bits`, else 4 (an Int4Linear)."""
    return getattr(source, "bits", 4)


def fused_blocks(sources: list[torch.nn.Module]) -> torch.Tensor:
    return torch.cat([pack(s.packed, s.scales, s.mins) if source_bits(s) == 4 else pack_codes(s.codes, s.scales, s.mins, source_bits(s))
                      for s in sources])


def pack_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes uint8 (N, K) with scales and mins (N, K / block_inputs(bits)) -> blocks of any format."""
    if bits == 4:
        return pack(codes[:, 0::2] | (codes[:, 1::2] << 4), scales, mins)
    return (pack_six if bits == 6 else pack_bytes)(codes, scales, mins)


def block_bytes(out_features: int, in_features: int, bits: int = 4) -> int:
    return -(-out_features // TILE) * (in_features // block_inputs(bits)) * format_block_bytes(bits)
