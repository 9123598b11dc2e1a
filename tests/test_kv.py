"""`CachedTokens`: the record of which tokens a cache's entries stand for, and the cut that makes a
cache follow a token sequence that changed."""

from __future__ import annotations

import pytest

from localspec.kv import CachedTokens, common_prefix


class FakeCache:
    """Entries as a count: what the holder wrote, and where the record cut it."""

    def __init__(self) -> None:
        self.entries = 0

    def cut(self, n: int) -> None:
        self.entries = min(self.entries, n)


@pytest.mark.parametrize("a, b, n", [([], [1], 0), ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([5], [6], 0)])
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == n == common_prefix(b, a)


def test_a_cache_keeps_the_shared_prefix_and_feeds_the_rest():
    cache = FakeCache()
    record = CachedTokens(cache.cut)
    assert record.follow([1, 2, 3, 4]) == 0
    cache.entries += 4
    record.extend([1, 2, 3, 4])
    # a rejected guess: the sequence now goes 1 2 3 9 -> three entries stay
    assert record.follow([1, 2, 3, 9, 8]) == 3 and cache.entries == 3 and record.ids == [1, 2, 3]
    # a holder that must feed at least one token to get its next output keeps fewer
    assert record.follow([1, 2, 3], at_most=2) == 2 and cache.entries == 2 and record.ids == [1, 2]
    assert record.follow([]) == 0 and cache.entries == 0 and record.ids == []


def test_a_pass_cut_short_is_restored_to_the_recorded_entries():
    cache = FakeCache()
    record = CachedTokens(cache.cut)
    cache.entries = 3
    record.extend([7, 8, 9])
    cache.entries = 6  # a pass wrote three more entries, then was interrupted before the record
    record.restore()
    assert cache.entries == record.entries == 3


def test_a_lookahead_entry_stands_for_one_token_past_its_position():
    """An EAGLE head: entry i reads token i + 1, so n tokens make n - 1 entries."""
    cache = FakeCache()
    record = CachedTokens(cache.cut, lookahead=1)
    tokens = [1, 2, 3, 4, 5]
    kept = record.follow(tokens, at_most=len(tokens) - 2)
    assert kept == 0 and record.ids == [1]  # nothing cached: token 0 is read by nothing but stands first
    cache.entries += len(tokens) - 1 - kept
    record.extend(tokens[kept + 1 :])
    assert record.entries == cache.entries == 4
    # tokens 0..3 still hold, token 4 changed: entries 0..2 (reading tokens 1..3) stay
    assert record.follow([1, 2, 3, 4, 9, 10], at_most=4) == 3 and cache.entries == 3 and record.ids == [1, 2, 3, 4]
    # the first token changed: no entry stays and the record starts from the new one
    assert record.follow([6, 2, 3, 4], at_most=2) == 0 and cache.entries == 0 and record.ids == [6]
