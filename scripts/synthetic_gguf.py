"""Write a random-weight GGUF in the exact shape of Qwen2.5-7B-Instruct, quantized to Q4_K_M.

Random weights make speed and memory real and text meaningless: the file has the 7B's every
tensor, width, type and byte count, so loading, memory use and the time of a pass are those of
the real model, but whatever it generates is noise. Use it to measure, never to judge output.

Contract:
  python scripts/synthetic_gguf.py OUT_DIR [--seed N] [--llama-cpp DIR] [--keep-f16] [--layers N]

  - Writes OUT_DIR/qwen2.5-7b-synthetic-f16.gguf (architecture "qwen2": 28 layers, hidden 3584,
    intermediate 18944, 28 query heads / 4 KV heads of 128, q/k/v biases, untied output.weight,
    152064 embedding rows, rope theta 1e6, rms eps 1e-6, context 32768), tensor by tensor: each
    tensor is generated just before it is written, so memory holds one tensor, never the model.
    Linear weights are F16 drawn from N(0, 0.02), biases F32 from N(0, 0.01), norms F32 ones, so
    activations stay finite through all layers. The same --seed gives the same file.
  - Every tokenizer.* field (vocabulary, merges, special tokens, chat template) is copied from
    localspec's qwen2.5-coder-1.5b GGUF, so a draft with that tokenizer (the 0.5B) pairs with it.
    Its 151936 tokens are followed by [PAD151936]..[PAD152063] of type UNUSED, as llama.cpp's
    converter pads Qwen's vocabulary to the embedding's 152064 rows (llama.cpp requires the token
    list and the embedding to agree).
  - Quantizes that file with llama.cpp's own llama-quantize (DIR/build/bin or DIR itself; DIR
    defaults to $LLAMACPP_HOME, else ~/.cache/localspec-dev/llama.cpp) into
    OUT_DIR/qwen2.5-7b-synthetic-q4_k_m.gguf, logging its output to that path + ".quantize.log",
    then deletes the F16 file unless --keep-f16 (it is kept too when quantizing fails).
  - --layers N writes N layers of the same widths instead of 28, for a quick check.
  - Progress goes to stderr; the last line on stdout is the Q4_K_M file's path and size.
    Failures are one line on stderr (plus llama-quantize's last lines) and exit status 1.

The full file takes about 15 GB of F16 on the way and ~4.7 GB at the end; on 2 cores generating
takes a few minutes and quantizing several more.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np

from localspec.base.config import home_dir

OUTPUT_NAME = "qwen2.5-7b-synthetic-q4_k_m.gguf"
F16_NAME = "qwen2.5-7b-synthetic-f16.gguf"
TOKENIZER_SOURCE = Path("models") / "qwen2.5-coder-1.5b" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"

LINEAR_STD = 0.02
BIAS_STD = 0.01
# Values drawn per generator: small enough that the float32 scratch stays ~64 MB per thread,
# large enough that numpy's fill (which releases the GIL) dominates the per-chunk overhead.
CHUNK_VALUES = 1 << 24
LAYERS_PER_PROGRESS_LINE = 4
# Q4_K_M comes to ~31% of the F16 bytes; the margin covers the output and its log.
FREE_SPACE_FACTOR = 1.35


@dataclasses.dataclass(frozen=True)
class Qwen2Shape:
    """Qwen2.5-7B-Instruct's hyper-parameters, as its config.json states them."""

    layers: int = 28
    hidden: int = 3584
    intermediate: int = 18944
    heads: int = 28
    kv_heads: int = 4
    head_dim: int = 128
    embedding_rows: int = 152064
    context: int = 32768
    rope_theta: float = 1e6
    rms_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One tensor to write: its llama.cpp name, numpy shape (rows = output features) and contents."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "linear" (F16 random), "bias" (F32 random) or "norm" (F32 ones)

    @property
    def dtype(self) -> type[np.generic]:
        return np.float16 if self.kind == "linear" else np.float32

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def tensor_plans(shape: Qwen2Shape) -> list[TensorPlan]:
    """Every tensor of a llama.cpp qwen2 GGUF: the embedding, each layer's twelve, the output."""
    kv_width = shape.kv_heads * shape.head_dim
    plans = [TensorPlan("token_embd.weight", (shape.embedding_rows, shape.hidden), "linear")]
    for layer in range(shape.layers):
        prefix = f"blk.{layer}."
        plans += [
            TensorPlan(prefix + "attn_norm.weight", (shape.hidden,), "norm"),
            TensorPlan(prefix + "attn_q.weight", (shape.heads * shape.head_dim, shape.hidden), "linear"),
            TensorPlan(prefix + "attn_q.bias", (shape.heads * shape.head_dim,), "bias"),
            TensorPlan(prefix + "attn_k.weight", (kv_width, shape.hidden), "linear"),
            TensorPlan(prefix + "attn_k.bias", (kv_width,), "bias"),
            TensorPlan(prefix + "attn_v.weight", (kv_width, shape.hidden), "linear"),
            TensorPlan(prefix + "attn_v.bias", (kv_width,), "bias"),
            TensorPlan(prefix + "attn_output.weight", (shape.hidden, shape.heads * shape.head_dim), "linear"),
            TensorPlan(prefix + "ffn_norm.weight", (shape.hidden,), "norm"),
            TensorPlan(prefix + "ffn_gate.weight", (shape.intermediate, shape.hidden), "linear"),
            TensorPlan(prefix + "ffn_up.weight", (shape.intermediate, shape.hidden), "linear"),
            TensorPlan(prefix + "ffn_down.weight", (shape.hidden, shape.intermediate), "linear"),
        ]
    plans += [
        TensorPlan("output_norm.weight", (shape.hidden,), "norm"),
        TensorPlan("output.weight", (shape.embedding_rows, shape.hidden), "linear"),
    ]
    return plans


