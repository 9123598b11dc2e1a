"""A GGUF tensor's own numbers in the affine form the kernels compute with: w = code * scale + min.

Every linear format of llama.cpp below is affine per group of inputs, so its blocks are re-laid,
never re-quantized: the codes are the file's codes (shifted to be unsigned), the scales and mins
its own (`d * sc` and `-dmin * m` for the K formats, `-8d` / `-16d` / `-32 d sc` / `-128d` for
the symmetric ones):

    4-bit, groups of 32:  Q4_0, Q4_1, Q4_K
    6-bit, groups of 16:  Q5_0, Q5_1, Q5_K, Q6_K   (5- and 6-bit codes: never fewer bits)
    8-bit, groups of 16:  Q8_0

`decode(raw, qtype)` takes the tensor's bytes as stored, (N, bytes per row) for N outputs, and
returns `Affine`: float32 scales and mins; the kernels round them to fp16, which is the only
change from the file (a scale `d * sc` needs up to 17 significant bits, fp16 keeps 11: relative
2^-12 at most). Other types (F32/F16/BF16, the IQ and Q2/Q3 formats) return None: the caller
de-quantizes them with the gguf package's own de-quantizer. The layouts follow ggml's block
definitions; tests/test_gguf_loading.py checks every decoder against `gguf.quants.dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

QK_K = 256


@dataclass
class Affine:
    codes: torch.Tensor  # (N, K) uint8
    scales: torch.Tensor  # (N, K / group) float32
    mins: torch.Tensor  # (N, K / group) float32
    group: int
    bits: int

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 with scales and mins rounded to fp16, as the kernels compute."""
        n, k = self.codes.shape
        s = self.scales.to(torch.float16).float()[..., None]  # (N, G, 1)
        m = self.mins.to(torch.float16).float()[..., None]
        return (self.codes.float().reshape(n, k // self.group, self.group) * s + m).reshape(n, k)


FOUR_BIT = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
SIX_BIT = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)
EIGHT_BIT = (Q.Q8_0,)
_BITS = {**dict.fromkeys(FOUR_BIT, 4), **dict.fromkeys(SIX_BIT, 6), **dict.fromkeys(EIGHT_BIT, 8)}


def block_bits(qtype: Q) -> int | None:
    """The kernel block format a tensor type is laid into (4, 6 or 8), or None: not decoded here."""
    return _BITS.get(qtype)


def decode(raw: torch.Tensor, qtype: Q) -> Affine | None:
    """raw: (N, bytes per row) uint8 as the file stores the tensor -> its affine form, or None."""
    decoder = _DECODERS.get(qtype)
    if decoder is None:
        return None
    n = raw.shape[0]
    block_size, block_bytes = _SIZES[qtype]
    blocks = raw.reshape(n, -1, block_bytes)  # (N, B, bytes)
    codes, scales, mins = decoder(blocks)  # (N, B, block_size), (N, B, groups per block) x2
    group = block_size // scales.shape[-1]
    bits = block_bits(qtype)
    if bits != 4 and group != 16:  # one scale per 32: the 6- and 8-bit blocks take groups of 16
        scales, mins, group = scales.repeat_interleave(group // 16, -1), mins.repeat_interleave(group // 16, -1), 16
    return Affine(codes.reshape(n, -1), scales.reshape(n, -1), mins.reshape(n, -1), group, bits)


def _half(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (...) float32 of the little-endian fp16 they hold."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., L) bytes -> (..., 2L): the low nibbles, then the high ones (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """(..., 4) bytes of a little-endian uint32 -> (..., count) its low `count` bits, 0 or 1."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = ((qh[..., :, None] >> shifts) & 1).reshape(*qh.shape[:-1], 32)  # bit i of the word at i
    return bits[..., :count]


def _q4_0(b):  # d fp16, 16 bytes: w = d (q - 8)
    d = _half(b[..., 0:2])[..., None]
    return _nibbles(b[..., 2:18]), d, -8 * d


def _q4_1(b):  # d, m fp16, 16 bytes: w = d q + m
    return _nibbles(b[..., 4:20]), _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]


def _q5_0(b):  # d fp16, 32 high bits, 16 bytes: w = d (q - 16)
    d = _half(b[..., 0:2])[..., None]
    return _nibbles(b[..., 6:22]) | (_bits(b[..., 2:6], 32) << 4), d, -16 * d


def _q5_1(b):  # d, m fp16, 32 high bits, 16 bytes: w = d q + m
    return _nibbles(b[..., 8:24]) | (_bits(b[..., 4:8], 32) << 4), _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]


def _q8_0(b):  # d fp16, 32 int8: w = d q
    d = _half(b[..., 0:2])[..., None]
    return (b[..., 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8), d, -128 * d


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of 6-bit sub-block scales and mins of Q4_K / Q5_K -> (..., 8) each."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float(), mn.float()


def _q4_k(b):  # d, dmin fp16, 12 scale bytes, 128 bytes: sub-block j of 32: w = d sc_j q - dmin m_j
    d, dmin = _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)  # 4 chunks of 64 inputs: low nibbles, then high
    return _nibbles(qs).reshape(*b.shape[:-1], QK_K), d * sc, -(dmin * mn)


def _q5_k(b):  # as Q4_K, with a fifth bit per input from 32 bytes of high bits (bit j for sub-block j)
    d, dmin = _half(b[..., 0:2])[..., None], _half(b[..., 2:4])[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]  # (..., 32)
    low = _nibbles(b[..., 48:176].reshape(*b.shape[:-1], 4, 32)).reshape(*b.shape[:-1], 8, 32)
    high = (qh[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # (..., 8, 32)
    return (low | (high << 4)).reshape(*b.shape[:-1], QK_K), d * sc, -(dmin * mn)


def _q6_k(b):  # 128 low-nibble bytes, 64 high-bit bytes, 16 int8 scales, d fp16: w = d sc_j (q - 32), j per 16
    ql = b[..., 0:128].reshape(*b.shape[:-1], 2, 64)  # two halves of 128 inputs
    qh = b[..., 128:192].reshape(*b.shape[:-1], 2, 1, 32)
    scales = b[..., 192:208].view(torch.int8).float()  # (..., 16)
    d = _half(b[..., 208:210])[..., None]
    low = _nibbles(ql).reshape(*b.shape[:-1], 2, 4, 32)  # (half, quarter, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3  # (half, quarter, 32)
    scale = d * scales
    return (low | (high << 4)).reshape(*b.shape[:-1], QK_K), scale, -32 * scale


_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
             Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}
_SIZES = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q5_1: (32, 24), Q.Q8_0: (32, 34),
          Q.Q4_K: (QK_K, 144), Q.Q5_K: (QK_K, 176), Q.Q6_K: (QK_K, 210)}
