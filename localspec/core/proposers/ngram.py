"""Prompt lookup: find the latest earlier occurrence of the text's suffix and propose what followed.

Code editing and summarising repeat long spans of the prompt, so this costs nothing and often
guesses many tokens right. Longest suffix first (ngram_max down to ngram_min).
"""

from __future__ import annotations

import numpy as np

from localspec.core.proposers.base import Proposer
from localspec.core.tree import Draft


def lookup(tokens: list[int], max_len: int, ngram_min: int, ngram_max: int) -> tuple[list[int], int]:
    """Continuation (<= max_len tokens) of the most recent earlier match of the longest matching
    suffix, and that suffix's length n (0 when nothing matched)."""
    if max_len <= 0:
        return [], 0
    seq = np.asarray(tokens, dtype=np.int64)
    total = len(seq)
    for n in range(min(ngram_max, total - 1), ngram_min - 1, -1):
        suffix = seq[total - n:]
        # windows[i] = seq[i:i+n] for every start i that leaves at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)  # (total - n, n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        starts = starts[starts + n < total]  # the suffix itself has nothing after it
        if len(starts):
            follow = int(starts[-1]) + n
            return seq[follow: follow + max_len].tolist(), n
    return [], 0


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 4) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, tokens, max_len, sampling, generator, rules=None) -> Draft:
        guess, n = lookup(tokens, max_len, self.ngram_min, self.ngram_max)
        return Draft.chain(guess, label=f"ngram-{n}")
