"""A small model with the target's tokenizer drafts tokens one by one from its own KV cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from localspec.base.config import SamplingConfig
from localspec.runtime.decoder import use_exact_pass
from localspec.runtime.kv import CachedTokens, KVCache
from localspec.core.proposers.base import Proposer
from localspec.runtime.quant import prompt_pass
from localspec.core.sampling import probs_from_logits, read_token, sample
from localspec.core.tree import Draft


class DraftModelProposer(Proposer):
    name = "draft"
    has_model = True

    def __init__(self, model: torch.nn.Module) -> None:
        use_exact_pass(model)  # its one-token steps then take the lean pass too
        self.model = model
        self.device = next(model.parameters()).device
        self.kv = KVCache()
        self.kv_tokens = CachedTokens(self.kv.truncate)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Feed ids after the cache; return the logits after the last one, (V,)."""
        start = self.kv_tokens.entries
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, n)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]  # (1, n)
        with prompt_pass():  # a resync of a whole prompt is a prompt's pass; a draft's numbers need not match any other
            out = self.model(input_ids=x, position_ids=pos, cache=self.kv.cache, use_cache=True, logits_to_keep=1)
        self.kv_tokens.extend(ids)
        return out.logits[0, -1]

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], max_len: int, sampling: SamplingConfig, generator: torch.Generator,
        worth: Callable[[list[float]], bool] | None = None,
    ) -> Draft:
        if max_len <= 0:
            return Draft.chain([])
        # resynchronise: keep what still matches (O(1)), feed what is new (at least one token)
        keep = self.kv_tokens.follow(tokens, at_most=len(tokens) - 1)
        logits = self._forward(tokens[keep:])
        drafted: list[int] = []
        probs: list[torch.Tensor | None] = []
        confidences: list[float] = []
        for step in range(max_len):
            if sampling.greedy:
                q = None
                dist = logits.float().softmax(-1)  # (V,)
                token = logits.argmax()
            else:
                q = dist = probs_from_logits(logits, sampling).to(generator.device)  # (V,): beside the target's p
                token = sample(q, generator)
            token, confidence = read_token(token, dist[token])  # one read per step
            if worth is not None and not worth([*confidences, confidence]):
                break
            drafted.append(token)
            probs.append(q)
            confidences.append(confidence)
            if step + 1 < max_len:
                logits = self._forward([token])
        return Draft.chain(drafted, probs, label="draft", confidences=confidences)
