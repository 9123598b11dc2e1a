"""Weight quantization of a loaded model: which layers, which format, on which device.

- int4: group-wise 4-bit weights (`localspec.kernels.int4_format`), run by torch's packed int4
  matmul on the CPU and by the Triton small-M kernel on CUDA.
- int8: per-channel 8-bit weights; torch's int8 weight-only matmul on the CPU, bitsandbytes on CUDA.
- w8a8: the int8 weights (same cache) with each activation row quantized to int8 too, run by
  oneDNN's VNNI int8 matmul on x86 CPUs: a 16-token verify pass then costs about 2x a one-token
  pass instead of 5x, and the rest of the model runs in float32 (`localspec.kernels.cpu_w8a8`).
- w4a8: the int4 weights (same cache) with each activation row quantized to int8, run by
  localspec's own x86 kernel (`localspec.kernels.cpu_w4a8`, AVX-512 VNNI or AVX2, AMX for sets of
  16 rows, same numbers): 5 bits per weight read once per pass, so a pass of a few tokens costs
  about what one token does (16 tokens about 1.8x with AMX, 2.1x without, bound by the dot
  products). On CPUs with AMX-BF16 a prompt's pass (`prompt_pass`, 16 rows or more) runs in bf16
  on the tile unit instead: closer to the float model, and used by plain and speculative decoding alike.
- nf4: bitsandbytes' NF4 (CUDA; it also runs on a CPU, slowly, which is how the tests load it).
Otherwise activations stay 16-bit (bf16): the weight-only CPU kernels are only fast with them.

Every nn.Linear whose width fits the format is quantized, the output layer included (for a 1.5B
model with 151k tokens it is 15% of the weights); the token embedding is a lookup and stays
16-bit. Exactness is relative to the target as loaded: speculative decoding reproduces the
quantized model's own output, and `localspec bench --quant` shows what quantizing costs.

Whatever reads a layer's weights rather than running it (an EAGLE head's shared output layer and
embedding, training) reads them through `dense_weight`, which knows every format here: each linear
class of `localspec.kernels` de-quantizes its own stored numbers (`dense_weight()`), bitsandbytes'
layers go through bitsandbytes' own de-quantizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from localspec.base.config import home_dir
from localspec.base.errors import LocalspecError
from localspec.base.files import write_atomic
from localspec.kernels import cpu_w4a8
from localspec.kernels.cpu_build import KernelUnavailable
from localspec.kernels.cpu_int8 import Int8Linear, int8_shape_ok, int8_supported
from localspec.kernels.cpu_w8a8 import W8A8Linear, start_packing, w8a8_supported
from localspec.kernels.int4_linear import GROUP_SIZE, Int4Linear, cpu_int4_supported, int4_shape_ok

COMPUTE_DTYPE = torch.bfloat16
"""Activation dtype of the weight-only quantized models."""


W4A8_LAYOUT = "w4a8-blocks-v4.pt"
"""The w4a8 kernel's packed weights, beside the int4 cache (the name changes with the layout)."""
W4A8_LAYOUTS = "w4a8-blocks-*.pt"
"""The names of every version of that layout (older ones are left by earlier localspec versions)."""


def stored_format(quant: str) -> str:
    """The cached weight format behind `quant` (w8a8 runs the int8 weights, w4a8 the int4 ones)."""
    return {"w8a8": "int8", "w4a8": "int4"}.get(quant, quant)


def compute_dtype(quant: str) -> torch.dtype:
    return torch.float32 if quant in ("w8a8", "w4a8") else COMPUTE_DTYPE


def w4a8_kernel() -> cpu_w4a8.Kernel:
    """The compiled w4a8 kernel (built once into localspec's home), or a one-line error."""
    try:
        return cpu_w4a8.load(home_dir() / "kernels")
    except KernelUnavailable as exc:
        raise LocalspecError(str(exc)) from None


def uses_bitsandbytes(quant: str, device: torch.device) -> bool:
    """nf4 anywhere, int8 on CUDA: the formats bitsandbytes' layers compute."""
    return quant == "nf4" or (quant == "int8" and device.type == "cuda")


def check_supported(quant: str, device: torch.device) -> None:
    """A one-line error for a format this machine cannot run."""
    if quant == "none":
        return
    if uses_bitsandbytes(quant, device):
        # (nf4 also runs on a CPU, slowly: tests load it there the way CUDA users do)
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise LocalspecError(f"--quant {quant} needs bitsandbytes: pip install 'localspec[cuda]'") from None
    if device.type == "cpu":
        if quant == "int4" and not cpu_int4_supported():
            raise LocalspecError("this torch build has no int4 weight-only matmul; use --quant int8 or none")
        if quant == "int8" and not int8_supported():
            raise LocalspecError("this torch build has no int8 weight-only matmul; use --quant none")
        if quant == "w8a8" and not w8a8_supported():
            raise LocalspecError("--quant w8a8 needs oneDNN's int8 matmul with exact sums (an x86 CPU with "
                                 "AVX-512 VNNI or AMX); use --quant int8 or int4")
        if quant == "w4a8":
            w4a8_kernel()
    if quant in ("w8a8", "w4a8") and device.type != "cpu":
        raise LocalspecError(f"--quant {quant} is a CPU format; on {device.type} use --quant int4")
    if device.type == "mps" and quant != "int4":
        raise LocalspecError(f"--quant {quant} is not available on MPS; use --quant int4 or none")


