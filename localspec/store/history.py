"""What finished generations measured here: history.json under home_dir(), per machine, target
and proposer (`record_generation` after each one); `--proposer auto` reads it (`load_history`).

No torch at import: the CLI's parser and `localspec models` name pairs (`pair_key`) and the
ranking reads `Measured` before any weights load. The machine's device is asked for only when the
file is read or written, after a generation.

A file that is missing or damaged reads as empty, and a bad record is passed over; a file that
cannot be written only costs a less informed choice next time, never the run.
"""

from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from localspec.base.config import home_dir
from localspec.base.files import read_json_object, update_json_object

if TYPE_CHECKING:
    from localspec.core.stats import GenerationStats


@dataclass(frozen=True)
class Measured:
    """What generations with one proposer (and draft) measured for a target on this machine."""

    tokens: int
    speedup: float
    """Decode speed over plain decoding's, from the calibrated one-token pass cost."""
    acceptance: float


def pair_key(proposer: str, draft: str | None = None) -> str:
    """History key of a proposer for a target: "none", "ngram", "eagle" or "draft:<name>"."""
    return f"{proposer}:{draft}" if draft else proposer


def _history_file() -> Path:
    return home_dir() / "history.json"


def machine_id() -> str:
    from localspec.store.loading import pick_device  # torch, loaded by then: see the module docstring

    return f"{platform.node() or 'this-machine'}/{pick_device().type}"


def load_history(model: str) -> dict[str, Measured]:
    """What was measured for `model` on this machine, by pair_key."""
    machine = read_json_object(_history_file()).get(machine_id())
    records = machine.get(model) if isinstance(machine, dict) else None
    return {
        key: Measured(
            tokens=r["tokens"], speedup=r["speedup_tokens"] / r["tokens"],
            acceptance=r["accepted"] / r["drafted"] if r["drafted"] else 0.0,
        )
        for key, r in (records.items() if isinstance(records, dict) else ())
        if _counts(r) and r["tokens"]  # a record hand-edited into another shape is passed over
    }


def record_generation(model: str, proposer: str, stats: GenerationStats, draft: str | None = None) -> None:
    """Add one finished generation to the history (call it after each one)."""
    speedup = stats.measured_speedup
    if stats.new_tokens < 2 or speedup <= 0:  # no decode time, or no calibrated plain cost to compare with
        return

    def add(data: dict) -> None:
        record = _history_record(data, model, pair_key(proposer, draft))
        record["generations"] += 1
        record["tokens"] += stats.new_tokens
        record["speedup_tokens"] += speedup * stats.new_tokens
        record["drafted"] += stats.drafted
        record["accepted"] += stats.accepted

    with contextlib.suppress(OSError):  # see the module docstring
        update_json_object(_history_file(), add)


_COUNTS = {"generations": 0, "tokens": 0, "speedup_tokens": 0.0, "drafted": 0, "accepted": 0}


def _history_record(data: dict, model: str, key: str) -> dict:
    """The counters of one pair in `data`, made anew where a hand edit left another shape."""
    machine = data.get(machine_id())
    machine = data[machine_id()] = machine if isinstance(machine, dict) else {}
    records = machine.get(model)
    records = machine[model] = records if isinstance(records, dict) else {}
    record = records.get(key)
    records[key] = record if _counts(record) else dict(_COUNTS)
    return records[key]


def _counts(record: object) -> bool:
    """Whether a history record holds every counter, as a number."""
    return isinstance(record, dict) and all(
        isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool) for k in _COUNTS
    )
