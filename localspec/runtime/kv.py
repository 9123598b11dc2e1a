"""KV cache in preallocated buffers: a pass writes its entries in place, rollback moves a length,
tree-path compaction copies the kept entries down. Nothing is copied per token.

A transformers 5 `Cache` of `SlotLayer`s, one per model layer, each holding keys/values in a
(B, H_kv, capacity, D) buffer. The model sees views of the filled part; rejected slots are simply
overwritten by the next pass (as in gpt-fast). When a write would overflow, the buffer is replaced
by one twice as large (at least `BLOCK` more slots), so growing costs O(1) per token amortised and
a long conversation reallocates only a few times. A cache made with a `capacity` has that many
slots from its first write, so passes within it never reallocate (what CUDA graphs need, which
replay fixed addresses), and a pass may write at slots given on the device (`SlotLayer.update`
with `slots`), which moves no host length: its caller says how far it wrote (`extend_to`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

BLOCK = 256
"""Rows a buffer starts with (and grows by at least)."""


class Slots:
    """Rows along dim -2 of a preallocated buffer: a write goes in place, cutting back moves a
    length, and a full buffer is replaced by one twice as large (O(1) per row, amortised)."""

    def __init__(self, capacity: int = 0) -> None:
        self.buffer: torch.Tensor | None = None  # (..., capacity, D)
        self.length = 0
        self.capacity = capacity
        """Rows the first buffer is made with (0: `BLOCK`); a full one is still replaced."""

    @property
    def filled(self) -> torch.Tensor | None:
        """(..., length, D): a view of the rows written so far."""
        return None if self.buffer is None else self.buffer[..., : self.length, :]

    def write(self, start: int, rows: torch.Tensor) -> None:
        """rows (..., n, D) into slots start .. start + n - 1; whatever came after them is dropped."""
        end = start + rows.shape[-2]
        if self.buffer is None or end > self.buffer.shape[-2]:
            self._grow(rows, end)
        self.buffer[..., start:end, :] = rows
        self.length = end

    def write_at(self, index: torch.Tensor, rows: torch.Tensor, end: int) -> None:
        """rows (..., n, D) into the slots `index` (n,) on the device, all below `end`; the length
        stays for the caller to set. Grows first only when `end` does not fit, which a captured
        pass never meets (graphs.py checks the room before)."""
        if self.buffer is None or end > self.buffer.shape[-2]:
            self._grow(rows, end)
        self.buffer.index_copy_(self.buffer.dim() - 2, index, rows)

    def cut(self, length: int) -> None:
        self.length = min(self.length, length)

    def _grow(self, like: torch.Tensor, needed: int) -> None:
        capacity = self.buffer.shape[-2] if self.buffer is not None else 0
        if capacity == 0 and self.capacity:  # the first buffer of a fixed-capacity cache
            capacity = max(needed, self.capacity)
        else:
            capacity = max(needed, 2 * capacity, capacity + BLOCK)
        # made outside inference mode even during generation, so that a forward outside it (a
        # probe, a test) may still write to it
        with torch.inference_mode(False):
            new = torch.empty(*like.shape[:-2], capacity, like.shape[-1], dtype=like.dtype, device=like.device)
        if self.buffer is not None:
            new[..., : self.length, :] = self.buffer[..., : self.length, :]
        self.buffer = new


class SlotLayer(DynamicLayer):
    """One layer's keys and values, each in `Slots` (a DynamicLayer whose `keys` and `values` are
    views of the filled slots)."""

    def __init__(self, capacity: int = 0) -> None:
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.key_slots, self.value_slots = Slots(self.capacity), Slots(self.capacity)
        self.key_slots.write(0, key_states[..., :0, :])  # allocates: (B, H_kv, max(BLOCK, capacity), D)
        self.value_slots.write(0, value_states[..., :0, :])
        self.is_initialized = True
        self._show()

    @property
    def length(self) -> int:
        return self.key_slots.length

    def _show(self) -> None:
        self.keys, self.values = self.key_slots.filled, self.value_slots.filled  # (B, H_kv, length, D) views

    def set_length(self, length: int) -> None:
        """Keep the first `length` slots (rollback: the rest is overwritten later)."""
        if not self.is_initialized:
            return  # nothing written yet
        self.key_slots.cut(length)
        self.value_slots.cut(length)
        self._show()

    def extend_to(self, length: int) -> None:
        """The first `length` slots hold entries: after a pass written at slots on the device."""
        self.key_slots.length = self.value_slots.length = length
        self._show()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, slots: torch.Tensor | None = None,
               end: int = 0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states (B, H_kv, T, D) -> all keys/values so far, (B, H_kv, length + T, D) views.

        With `slots` (T,) on the device: written there (all below `end`), the length left for the
        caller to set, and the whole buffers returned, (B, H_kv, capacity, D): which of them a row
        sees comes from the device too (attention.RowTable)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if slots is not None:
            self.key_slots.write_at(slots, key_states, end)
            self.value_slots.write_at(slots, value_states, end)
            self._show()  # a grown buffer's views
            return self.key_slots.buffer, self.value_slots.buffer
        start = self.length
        self.key_slots.write(start, key_states)
        self.value_slots.write(start, value_states)
        self._show()
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count of slots to drop from the end."""
        if self.is_initialized and tokens_to_remove < 0:
            self.set_length(max(self.length + tokens_to_remove, 0))

    def keep(self, index: torch.Tensor, start: int) -> None:
        """Move the slots `index` (ascending, >= start) down to start, start + 1, ... and drop the rest."""
        for slots in (self.key_slots, self.value_slots):
            slots.write(start, slots.buffer.index_select(-2, index))  # gathered first: overlapping slots are safe
        self._show()