def quantize_model(model: torch.nn.Module, quant: str, device: torch.device) -> dict[str, str]:
    """Quantize the linears of `model` in place (on the CPU for int4/int8, which the cache stores;
    for bitsandbytes one by one onto `device`); returns {module name: format} of what was replaced."""
    replaced: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        if quant in ("int4", "w4a8") and int4_shape_ok(module):
            new = Int4Linear.from_linear(module, GROUP_SIZE, COMPUTE_DTYPE)
        elif quant in ("int8", "w8a8") and device.type != "cuda" and int8_shape_ok(module):
            new = Int8Linear.from_linear(module, COMPUTE_DTYPE)
        elif uses_bitsandbytes(quant, device):
            new = _bitsandbytes_linear(module, quant, device)
        else:
            continue  # an odd width stays 16-bit
        replace_module(model, name, new)
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
            replace_module(model, name, Int4Linear(*shape, GROUP_SIZE, COMPUTE_DTYPE, device="meta"))
        elif quant == "int8":
            replace_module(model, name, Int8Linear(*shape, COMPUTE_DTYPE, device="meta"))
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
    try:
        # torch's own format: every tensor starts 64-byte aligned; read eagerly, since every byte is
        # used at once (faulting a memory map in page by page measured 4x slower)
        stored = torch.load(layout_file, weights_only=True)
    except FileNotFoundError:  # not made yet, or removed by a cleanup since (cleanup.discard_unused)
        stored = None
    if stored is not None:
        for name, m in int4.items():
            m.adopt_cpu_layout({part: stored[f"{name}.{part}"] for part in ("weight", "scale_zeros")})
        return
    tensors = {f"{name}.{part}": t for name, m in int4.items() for part, t in m.cpu_layout(COMPUTE_DTYPE).items()}
    _save_layout(tensors, layout_file)


def quantize_activations(model: torch.nn.Module) -> None:
    """Turn a model loaded with int8 weights into w8a8: float32 outside the linears (exact from
    bf16), and every Int8Linear run with int8 activations (weights packed for oneDNN in the
    background)."""
    model.to(torch.float32)
    for name, module in list(model.named_modules()):
        if isinstance(module, Int8Linear):
            replace_module(model, name, W8A8Linear(module))
    start_packing(model)


prompt_pass = cpu_w4a8.prompt_pass
"""Around the passes that fill the cache with a prompt: w4a8 layers may take their prompt path there."""


