"""Where a command's wall clock went (`localspec run --timings`): named phases, timed as they run
by the code that runs them, read once at the end. No torch; any layer may report into it.

A phase's time is its own: one that runs inside another (the tokenizer read inside a model's load,
a calibration inside the draft's format choice) is taken out of the outer one, so the phases never
add up to more than the wall clock, and what none of them covers shows as `other`. A phase run
twice adds up (the draft loaded in each format it measures). One recorder per process, fed from
the thread that runs the command (a command opens one session).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import psutil

PHASES = ("imports", "registry", "tokenizer", "target_load", "draft_load", "calibration", "prefill", "decode")
"""What a breakdown names, in the order a run meets them: imports (Python's start, then the modules
a command loads), registry (the entry, the machine's situation, the proposers ranked), tokenizer,
target_load and draft_load (weights, format choices and kernels built on first use; the tokenizer
not included), calibration (pass costs measured or read), prefill (time to the first token),
decode (the tokens after it)."""

_spent: dict[str, float] = {}
_inner: list[float] = []
"""For each phase open now, outermost first: the time its inner phases took so far."""


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the time the block takes, less that of the phases inside it, to phase `name`."""
    _check(name)
    start = time.perf_counter()
    _inner.append(0.0)
    try:
        yield
    finally:
        took = time.perf_counter() - start
        _spent[name] = _spent.get(name, 0.0) + took - _inner.pop()
        if _inner:
            _inner[-1] += took


def record(name: str, seconds: float) -> None:
    """Add `seconds` measured elsewhere (a generation's time to first token), outside any open phase."""
    _check(name)
    _spent[name] = _spent.get(name, 0.0) + max(seconds, 0.0)


def _check(name: str) -> None:
    if name not in PHASES:  # a misspelt name would hide its time under `other`
        raise ValueError(f"unknown phase {name!r}")


def since_process_start() -> float:
    """Seconds since this process started (the operating system's clock), Python's own start included.

    On Linux both ends are read against the boot clock (the process's start in clock ticks from
    /proc): psutil's creation time adds the boot time, which the kernel states in whole seconds, so
    it was up to a second off (a 0.2 s start read as 1.1 s)."""
    try:
        with open("/proc/self/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        return max(time.time() - psutil.Process().create_time(), 0.0)


def breakdown() -> dict[str, float]:
    """Seconds per phase (each of PHASES, 0 where none ran), `other` (what no phase covered) and
    `total` (the wall clock since the process started)."""
    total = since_process_start()
    spent = {name: _spent.get(name, 0.0) for name in PHASES}
    return {**spent, "other": max(total - sum(spent.values()), 0.0), "total": total}


def summary(seconds: dict[str, float]) -> str:
    """One line of a breakdown, for stderr."""
    return "timings: " + ", ".join(f"{name.replace('_', ' ')} {value:.2f} s" for name, value in seconds.items())