class KVCache:
    def __init__(self, capacity: int = 0) -> None:
        """capacity: slots per layer made on the first write (0: grown as needed from `BLOCK`)."""
        self.cache = Cache(layer_class_to_replicate=functools.partial(SlotLayer, capacity))

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    def truncate(self, length: int) -> None:
        """Forget every position >= length, in every layer: after a pass cut short (Ctrl-C, out
        of memory) the first layers may hold more positions than the last."""
        for layer in self.cache.layers:
            if layer.is_initialized and layer.length > length:
                layer.set_length(length)

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep positions start + offsets (ascending) packed right after `start`, drop the rest.

        Used after a tree pass: the accepted path's entries move down to consecutive slots.
        """
        if offsets == list(range(len(offsets))):
            self.truncate(start + len(offsets))
            return
        index = torch.tensor([start + o for o in offsets], dtype=torch.long)
        on_device: dict[torch.device, torch.Tensor] = {}  # one copy per device, not per layer
        for layer in self.cache.layers:
            if layer.device not in on_device:
                on_device[layer.device] = index.to(layer.device)
            layer.keep(on_device[layer.device], start)


def extend_to(cache: Cache, length: int) -> None:
    """Every layer of a `KVCache`'s cache now holds `length` entries (a pass wrote them at slots
    given on the device)."""
    for layer in cache.layers:
        layer.extend_to(length)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CachedTokens:
    """Which tokens a cache's entries stand for: the one record that the target's cache, a draft
    model's and an EAGLE head's each keep, so a cache follows a token sequence that changed (a
    rejected guess, a new prompt that shares a prefix with the last) by cutting at the first
    difference, O(1), and feeding only what is new.

    `lookahead`: entry i stands for tokens[: i + 1 + lookahead]. An EAGLE head's entry i reads the
    target's features at position i and token i + 1, so it stands for one token past its position.
    """

    def __init__(self, cut: Callable[[int], None], lookahead: int = 0) -> None:
        self._cut = cut
        """Keeps the cache's first n entries."""
        self.lookahead = lookahead
        self.ids: list[int] = []

    @property
    def entries(self) -> int:
        return max(len(self.ids) - self.lookahead, 0)

    def follow(self, tokens: Sequence[int], at_most: int | None = None) -> int:
        """Keep the entries that still stand for a prefix of `tokens`, at most `at_most` of them (a
        holder that needs an output from its next pass keeps room to feed a token); cut the cache
        there and return how many stayed. The holder feeds the rest and `extend`s the record."""
        common = common_prefix(self.ids, tokens)
        kept = max(common - self.lookahead, 0)
        if at_most is not None:
            kept = max(min(kept, at_most), 0)
        self._cut(kept)
        if common >= kept + self.lookahead:
            del self.ids[kept + self.lookahead :]
        else:  # no entry kept and the lookahead's own tokens changed: they are what is read next
            self.ids = list(tokens[: self.lookahead])
        return kept

    def extend(self, ids: Sequence[int]) -> None:
        """The cache took one entry per id (each standing for one more token)."""
        self.ids.extend(ids)

    def restore(self) -> None:
        """Cut the cache back to the entries recorded here: a pass cut short (Ctrl-C, out of
        memory) may have written more, in some layers only."""
        self._cut(self.entries)