SAME_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling linears that read the same input in Llama-family layers: w4a8 runs each set as one call."""


@dataclass
class BlockSource:
    """One linear to be run by the w4a8 kernel: its shape, its block format (4- or 8-bit codes,
    `cpu_w4a8`), its bias, and how to pack its blocks (called only when no stored blocks fit)."""

    in_features: int
    out_features: int
    bits: int
    bias: torch.Tensor | None
    pack: Callable[[], torch.Tensor]


def use_w4a8(model: torch.nn.Module, blocks_file: Path | None) -> None:
    """Turn a model loaded with int4 weights into w4a8: every Int4Linear run by the w4a8 kernel."""
    sources = {name: BlockSource(m.in_features, m.out_features, 4, m.bias,
                                 lambda m=m: cpu_w4a8.pack(m.packed, m.scales, m.mins))
               for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    install_w4a8(model, sources, blocks_file)


def install_w4a8(model: torch.nn.Module, sources: dict[str, BlockSource], blocks_file: Path | None) -> None:
    """Put the w4a8 kernel's linears in place of the named modules, float32 between them. The
    kernel's blocks are read (memory-mapped) from `blocks_file`, packed and stored there the first
    time (then the sources' own tensors are never touched again). Siblings reading one input run as
    one call; the token embedding stays as stored (a lookup reads a few rows) and hands float32 on."""
    kernel = w4a8_kernel()
    groups = _same_input_groups(sources)
    stored = _read_blocks(blocks_file, groups, sources) if blocks_file is not None else None
    packed = {}
    for names in groups:
        key = "+".join(names)
        members = [sources[n] for n in names]
        if stored is not None:
            blocks = stored[key]
        else:  # one member's own buffer as it is: a copy of a 7B's output layer would be half a GB more at the peak
            blocks = members[0].pack() if len(members) == 1 else torch.cat([m.pack() for m in members])
        packed[key] = blocks
        for name, layer in zip(names, cpu_w4a8.fuse(members, kernel, blocks)):
            replace_module(model, name, layer)
    if stored is None and blocks_file is not None:
        _save_layout(packed, blocks_file)
    if getattr(model.config, "hidden_act", None) == "silu":
        for name, mlp in list(model.named_modules()):
            parts = [getattr(mlp, part, None) for part in ("gate_proj", "up_proj", "down_proj")]
            if all(isinstance(part, cpu_w4a8.W4A8Linear) for part in parts):
                replace_module(model, name, cpu_w4a8.GatedMLP(*parts))
    embedding = model.get_input_embeddings()
    for module in model.modules():
        if module is embedding:
            continue
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor.is_floating_point() and tensor.dtype != torch.float32:
                tensor.data = tensor.data.float()
    embedding.register_forward_hook(lambda module, args, out: out.float())


def _same_input_groups(sources: dict[str, BlockSource]) -> list[list[str]]:
    """The kernel calls: sets of SAME_INPUT siblings of one block format, every other linear alone."""
    groups, grouped = [], set()
    for name in sources:
        parent, _, leaf = name.rpartition(".")
        for siblings in SAME_INPUT:
            names = [f"{parent}.{s}" if parent else s for s in siblings]
            if leaf == siblings[0] and all(n in sources for n in names) \
                    and len({(sources[n].in_features, sources[n].bits) for n in names}) == 1 \
                    and all(sources[n].out_features % cpu_w4a8.TILE == 0 for n in names):
                groups.append(names)
                grouped.update(names)
    return groups + [[name] for name in sources if name not in grouped]


def _read_blocks(blocks_file: Path, groups: list[list[str]], sources: dict[str, BlockSource]) -> dict[str, torch.Tensor] | None:
    """The stored blocks when they match these layers; a damaged or stale file is dropped (the
    blocks are packed again, the weights' cache is fine)."""
    if not blocks_file.is_file():
        return None
    try:
        stored = torch.load(blocks_file, mmap=True, weights_only=True)
        for names in groups:
            blocks = stored["+".join(names)]
            want = sum(cpu_w4a8.block_bytes(sources[n].out_features, sources[n].in_features, sources[n].bits) for n in names)
            if blocks.dtype != torch.uint8 or blocks.numel() != want:
                raise ValueError(f"{names}: blocks of the wrong size")
        return stored
    except Exception:
        blocks_file.unlink(missing_ok=True)
        return None


def _save_layout(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Store a kernel layout beside its cache (atomically); a read-only or full disk, or a cache
    removed meanwhile, only costs the next load the packing again."""
    try:
        write_atomic(path, lambda out: torch.save(tensors, out), durable=False)
    except Exception:
        pass


def dense_weight(module: torch.nn.Module) -> torch.Tensor:
    """The float weight of any linear (out, in) or embedding (V, H) a loaded model holds, in every
    format this module makes: a float layer's own tensor (no copy), else a float32 de-quantization
    of the numbers the layer computes with (a new tensor)."""
    if type(module).__module__.startswith("bitsandbytes"):  # before nn.Linear: its subclasses hold packed codes in .weight
        return _bitsandbytes_dense_weight(module)
    own = getattr(module, "dense_weight", None)
    if callable(own):
        return own()
    if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
        return module.weight.detach()
    raise LocalspecError(f"cannot read a weight out of a {type(module).__name__} layer")


def _bitsandbytes_dense_weight(module: torch.nn.Module) -> torch.Tensor:
    import bitsandbytes as bnb

    weight = module.weight
    if isinstance(module, bnb.nn.Linear4bit) and weight.quant_state is not None:
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    if isinstance(module, bnb.nn.Linear8bitLt) and weight.SCB is not None:
        return bnb.functional.int8_vectorwise_dequant(weight.CB, weight.SCB)
    if weight.dtype.is_floating_point:  # not quantized (yet)
        return weight.detach()
    raise LocalspecError(f"cannot read a weight out of bitsandbytes' {type(module).__name__} layer")


def describe(model: torch.nn.Module) -> str:
    """"int4 weights" / "int8 weights" / "" for reports."""
    kinds = {type(m) for m in model.modules()}
    if cpu_w4a8.W4A8Linear in kinds:
        layers = [m for m in model.modules() if isinstance(m, cpu_w4a8.W4A8Linear)]
        bits = "/".join(f"int{b}" for b in sorted({m.bits for m in layers}))
        return f"{bits} weights x int8 activations (a scale per 32, {layers[0].kernel.name} kernel)"
    if W8A8Linear in kinds:
        return "int8 weights x int8 activations (per row)"
    if Int4Linear in kinds:
        return f"int4 weights (groups of {GROUP_SIZE})"
    if Int8Linear in kinds:
        return "int8 weights"
    if any(type(m).__name__ in ("Linear4bit", "Linear8bitLt") for m in model.modules()):
        return "bitsandbytes weights"
    return ""


def replace_module(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _bitsandbytes_linear(linear: torch.nn.Linear, quant: str, device: torch.device) -> torch.nn.Module:
    """The linear in bitsandbytes' format on `device`: bitsandbytes quantizes as the module moves
    there, one layer at a time, so the device never holds more than one 16-bit weight."""
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
    return new.to(device)
