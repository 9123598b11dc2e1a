"""KV cache in preallocated buffers: a pass writes its entries in place, rollback moves a length,
tree-path compaction copies the kept entries down. Nothing is copied per token.

A transformers 5 `Cache` of `SlotLayer`s, one per model layer, each holding keys/values in a
(B, H_kv, capacity, D) buffer. The model sees views of the filled part; rejected slots are simply
overwritten by the next pass (as in gpt-fast). When a write would overflow, the buffer is replaced
by one twice as large (at least `BLOCK` more slots), so growing costs O(1) per token amortised and
a long conversation reallocates only a few times.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

BLOCK = 256
"""Slots a buffer starts with (and grows by at least)."""


def _empty_like(states: torch.Tensor, slots: int) -> torch.Tensor:
    """An uninitialised (B, H_kv, slots, D) buffer for `states`. Made outside inference mode even
    during generation, so that a forward outside it (a probe, a test) may still write to it."""
    with torch.inference_mode(False):
        return torch.empty(*states.shape[:-2], slots, states.shape[-1], dtype=states.dtype, device=states.device)


class SlotLayer(DynamicLayer):
    """One layer's keys and values in a preallocated buffer (a DynamicLayer whose `keys` and
    `values` are views of the first `length` slots)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.key_buffer = _empty_like(key_states, 0)  # (B, H_kv, 0, D)
        self.value_buffer = _empty_like(value_states, 0)
        self.is_initialized = True
        self.set_length(0)

    @property
    def capacity(self) -> int:
        return self.key_buffer.shape[-2]

    def set_length(self, length: int) -> None:
        """Keep the first `length` slots (rollback: the rest is overwritten later)."""
        self.length = length
        self.keys = self.key_buffer[..., :length, :]  # (B, H_kv, length, D), a view
        self.values = self.value_buffer[..., :length, :]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity, self.capacity + BLOCK)
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            new = _empty_like(old, capacity)  # (B, H_kv, capacity, D)
            new[..., : self.length, :] = old[..., : self.length, :]
            setattr(self, name, new)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value_states (B, H_kv, T, D) -> all keys/values so far, (B, H_kv, length + T, D) views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self.key_buffer[..., self.length : end, :] = key_states
        self.value_buffer[..., self.length : end, :] = value_states
        self.set_length(end)
        return self.keys, self.values

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' convention: a negative count of slots to drop from the end."""
        if self.is_initialized and tokens_to_remove < 0:
            self.set_length(max(self.length + tokens_to_remove, 0))

    def keep(self, index: torch.Tensor, start: int) -> None:
        """Move the slots `index` (ascending, >= start) down to start, start + 1, ... and drop the rest."""
        n = index.shape[0]
        self.key_buffer[..., start : start + n, :] = self.key_buffer.index_select(-2, index)  # (B, H_kv, n, D)
        self.value_buffer[..., start : start + n, :] = self.value_buffer.index_select(-2, index)
        self.set_length(start + n)


class KVCache:
    def __init__(self) -> None:
        self.cache = Cache(layer_class_to_replicate=SlotLayer)

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
        for layer in self.cache.layers:
            layer.keep(index.to(layer.device), start)
