"""A folder of Hugging Face safetensors given as --model: registered from its config and weights'
headers, loaded as it is (or through a quantized copy under localspec's home), speculation on it
equal to its greedy decoding, hostile folders one line with nothing registered, and `rm` never
touching the folder."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from conftest import assert_speculation_reproduces_greedy, tiny_model, tiny_tokenizer
from localspec.apps.cli import main
from localspec.base.errors import LocalspecError
from localspec.runtime.decoder import use_cpu_rows
from localspec.store import hub, loading, own_models
from localspec.store.paths import converted_root
from localspec.store.registry import load_registry


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("LOCALSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def save_folder(folder: Path, arch: str = "llama") -> torch.nn.Module:
    model = tiny_model(arch, hidden=64)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return model


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[5, 6, 7, 8, 9]])).logits.float()


def test_a_folder_is_registered_from_its_headers_and_loads_as_the_model_it_holds(tmp_path, arch):
    folder = tmp_path / "my model"  # a space in the path, as users' folders have
    saved = save_folder(folder, arch)
    before = digest(folder)
    name = own_models.resolve(str(folder))
    assert own_models.resolve(str(folder)) == name == "my-model", "registered once, named after the folder"
    entry = load_registry().get(name)
    assert entry.folder == folder and entry.gguf is None and entry.arch == arch
    assert entry.params == round(sum(t.numel() for t in saved.state_dict().values() if t is not saved.lm_head.weight
                                     or not saved.config.tie_word_embeddings) / 1e9, 3)
    assert entry.kv_per_token == 2 * 2 * 2 * 16  # layers x kv heads x head dim
    loaded = loading.load_model(entry, torch.float32, quant="none", progress=False)
    use_cpu_rows(saved)  # the norms a CPU model is placed with, so the two compute alike
    assert torch.equal(logits(loaded.model), logits(saved))
    assert_speculation_reproduces_greedy(loaded)
    assert digest(folder) == before, "the user's folder is read, never changed"


def test_a_quantized_copy_of_a_folder_lives_under_the_home_and_follows_the_folder(tmp_path, home):
    folder = tmp_path / "mine"
    save_folder(folder)
    name = own_models.resolve(str(folder))
    entry = load_registry().get(name)
    first = loading.load_model(entry, torch.float32, quant="int8", progress=False)
    assert first.cold and converted_root(entry).is_relative_to(home / "converted")
    again = loading.load_model(entry, torch.float32, quant="int8", progress=False)
    assert not again.cold and torch.equal(logits(again.model), logits(first.model))
    assert_speculation_reproduces_greedy(again)
    old_root = converted_root(entry)
    save_folder(folder)  # the user replaced the weights: the copy of the old ones is not read
    assert converted_root(entry) != old_root
    assert loading.load_model(entry, torch.float32, quant="int8", progress=False).cold


def test_rm_removes_localspecs_copies_and_the_registration_never_the_folder(tmp_path, home):
    folder = tmp_path / "mine"
    save_folder(folder)
    before = digest(folder)
    name = own_models.resolve(str(folder))
    entry = load_registry().get(name)
    loading.load_model(entry, torch.float32, quant="int8", progress=False)
    assert hub.pull(entry).source == "your folder"
    assert main(["rm", name]) == 0
    assert name not in load_registry().models and not converted_root(entry).exists()
    assert digest(folder) == before


def _no_config(folder: Path) -> None:
    (folder / "config.json").unlink()


def _only_pickles(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _no_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def _not_a_language_model(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "vit", "architectures": ["ViTModel"]}))


def _garbage_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)


def _bad_config(folder: Path) -> None:
    (folder / "config.json").write_text("{not json")


@pytest.mark.parametrize("damage, message", [
    (_no_config, "without config.json"),
    (_only_pickles, "PyTorch .bin files"),
    (_no_tokenizer, "has no tokenizer"),
    (_not_a_language_model, "architecture 'vit' is not a causal language model"),
    (_garbage_weights, "not a readable safetensors file"),
    (_bad_config, "config.json cannot be read"),
])
def test_a_folder_that_is_no_model_is_one_line_and_nothing_is_registered(tmp_path, damage, message, capsys):
    folder = tmp_path / "mine"
    save_folder(folder)
    damage(folder)
    before = digest(folder)
    with pytest.raises(LocalspecError, match=message) as caught:
        own_models.resolve(str(folder))
    assert "\n" not in str(caught.value)
    assert main(["run", "--model", str(folder), "--max-new-tokens", "1", "hi"]) == 2
    assert message in capsys.readouterr().err
    assert "mine" not in load_registry().models and digest(folder) == before


def test_a_folder_cannot_take_the_name_of_a_registered_file_or_a_shipped_model(tmp_path):
    from gguf_files import tiny_gguf_model, write_gguf

    gguf = write_gguf(tiny_gguf_model("llama"), tmp_path / "tiny.gguf")
    own_models.resolve(str(gguf), "mine")
    folder = tmp_path / "folder"
    save_folder(folder)
    for taken in ("mine", "smollm2-135m"):
        with pytest.raises(LocalspecError, match="already a model of the registry"):
            own_models.resolve(str(folder), taken)
    assert load_registry().get("mine").gguf == gguf
    other = tmp_path / "other"
    save_folder(other)
    assert own_models.resolve(str(folder), "f") == own_models.resolve(str(other), "f") == "f"
    assert load_registry().get("f").folder == other, "a folder's name may move to another folder"