def generate(plan: TensorPlan, seed: int, tensor_index: int, pool: ThreadPoolExecutor) -> np.ndarray:
    """The tensor's values. Each chunk has its own generator keyed by (tensor, chunk), so the
    chunks fill in parallel and the file depends on the seed only, not on the thread count."""
    values = np.empty(plan.shape, dtype=plan.dtype)
    if plan.kind == "norm":
        values.fill(1.0)
        return values
    std = LINEAR_STD if plan.kind == "linear" else BIAS_STD
    flat = values.reshape(-1)

    def fill_chunk(chunk_index: int) -> None:
        start = chunk_index * CHUNK_VALUES
        stop = min(start + CHUNK_VALUES, flat.size)
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(tensor_index, chunk_index)))
        # float32 draws: half the scratch of float64; the assignment rounds them to the tensor's dtype.
        chunk = rng.standard_normal(stop - start, dtype=np.float32)
        chunk *= std
        flat[start:stop] = chunk

    list(pool.map(fill_chunk, range((flat.size + CHUNK_VALUES - 1) // CHUNK_VALUES)))
    return values


def copy_tokenizer(source: Path, writer: gguf.GGUFWriter, embedding_rows: int) -> int:
    """Copy every tokenizer.* field of `source` with its exact GGUF types, padding the token list
    to `embedding_rows`. Returns the source's token count."""
    reader = gguf.GGUFReader(source)
    fields = {key: field for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    token_count = len(fields["tokenizer.ggml.tokens"].data)
    if token_count > embedding_rows:
        sys.exit(f"error: {source} has {token_count} tokens, more than the {embedding_rows} embedding rows")
    padding = range(token_count, embedding_rows)
    for key, field in fields.items():
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [f"[PAD{token_id}]" for token_id in padding]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * len(padding)
        value_type = gguf.GGUFValueType(field.types[0])
        sub_type = gguf.GGUFValueType(field.types[1]) if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, value_type, sub_type)
    return token_count


def progress_label(plan: TensorPlan, layers: int) -> str | None:
    """What a progress line says after `plan` is written: the two big vocabulary tensors each get
    one, and layers one per LAYERS_PER_PROGRESS_LINE (counted at ffn_down, a layer's last tensor)."""
    if not plan.name.startswith("blk."):
        return plan.name if plan.kind == "linear" else None
    if not plan.name.endswith("ffn_down.weight"):
        return None
    layers_done = int(plan.name.split(".")[1]) + 1
    if layers_done % LAYERS_PER_PROGRESS_LINE == 0 or layers_done == layers:
        return f"layers {layers_done}/{layers}"
    return None


def write_f16(path: Path, shape: Qwen2Shape, seed: int, tokenizer_source: Path) -> None:
    """Write the F16 GGUF: header, metadata and tensor infos first, then each tensor's data in
    the same order, generated just before it is written."""
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(f"Qwen2.5 7B Instruct synthetic (random weights, {shape.layers} layers, seed {seed})")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    token_count = copy_tokenizer(tokenizer_source, writer, shape.embedding_rows)
    print(f"tokenizer: {token_count} tokens from {tokenizer_source}, padded to {shape.embedding_rows}",
          file=sys.stderr)

    plans = tensor_plans(shape)
    raw_types = {np.float16: gguf.GGMLQuantizationType.F16, np.float32: gguf.GGMLQuantizationType.F32}
    for plan in plans:
        writer.add_tensor_info(plan.name, plan.shape, np.dtype(plan.dtype), plan.nbytes,
                               raw_dtype=raw_types[plan.dtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    total_bytes = sum(plan.nbytes for plan in plans)
    written_bytes = 0
    started = time.monotonic()
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for tensor_index, plan in enumerate(plans):
            writer.write_tensor_data(generate(plan, seed, tensor_index, pool))
            written_bytes += plan.nbytes
            label = progress_label(plan, shape.layers)
            if label:
                print(f"  {label}: {written_bytes / 1e9:.1f}/{total_bytes / 1e9:.1f} GB, "
                      f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    writer.close()


def find_llama_quantize(llama_cpp: Path) -> Path:
    """llama-quantize in a llama.cpp folder's build/bin, or in the folder itself (the bin folder
    that ../shared/tools/llamacpp-baseline.sh prints)."""
    for candidate in (llama_cpp / "build" / "bin" / "llama-quantize", llama_cpp / "llama-quantize"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    sys.exit(f"error: no llama-quantize under {llama_cpp} (build it with: bash ../shared/tools/llamacpp-baseline.sh)")


def quantize(llama_quantize: Path, f16_path: Path, output: Path) -> None:
    """Q4_K_M via llama.cpp itself, into a .part file renamed at the end, so an interrupted run
    never leaves a file that looks finished."""
    log_path = output.with_name(output.name + ".quantize.log")
    partial = output.with_name(output.name + ".part")
    print(f"quantizing to Q4_K_M with {llama_quantize} (log: {log_path})", file=sys.stderr)
    with open(log_path, "w") as log:
        result = subprocess.run(
            [str(llama_quantize), str(f16_path), str(partial), "Q4_K_M", str(os.cpu_count() or 1)],
            stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = log_path.read_text(errors="replace").splitlines()[-15:]
        print("\n".join(tail), file=sys.stderr)
        sys.exit(f"error: llama-quantize exited with {result.returncode} "
                 f"(full log: {log_path}; F16 kept at {f16_path})")
    partial.replace(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for the GGUF files")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    default_llama_cpp = Path(os.environ.get("LLAMACPP_HOME") or Path.home() / ".cache" / "localspec-dev" / "llama.cpp")
    parser.add_argument("--llama-cpp", type=Path, default=default_llama_cpp,
                        help=f"llama.cpp folder holding build/bin/llama-quantize (default {default_llama_cpp})")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 intermediate file")
    parser.add_argument("--layers", type=int, default=Qwen2Shape.layers,
                        help=f"number of layers (default {Qwen2Shape.layers}; fewer for a quick check)")
    args = parser.parse_args()
    if args.layers < 1:
        sys.exit("error: --layers must be at least 1")

    # Checked before the long generation, so a missing tool or file fails in a second, not minutes.
    llama_quantize = find_llama_quantize(args.llama_cpp.expanduser())
    tokenizer_source = home_dir() / TOKENIZER_SOURCE
    if not tokenizer_source.is_file():
        sys.exit(f"error: no {tokenizer_source} to copy the tokenizer from (run: localspec pull qwen2.5-coder-1.5b)")
    shape = dataclasses.replace(Qwen2Shape(), layers=args.layers)
    out_dir = args.out_dir.expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    f16_bytes = sum(plan.nbytes for plan in tensor_plans(shape))
    free_bytes = shutil.disk_usage(out_dir).free
    if free_bytes < f16_bytes * FREE_SPACE_FACTOR:
        sys.exit(f"error: {out_dir} has {free_bytes / 1e9:.1f} GB free, "
                 f"needs ~{f16_bytes * FREE_SPACE_FACTOR / 1e9:.1f} GB (F16 intermediate plus Q4_K_M)")

    f16_path = out_dir / F16_NAME
    output = out_dir / OUTPUT_NAME
    print(f"writing {f16_path} ({shape.layers} layers, {f16_bytes / 1e9:.1f} GB, seed {args.seed})", file=sys.stderr)
    started = time.monotonic()
    write_f16(f16_path, shape, args.seed, tokenizer_source)
    generated = time.monotonic()
    print(f"F16 written in {generated - started:.0f} s", file=sys.stderr)
    quantize(llama_quantize, f16_path, output)
    print(f"quantized in {time.monotonic() - generated:.0f} s", file=sys.stderr)
    if not args.keep_f16:
        f16_path.unlink()
    print(f"{output}  {output.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
