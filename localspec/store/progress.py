"""What a load tells the person: one line per stage (download, join, convert, quantize) on stderr,
never stdout, which carries the answer. transformers' own progress bars and log lines are kept out
of sight meanwhile, and pip's output is shown only when pip fails (gguf_mirror)."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator


def say(progress: bool, message: str) -> None:
    """One line on stderr (never stdout, which carries the answer) when progress is wanted."""
    if progress:
        print_notice(message)


def print_notice(message: str) -> None:
    """One line on stderr, never stdout, which carries the answer."""
    print(f"localspec: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def transformers_quiet() -> Iterator[None]:
    """Keep transformers' own progress bars ("Loading weights", the GGUF de-quantizer's) and its
    log lines out of sight during a load: a load shows localspec's one line per stage instead, and
    what goes wrong is raised (a missing tensor is checked where the weights are read, converted)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # The GGUF de-quantizer uses plain tqdm, which the switch above does not reach.
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()
