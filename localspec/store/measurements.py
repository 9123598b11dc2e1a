"""What localspec measures once per machine, and where it keeps it: keys and the file in one place.

calibration.json under home_dir(), changed only through `update_json_object` (one lock, one atomic
write): measurements reused instead of repeated, keyed by everything that decides them: a model's
pass cost per width and context (`pass_cost_key`; a draft's step is its width-1 pass), the compute
dtype measured for a pair (`dtype_key`), the draft's fastest weight format (`draft_format_key`). A
pass-cost key names what runs the pass (the lean forward, the compiled CPU kernels' sources), so
pass costs measured by an earlier release are measured again; the other keys are the ones earlier
releases wrote, and their entries are read as they are. What generations measured is history.py's.

A file that is missing or damaged reads as empty: measuring again is the cure, and the next save
replaces it. A file that cannot be written only costs a measurement repeated next time, never the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from localspec.base import timings
from localspec.base.config import home_dir
from localspec.base.files import read_json_object, update_json_object
from localspec.kernels.cpu_build import sources_digest
from localspec.runtime import costs
from localspec.runtime.target_pass import TargetPass
from localspec.store.machine import OthersLoad
from localspec.store.progress import print_notice


def _calibration_file() -> Path:
    return home_dir() / "calibration.json"


def load_calibrations() -> dict:
    """Everything measured here, by key ({} when there is no file or it is damaged)."""
    return read_json_object(_calibration_file())


def load_calibration(key: str) -> dict:
    """One measurement ({} when absent, or hand-edited into another shape: then it is measured again)."""
    value = load_calibrations().get(key)
    return value if isinstance(value, dict) else {}


def save_calibration(key: str, value: dict) -> None:
    def put(data: dict) -> None:
        data[key] = value

    with contextlib.suppress(OSError):  # see the module docstring
        update_json_object(_calibration_file(), put)


def forget_pass_costs(name: str, model: torch.nn.Module) -> None:
    """Drop a model's calibrated pass costs: the next session that runs it measures them again."""
    key = pass_cost_key(name, model)

    def drop(data: dict) -> None:
        data.pop(key, None)

    with contextlib.suppress(OSError):  # see the module docstring
        update_json_object(_calibration_file(), drop)


def _runtime() -> str:
    return f"threads={torch.get_num_threads()}"


def pass_cost_key(name: str, model: torch.nn.Module) -> str:
    """What decides a pass's cost: model, attention path and forward, weight format (dtype and any fast-path or
    quantized layers: prepacked, int8, bitsandbytes), device (on a CPU, the compiled kernels' sources), threads, torch."""
    param = next(model.parameters())
    fast_paths = sorted({type(m).__name__ for m in model.modules()
                         if type(m).__module__.startswith(("localspec.kernels", "bitsandbytes"))})
    variant = f"|{'+'.join(fast_paths)}" if fast_paths else ""
    attention = TargetPass(model).name  # what generation's passes run: attention, lean pass, CUDA graphs
    device = param.device.type
    if device == "cuda":
        device += f"={torch.cuda.get_device_name(param.device)}"
    if device == "cpu":  # the compiled CPU kernels (w4a8, row attention) are part of the pass
        device += f"|kernels={sources_digest()}"
    return f"{name}{variant}|{param.dtype}|attention={attention}|{device}|{_runtime()}|torch={torch.__version__}"


def dtype_key(target: str, draft: str | None, proposer: str) -> str:
    """The CPU compute dtype measured for a target (and draft) with a proposer."""
    return f"dtype|{target}|{draft or '-'}|{proposer}|{_runtime()}"


def draft_format_key(draft: str, dtype: torch.dtype, candidates: tuple[str, ...]) -> str:
    """The draft weight format whose step measured fastest among `candidates`."""
    return f"draft-quant|{draft}|{dtype}|{'+'.join(candidates)}|{_runtime()}|torch={torch.__version__}"


_BUSY_SAID: set[str] = set()


@timings.phase("calibration")
def measured_curves(name: str, model: torch.nn.Module, widths: tuple[int, ...] = costs.WIDTHS,
                    contexts: tuple[int, ...] = costs.CONTEXTS, say: Callable[[str], None] = print_notice,
                    ) -> dict[int, dict[int, float]]:
    """Calibrated pass costs of a model as it runs, per context length and width: measured with
    costs.time_passes the first time, then read from calibration.json. A measurement is kept only
    when the machine was quiet while it ran (`quiet_passes`), the second try included: on a machine
    busy with other work the costs hold for this run only (`say` tells why), so that a busy moment
    does not decide every later run."""
    key = pass_cost_key(name, model)
    cached = load_calibration(key)
    curves = {}
    for context in contexts:
        known = cached.get(f"context={context}")
        if not (isinstance(known, dict) and all(isinstance(known.get(str(w)), (int, float)) for w in widths)):
            samples, quiet = quiet_passes(model, widths, context)
            if not quiet:
                samples, quiet = quiet_passes(model, widths, context)
            known = {str(w): min(s) for w, s in samples.items()}
            if quiet:
                cached[f"context={context}"] = known
                save_calibration(key, cached)
            elif key not in _BUSY_SAID:  # once per model and run, not once per measurement
                _BUSY_SAID.add(key)
                say(f"this machine is busy with other work: {name}'s pass costs measured now are used for this run "
                    "only, and measured again next time")
        curves[context] = {w: known[str(w)] for w in widths}
    return curves


QUIET_OTHERS = 0.25
"""Cores other processes may keep busy, on average, while a calibration runs, for it to be kept."""


def quiet_passes(model: torch.nn.Module, widths: tuple[int, ...], context: int) -> tuple[dict[int, list[float]], bool]:
    """costs.time_passes, and whether the machine was quiet meanwhile: other processes kept less
    than QUIET_OTHERS of a core busy (a steady load beside the passes slows every repeat alike, so
    their spread alone would miss it) and the repeats agree (costs.agree: bursts)."""
    load = OthersLoad()
    samples = costs.time_passes(model, widths, context=context)
    return samples, load.cores() < QUIET_OTHERS and costs.agree(samples)


def measured_costs(name: str, model: torch.nn.Module, widths: tuple[int, ...] = costs.WIDTHS,
                   say: Callable[[str], None] = print_notice) -> dict[int, float]:
    """Calibrated pass costs after the shortest calibration context (a draft step, a dtype choice)."""
    return measured_curves(name, model, widths, costs.CONTEXTS[:1], say)[costs.CONTEXTS[0]]
