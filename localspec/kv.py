"""KV cache with O(1) rollback and in-place tree-path compaction.

Wraps transformers' DynamicCache: its per-layer key/value tensors are (B, H_kv, T, D). Rolling back
is a slice (a view, no copy); the rejected slots are simply overwritten by the next pass.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


class KVCache:
    def __init__(self) -> None:
        self.cache = DynamicCache()

    def __len__(self) -> int:
        return self.cache.get_seq_length()

    def truncate(self, length: int) -> None:
        """Forget every position >= length, in every layer: after a pass cut short (Ctrl-C, out
        of memory) the first layers may hold more positions than the last."""
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.shape[-2] > length:
                layer.keys = layer.keys[..., :length, :]  # (B, H_kv, length, D)
                layer.values = layer.values[..., :length, :]

    def keep(self, start: int, offsets: list[int]) -> None:
        """Keep positions start + offsets (ascending) packed right after `start`, drop the rest.

        Used after a tree pass: the accepted path's entries move down to consecutive slots.
        """
        if offsets == list(range(len(offsets))):
            self.truncate(start + len(offsets))
            return
        index = torch.tensor([start + o for o in offsets], dtype=torch.long)
        for layer in self.cache.layers:
            device_index = index.to(layer.keys.device)
            layer.keys = torch.cat([layer.keys[..., :start, :], layer.keys.index_select(-2, device_index)], dim=-2)
            layer.values = torch.cat(
                [layer.values[..., :start, :], layer.values.index_select(-2, device_index)], dim=-2
            )
