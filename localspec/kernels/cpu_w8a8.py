"""int8 weights x int8 activations on the CPU (oneDNN with AVX-512 VNNI / AMX).

Why: a verify pass checks several tokens at once. With 16-bit activations every extra row costs
its own multiply-adds, so on a 2-core CPU a 16-token pass of a 1.5B model costs 2-5x a one-token
pass and speculation barely pays. VNNI multiplies int8 four times as fast as fp32, which makes a
16-row matmul cost about what reading the weights costs: verify passes become nearly flat.

Exactness: each row is quantized with its own scale (absmax / 127), and the products are summed
in int32, which is exact. A row's output therefore does not depend on which other rows share the
pass, so a verify pass computes bit for bit what one-token decoding computes, and speculation
reproduces this model's greedy output exactly. (Quantizing activations does change the model
against 16-bit activations; `localspec bench --quant w8a8,int4` shows by how much.)

The weights are the per-channel int8 weights of `cpu_int8` (same cache). oneDNN wants them in its
own blocked layout, made once per load (5-7 s for a 1.5B model; oneDNN's packed tensors cannot be
saved) on a background thread; until a layer's packed weight is ready it runs through
torch._int_mm, which needs no packing but measured 20-40% slower for 2-16 rows.
"""

from __future__ import annotations

import atexit
import functools
import threading

import torch

from localspec.kernels.cpu_int8 import Int8Linear, dequantize_per_channel

ZERO_POINT = 128
"""oneDNN multiplies unsigned by signed bytes: activations go in as q + 128."""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) float -> (M, K) float32 holding integers in [-127, 127], and (M, 1) row scales."""
    x = x.float()
    scales = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # (M, 1)
    return torch.round(x / scales).clamp_(-127, 127), scales


def w8a8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain torch meaning of W8A8Linear: integer products summed exactly, then scaled."""
    rows = x.reshape(-1, x.shape[-1])
    q, row_scales = quantize_rows(rows)
    acc = q.to(torch.int64) @ qweight.to(torch.int64).t()  # (M, N) exact
    out = acc.float() * scales.float() * row_scales  # same rounding steps as the kernel
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], -1)


@functools.cache
def w8a8_supported() -> bool:
    """oneDNN's int8 linear exists in this torch build and sums exactly on this CPU (without VNNI
    some paths saturate 16-bit partial sums); probed once with worst-case values."""
    try:
        prepack = torch.ops.onednn.qlinear_prepack
        torch.ops.onednn.qlinear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randint(-127, 128, (32, 64), generator=gen, dtype=torch.int8)
        weight[0] = 127
        weight[1] = -127
        x = torch.randint(-127, 128, (3, 64), generator=gen).float()
        x[:, 0] = 127.0  # every row's scale is then exactly 1
        x[0, 1:] = 127.0
        x[1, 1:] = -127.0
        scales = torch.ones(32)
        q = quantize_rows(x)[0]
        want = (x.to(torch.int64) @ weight.to(torch.int64).t()).float()
        packed = _matmul(q, prepack(weight, [1, 64]), scales)
        return torch.equal(packed, want) and torch.equal(_matmul_unpacked(q, weight, scales), want)
    except RuntimeError:
        return False


def _matmul(q: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(M, K) integer-valued float x prepacked (N, K) int8 -> (M, N) float32 = int32 sum * scales[n]."""
    zero_points = torch.zeros(scales.shape[0], dtype=torch.long)
    shifted = q.add(ZERO_POINT).to(torch.uint8)  # (M, K): oneDNN multiplies unsigned by signed bytes
    return torch.ops.onednn.qlinear_pointwise(
        shifted, 1.0, ZERO_POINT, packed, scales, zero_points, None, 1.0, 0, torch.float32, "none", [], "")


def _matmul_unpacked(q: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same product through torch._int_mm, while the packed weight is not ready yet."""
    return torch._int_mm(q.to(torch.int8), qweight.t()).float() * scales  # (M, N)


class W8A8Linear(torch.nn.Module):
    """nn.Linear run as int8 x int8 with per-row activation scales; holds an Int8Linear's weights."""

    def __init__(self, source: Int8Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.register_buffer("qweight", source.qweight)  # (out, in) int8, as cached
        self.register_buffer("scales", source.scales)  # (out,)
        self.bias = source.bias
        self._scales32 = source.scales.float()  # (out,) what the kernel multiplies by
        self._packed: torch.Tensor | None = None  # oneDNN's layout, set by `start_packing`'s thread
        self._packing: threading.Thread | None = None

    def pack(self) -> None:
        self._packed = torch.ops.onednn.qlinear_prepack(self.qweight, [1, self.in_features])

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}"

    def dense_weight(self) -> torch.Tensor:
        return dequantize_per_channel(self.qweight, self.scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        q, row_scales = quantize_rows(x.reshape(-1, x.shape[-1]))  # (M, in), (M, 1)
        packed = self._packed
        if packed is not None:
            out = _matmul(q, packed, self._scales32) * row_scales  # (M, out) float32
        else:  # the same exact sums, so the output does not change when packing lands
            out = _matmul_unpacked(q, self.qweight, self._scales32) * row_scales
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])


def start_packing(model: torch.nn.Module) -> None:
    """Pack the model's W8A8 weights on a background thread: the model is usable at once (the
    unpacked path computes the same numbers), and the 5-7 s of packing a 1.5B model overlaps
    whatever the caller loads next. A process that exits early stops it between layers."""
    layers = [m for m in model.modules() if isinstance(m, W8A8Linear) and m._packed is None]
    if not layers:
        return
    stop = threading.Event()

    def run() -> None:
        for layer in layers:
            if stop.is_set():
                return
            layer.pack()

    thread = threading.Thread(target=run, name="localspec-w8a8-packing", daemon=True)
    for layer in layers:
        layer._packing = thread
    thread.start()
    atexit.register(lambda: (stop.set(), thread.join()))


def wait_for_packing(model: torch.nn.Module) -> None:
    """Block until the model's W8A8 weights are packed (timings must see the steady state)."""
    for m in model.modules():
        if isinstance(m, W8A8Linear) and m._packing is not None:
            m._packing.join()
