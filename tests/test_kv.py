"""The KV cache's fixed-capacity mode and its writes at slots given on the device; `CachedTokens`:
the record of which tokens a cache's entries stand for, and the cut that makes a cache follow a
token sequence that changed."""

from __future__ import annotations

import pytest
import torch

from localspec.runtime.kv import CachedTokens, KVCache, common_prefix, extend_to


@torch.inference_mode()
def test_cache_writes_at_slots_from_the_device():
    kv = KVCache(8)
    layer_keys = torch.arange(2 * 3 * 2, dtype=torch.float32).view(1, 2, 3, 2)  # (B, H_kv, T, D)
    kv.cache.update(layer_keys[:, :, :1], layer_keys[:, :, :1], 0)  # one entry through the host path
    keys, _ = kv.cache.update(layer_keys, layer_keys, 0, slots=torch.tensor([1, 2, 3]), end=4)
    assert keys.shape == (1, 2, 8, 2)  # the whole buffer: rows read which slots they see from the device
    assert len(kv) == 1  # the host length is the caller's to move
    extend_to(kv.cache, 4)
    assert len(kv) == 4 and torch.equal(kv.cache.layers[0].keys[:, :, 1:], layer_keys)


@torch.inference_mode()
def test_a_fixed_capacity_cache_keeps_its_buffers_until_it_overflows():
    kv = KVCache(16)
    row = torch.ones(1, 2, 1, 4)
    kv.cache.update(row, row, 0)
    buffer = kv.cache.layers[0].key_slots.buffer
    assert buffer.shape[-2] == 16
    for _ in range(14):
        kv.cache.update(row, row, 0)
    kv.keep(3, [0, 2, 5])
    assert kv.cache.layers[0].key_slots.buffer is buffer  # rollback and compaction in place
    kv.cache.update(torch.ones(1, 2, 30, 4), torch.ones(1, 2, 30, 4), 0)  # past the capacity: an eager pass grows it
    assert kv.cache.layers[0].key_slots.buffer.shape[-2] >= 36 and len(kv) == 36
    assert KVCache().cache.layer_class_to_replicate().capacity == 0  # the default grows from BLOCK, as before


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
