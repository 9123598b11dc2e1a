"""Logits -> probabilities under the user's sampling settings, and drawing tokens from them; and
logits -> the log-probabilities a client may ask for (`likelihoods`).

Target and draft go through the same transform, so the acceptance rule compares like with like.
Everything stays on the logits' device (the generator too); what the host needs is read back in
one go (`read_token`, `likelihoods`).
"""

from __future__ import annotations

import torch

from localspec.base.config import SamplingConfig
from localspec.core.events import Likelihood


def probs_from_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k and top-p."""
    logits = logits.float() / max(sampling.temperature, 1e-5)  # (..., V)
    vocab = logits.shape[-1]
    if 0 < sampling.top_k < vocab:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (..., V)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first is always kept)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


def likelihoods(logits: torch.Tensor, tokens: list[int], top: int) -> list[Likelihood]:
    """logits (T, V), row t the distribution tokens[t] came from -> each token's log-probability
    under the model's raw distribution (log_softmax of the logits: no temperature, top-k or top-p,
    as OpenAI reports them), with the `top` most likely tokens of its row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # (T, V)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device)[:, None])  # (T, 1)
    best = logprobs.topk(top, dim=-1)  # values and indices (T, top)
    # one read; ids are exact in float32 below 2**24
    rows = torch.cat((chosen, best.values, best.indices.float()), dim=1).tolist()  # (T, 1 + 2 top)
    return [Likelihood(row[0], tuple(zip(map(int, row[1 + top :]), row[1 : 1 + top]))) for row in rows]


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token id from a (V,) distribution on the generator's device: a 0-d tensor there."""
    return torch.multinomial(probs, 1, generator=generator)[0]


def read_token(token: torch.Tensor, probability: torch.Tensor) -> tuple[int, float]:
    """A 0-d token id and a 0-d probability to the host in one read (one sync, not two); ids are
    exact in float32 below 2**24."""
    token_id, value = torch.stack((token.float(), probability.float())).tolist()
    return int(token_id), value


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """The seeded generator of one generation, on the device whose tensors it draws."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
