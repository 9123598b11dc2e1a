"""A small model with the target's tokenizer drafts tokens one by one from its own KV cache.

Its steps run through a `TargetPass` of their own, the pass its calibration timed (the lean pass,
CUDA graph replays on a GPU).
"""

from __future__ import annotations

import torch

from localspec.base.config import SamplingConfig
from localspec.core.proposers.base import DraftRules, Proposer
from localspec.core.sampling import probs_from_logits, read_token, sample
from localspec.core.tree import Draft
from localspec.runtime.kv import CachedTokens
from localspec.runtime.quant import prompt_pass
from localspec.runtime.target_pass import TargetPass


class DraftModelProposer(Proposer):
    name = "draft"
    has_model = True

    def __init__(self, model: torch.nn.Module) -> None:
        self.step = TargetPass(model)
        self.device = self.step.device
        self.kv = self.step.new_cache(model.config.max_position_embeddings)
        self.kv_tokens = CachedTokens(self.kv.truncate)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Feed ids after the cache; return the logits after the last one, (V,)."""
        start = self.kv_tokens.entries
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, n)
        positions = torch.arange(start, start + len(ids), device=self.device)[None]  # (1, n)
        with prompt_pass():  # a resync of a whole prompt is a prompt's pass; a draft's numbers need not match any other
            logits = self.step(self.kv, x, positions, logit_rows=1)  # (1, V)
        self.kv_tokens.extend(ids)
        return logits[-1]

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], max_len: int, sampling: SamplingConfig, generator: torch.Generator,
        rules: DraftRules | None = None,
    ) -> Draft:
        if max_len <= 0:
            return Draft.chain([])
        # resynchronise: keep what still matches (O(1)), feed what is new (at least one token)
        reused = self.kv_tokens.follow(tokens, at_most=len(tokens) - 1)
        logits = self._forward(tokens[reused:])
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
            if rules is not None and not rules.another_guess([*confidences, confidence]):
                break
            drafted.append(token)
            probs.append(q)
            confidences.append(confidence)
            if step + 1 < max_len:
                logits = self._forward([token])
        return Draft.chain(drafted, probs, label="draft", confidences=confidences)
