"""Suffix decoding: guesses from everything already written, as a tree of what followed before.

The text's latest suffix is matched twice: in the current conversation (its prompt and the answer so
far, scanned each pass) and in a `SuffixIndex` over earlier text (this model's past prompts and
answers on this machine, and files the user named), a suffix array that finds every earlier
occurrence of the longest matching suffix at once. What followed the most recent occurrences is
merged into a tree of continuations, each node scored by how often it followed (its parent's
occurrences that went on with it), best-first; the best tree (the conversation's or an index's, by
expected accepted tokens) is the draft. A longer match is more specific, so a tree may reach `DEPTH_PER_MATCHED`
times as deep as the match is long; the draft policy then cuts it to what the measured costs pay
for. Every guess is fixed before the target's pass, so the acceptance rule stays exact.

The index is immutable: whoever keeps the history builds a new one when text is added
(`store/token_history.py`) and hands it over through `remember`. It is built with pydivsufsort
(libdivsufsort); numpy does every search.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import numpy as np

from localspec.core.proposers.base import Proposer
from localspec.core.tree import Draft, path_probabilities

END = -1
"""Ends each document in an index: never a token, so no match runs across two documents."""
MAX_MATCH = 32
"""Longest suffix matched: beyond it a match says nothing more about what follows."""
MAX_OCCURRENCES = 32
"""Most recent earlier occurrences merged into one tree."""
DEPTH_PER_MATCHED = 2
"""A tree reaches at most this many tokens per matched token (at least MIN_DEPTH): a one-token
match is weak evidence, a long one strong."""
MIN_DEPTH = 2
MAX_DEPTH = 32
MIN_PATH_PROBABILITY = 0.05
"""Nodes that followed less often than this (as a share of the occurrences) are not offered."""
LABEL_MATCH_CAP = 8
"""Matches this long or longer share one acceptance estimate ("history-8")."""


class SuffixIndex:
    """Documents of token ids, searchable for every occurrence of a token sequence.

    `corpus` is the documents concatenated, each followed by END (then END padding, so a search or
    a continuation may read past the last document); `order` its suffix array; `heads[i] =
    corpus[order[i]]` (ascending), where a search starts. Documents keep the order they were
    given in, oldest first: a larger position is more recent text. `ids` names each document for
    whoever keeps them (the history's stable ids; -1 for text that is not kept).
    """

    def __init__(self, documents: Sequence[Sequence[int]], ids: Sequence[int] | None = None) -> None:
        kept = [i for i, doc in enumerate(documents) if len(doc)]
        parts = [np.append(np.asarray(documents[i], dtype=np.int32), END) for i in kept]
        size = sum(len(p) for p in parts)
        self.corpus = np.concatenate([*parts, np.full(MAX_MATCH + MAX_DEPTH, END, dtype=np.int32)])  # (T + pad,)
        self.size = size - len(parts)
        self.starts = np.cumsum([0] + [len(p) for p in parts])[:-1]  # (D,): where each document begins
        self.ids = np.asarray([ids[i] for i in kept] if ids is not None else kept, dtype=np.int64)  # (D,)
        self.order = suffix_array(self.corpus[:size])  # (T,)
        self.heads = self.corpus[self.order]  # (T,), ascending

    def __len__(self) -> int:
        """Tokens held (document ends not counted)."""
        return self.size

    def occurrences(self, pattern: np.ndarray) -> np.ndarray:
        """Positions where `pattern` occurs followed by at least one more token of its document."""
        lo, hi = np.searchsorted(self.heads, pattern[0], "left"), np.searchsorted(self.heads, pattern[0], "right")
        for k in range(1, len(pattern)):  # suffixes sharing pattern[:k] are sorted by their token k
            column = self.corpus[self.order[lo:hi] + k]
            lo, hi = lo + np.searchsorted(column, pattern[k], "left"), lo + np.searchsorted(column, pattern[k], "right")
            if lo == hi:
                break
        found = self.order[lo:hi]
        return found[self.corpus[found + len(pattern)] != END]

    def longest_match(self, tokens: np.ndarray) -> tuple[int, np.ndarray]:
        """The longest suffix of `tokens` (at most MAX_MATCH) that occurs here with a token after
        it: its length and where each such occurrence's continuation starts (0, empty: none).
        A suffix that occurs implies its own shorter suffixes do, so the length is found by
        bisection."""
        found, low, high = np.zeros(0, dtype=np.int64), 0, min(MAX_MATCH, len(tokens))
        while low < high:
            length = (low + high + 1) // 2
            starts = self.occurrences(tokens[len(tokens) - length:])
            if len(starts):
                found, low = starts + length, length
            else:
                high = length - 1
        return low, found

    def continuation(self, start: int, depth: int) -> np.ndarray:
        """Up to `depth` tokens from `start`, to the end of their document."""
        run = self.corpus[start: start + depth]
        ends = np.flatnonzero(run == END)
        return run[: ends[0]] if len(ends) else run

    def documents_at(self, positions: np.ndarray) -> set[int]:
        """The ids of the documents these positions lie in."""
        return set(self.ids[np.searchsorted(self.starts, positions, "right") - 1].tolist())


def suffix_array(tokens: np.ndarray) -> np.ndarray:
    """Where each suffix of `tokens` starts, in sorted order; the C library is imported only
    when there is text to index (a first run has no history)."""
    if not len(tokens):
        return np.zeros(0, dtype=np.int32)
    from pydivsufsort import divsufsort

    return divsufsort(tokens)


def live_match(tokens: np.ndarray) -> tuple[int, np.ndarray]:
    """The same search within `tokens` themselves: the longest suffix (at most MAX_MATCH) that
    also ends earlier, and where each earlier occurrence's continuation starts (0, empty: none).
    Each step keeps the earlier ends that still agree one token further back."""
    n = len(tokens)
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1]) if n > 1 else np.zeros(0, dtype=np.int64)
    if not len(ends):
        return 0, ends
    length = 1
    while length < min(MAX_MATCH, n - 1):
        further = ends[ends >= length]
        further = further[tokens[further - length] == tokens[n - 1 - length]]
        if not len(further):
            break
        ends, length = further, length + 1
    return length, ends + 1


def frequency_tree(continuations: list[np.ndarray], max_nodes: int, label: str, history: bool = False) -> Draft:
    """The continuations merged into a tree (a trie counting how many went through each node),
    offered best-first by the share of continuations that reach a node: each node's confidence
    is the share of its parent's that went on with it, so a node's path probability is the
    product along its path. Nodes below MIN_PATH_PROBABILITY are left out."""
    children: list[dict[int, int]] = [{}]
    counts, tokens = [len(continuations)], [END]
    for run in continuations:
        node = 0
        for token in run.tolist():
            nxt = children[node].get(token)
            if nxt is None:
                nxt = children[node][token] = len(counts)
                children.append({})
                counts.append(0)
                tokens.append(token)
            counts[nxt] += 1
            node = nxt
    draft_tokens: list[int] = []
    parents: list[int] = []
    confidences: list[float] = []
    frontier = [(-counts[c] / counts[0], c, -1, counts[c] / counts[0]) for c in children[0].values()]
    heapq.heapify(frontier)
    while frontier and len(draft_tokens) < max_nodes:
        reach, node, parent, confidence = heapq.heappop(frontier)
        if -reach < MIN_PATH_PROBABILITY:
            break
        index = len(draft_tokens)
        draft_tokens.append(tokens[node])
        parents.append(parent)
        confidences.append(confidence)
        for child in children[node].values():
            share = counts[child] / counts[node]
            heapq.heappush(frontier, (reach * share, child, index, share))
    return Draft(draft_tokens, parents, label=label, confidences=confidences, history=history)


def expected_accepted(draft: Draft) -> float:
    """A tree's score: the sum of its path probabilities, the tokens it is expected to add."""
    return sum(path_probabilities(draft))


def depth_for(matched: int, max_len: int) -> int:
    return min(max_len, MAX_DEPTH, max(MIN_DEPTH, DEPTH_PER_MATCHED * matched))


class SuffixProposer(Proposer):
    """Suffix decoding over the current conversation and indexes of earlier text.

    `remember(tokens, offered)` is called with each finished conversation (prompt and answer) and
    the ids of the documents guesses were offered from since the last one; it returns the indexes
    to search from then on (None: keep those in hand).
    """

    name = "suffix"
    builds_trees = True

    def __init__(self, indexes: Sequence[SuffixIndex] = (),
                 remember: Callable[[list[int], set[int]], list[SuffixIndex] | None] | None = None) -> None:
        self.indexes = [index for index in indexes if len(index)]
        self.remember = remember
        self.offered: set[int] = set()

    def propose(self, tokens, max_len, sampling, generator, rules=None) -> Draft:
        if max_len <= 0 or len(tokens) < 2:
            return Draft.chain([])
        seq = np.asarray(tokens, dtype=np.int64)
        matched, starts = live_match(seq)
        depth = depth_for(matched, max_len)
        best = frequency_tree([seq[s: s + depth] for s in starts[-MAX_OCCURRENCES:][::-1]], max_len,
                              f"prompt-{min(matched, LABEL_MATCH_CAP)}")
        best_score, source = expected_accepted(best), None
        for index in self.indexes:
            matched, starts = index.longest_match(seq)
            recent = np.sort(starts)[-MAX_OCCURRENCES:][::-1]  # the most recent first: it wins a tie
            depth = depth_for(matched, max_len)
            earlier = frequency_tree([index.continuation(s, depth) for s in recent], max_len,
                                     f"history-{min(matched, LABEL_MATCH_CAP)}", history=True)
            if (score := expected_accepted(earlier)) > best_score:
                best, best_score, source = earlier, score, (index, recent)
        if source is not None:
            self.offered |= source[0].documents_at(source[1])
        return best

    def finished(self, tokens: list[int]) -> None:
        if self.remember is None:
            return
        offered, self.offered = self.offered, set()
        indexes = self.remember(tokens, offered)
        if indexes is not None:
            self.indexes = [index for index in indexes if len(index)]
