"""Weight quantization of a loaded model: which layers, which format, on which device.

- int4: group-wise 4-bit weights (`localspec_kernels.int4_format`), run by torch's packed int4
  matmul on the CPU and by the Triton small-M kernel on CUDA.
- int8: per-channel 8-bit weights; torch's int8 weight-only matmul on the CPU, bitsandbytes on CUDA.
- w8a8: the int8 weights (same cache) with each activation row quantized to int8 too, run by
  oneDNN's VNNI int8 matmul on x86 CPUs: a 16-token verify pass then costs about 2x a one-token
  pass instead of 5x, and the rest of the model runs in float32 (`localspec_kernels.cpu_w8a8`).
- nf4: bitsandbytes' NF4 (CUDA only).
Otherwise activations stay 16-bit (bf16): the weight-only CPU kernels are only fast with them.

Every nn.Linear whose width fits the format is quantized, the output layer included (for a 1.5B
model with 151k tokens it is 15% of the weights); the token embedding is a lookup and stays
16-bit. Exactness is relative to the target as loaded: speculative decoding reproduces the
quantized model's own output, and `localspec bench --quant` shows what quantizing costs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from localspec.errors import LocalspecError
from localspec_kernels.cpu_int8 import Int8Linear, int8_shape_ok, int8_supported
from localspec_kernels.cpu_w8a8 import W8A8Linear, start_packing, w8a8_supported
from localspec_kernels.int4_linear import GROUP_SIZE, Int4Linear, cpu_int4_supported, int4_shape_ok

COMPUTE_DTYPE = torch.bfloat16
"""Activation dtype of the weight-only quantized models."""


def stored_format(quant: str) -> str:
    """The cached weight format behind `quant` (w8a8 runs the int8 weights)."""
    return "int8" if quant == "w8a8" else quant


def compute_dtype(quant: str) -> torch.dtype:
    return torch.float32 if quant == "w8a8" else COMPUTE_DTYPE


def check_supported(quant: str, device: torch.device) -> None:
    """A one-line error for a format this machine cannot run."""
    if quant == "none":
        return
    if quant == "nf4" and device.type != "cuda":
        raise LocalspecError("--quant nf4 needs bitsandbytes on a CUDA GPU; on this machine use --quant int4")
    if device.type == "cuda" and quant in ("nf4", "int8"):
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise LocalspecError(f"--quant {quant} on CUDA needs bitsandbytes: pip install 'localspec[cuda]'") from None
    if device.type == "cpu":
        if quant == "int4" and not cpu_int4_supported():
            raise LocalspecError("this torch build has no int4 weight-only matmul; use --quant int8 or none")
        if quant == "int8" and not int8_supported():
            raise LocalspecError("this torch build has no int8 weight-only matmul; use --quant none")
        if quant == "w8a8" and not w8a8_supported():
            raise LocalspecError("--quant w8a8 needs oneDNN's int8 matmul with exact sums (an x86 CPU with "
                                 "AVX-512 VNNI or AMX); use --quant int8 or int4")
    if quant == "w8a8" and device.type != "cpu":
        raise LocalspecError(f"--quant w8a8 is a CPU format; on {device.type} use --quant int4")
    if device.type == "mps" and quant != "int4":
        raise LocalspecError(f"--quant {quant} is not available on MPS; use --quant int4 or none")


def quantize_model(model: torch.nn.Module, quant: str, device: torch.device) -> dict[str, str]:
    """Quantize the linears of `model` in place (on the CPU for int4/int8, which the cache stores;
    on the GPU for bitsandbytes); returns {module name: format} of what was replaced."""
    replaced: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        if quant == "int4" and int4_shape_ok(module):
            new = Int4Linear.from_linear(module, GROUP_SIZE, COMPUTE_DTYPE)
        elif quant in ("int8", "w8a8") and device.type != "cuda" and int8_shape_ok(module):
            new = Int8Linear.from_linear(module, COMPUTE_DTYPE)
        elif quant in ("int8", "nf4") and device.type == "cuda":
            new = _bitsandbytes_linear(module, quant)
        else:
            continue  # an odd width stays 16-bit
        _replace(model, name, new)
        replaced[name] = stored_format(quant)
    if not replaced:
        raise LocalspecError(f"no layer of this model fits the {quant} format")
    return replaced


def install_shells(model: torch.nn.Module, layout: dict[str, str]) -> None:
    """Swap the named linears for quantized modules without memory (meta device), so a quantized
    state dict loads into a freshly built model by adopting its tensors."""
    for name, quant in layout.items():
        linear = model.get_submodule(name)
        shape = (linear.in_features, linear.out_features, linear.bias is not None)
        if quant == "int4":
            _replace(model, name, Int4Linear(*shape, GROUP_SIZE, COMPUTE_DTYPE, device="meta"))
        elif quant == "int8":
            _replace(model, name, Int8Linear(*shape, COMPUTE_DTYPE, device="meta"))
        else:
            raise LocalspecError(f"a cached model names an unknown format {quant!r} for {name}")


def prepare_for_cpu(model: torch.nn.Module, layout_file: Path) -> None:
    """Give the quantized modules what the CPU kernels need: aligned int8 weights, and torch's own
    int4 layout, read from `layout_file` (written beside the cache the first time, ~10 s for 1.5B)."""
    int4 = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.align()
    if not int4 or not cpu_int4_supported():
        return
    if layout_file.is_file():
        # torch's own format: every tensor starts 64-byte aligned; read eagerly, since every byte is
        # used at once (faulting a memory map in page by page measured 4x slower)
        stored = torch.load(layout_file, weights_only=True)
        for name, m in int4.items():
            m.adopt_cpu_layout({part: stored[f"{name}.{part}"] for part in ("weight", "scale_zeros")})
        return
    tensors = {f"{name}.{part}": t for name, m in int4.items() for part, t in m.cpu_layout(COMPUTE_DTYPE).items()}
    partial = layout_file.with_name(layout_file.name + ".partial")
    try:
        torch.save(tensors, partial)
        partial.replace(layout_file)
    except Exception:  # a read-only or full disk only costs the next load these seconds again
        partial.unlink(missing_ok=True)


def quantize_activations(model: torch.nn.Module) -> None:
    """Turn a model loaded with int8 weights into w8a8: float32 outside the linears (exact from
    bf16), and every Int8Linear run with int8 activations (weights packed for oneDNN in the
    background)."""
    model.to(torch.float32)
    for name, module in list(model.named_modules()):
        if isinstance(module, Int8Linear):
            _replace(model, name, W8A8Linear(module))
    start_packing(model)


def describe(model: torch.nn.Module) -> str:
    """"int4 weights" / "int8 weights" / "" for reports."""
    kinds = {type(m) for m in model.modules()}
    if W8A8Linear in kinds:
        return "int8 weights x int8 activations (per row)"
    if Int4Linear in kinds:
        return f"int4 weights (groups of {GROUP_SIZE})"
    if Int8Linear in kinds:
        return "int8 weights"
    if any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules()):
        return "bitsandbytes weights"
    return ""


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _bitsandbytes_linear(linear: torch.nn.Linear, quant: str) -> torch.nn.Module:
    """bitsandbytes quantizes when the module is moved to the GPU."""
    import bitsandbytes as bnb

    if quant == "nf4":
        new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                compute_dtype=COMPUTE_DTYPE, quant_type="nf4")
        new.weight = bnb.nn.Params4bit(linear.weight.data.to(COMPUTE_DTYPE).cpu(), requires_grad=False, quant_type="nf4")
    else:
        new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                  has_fp16_weights=False)
        new.weight = bnb.nn.Int8Params(linear.weight.data.to(COMPUTE_DTYPE).cpu(), requires_grad=False, has_fp16_weights=False)
    if linear.bias is not None:
        new.bias = torch.nn.Parameter(linear.bias.data.to(COMPUTE_DTYPE), requires_grad=False)
    return new.cuda()
