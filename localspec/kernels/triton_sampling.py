"""Lossless rejection sampling over a draft chain or tree, fused into one Triton kernel (GPU).

The rule is localspec/verify.py's `verify_sampling` (Leviathan et al. 2023; Chen et al. 2023; the
multi-candidate tree form as in SpecInfer / EAGLE). Glossary, as there:
- accepted: drafted nodes the target keeps, the root's child first.
- recovered: after every child of a node was rejected, the token drawn from what the target still
  allows there.
- bonus: when the walk reaches a leaf, the target's own next token, drawn from p at that leaf.

Walk: from the root, try the current node's children in index order. Child x (drawn from q) is
accepted with probability min(1, p(x) / q(x)); deterministic guesses (no q, i.e. one-hot) with p(x).
On a rejection p becomes normalize(max(0, p - q)) (one-hot: p(x) = 0, renormalized) and the next
sibling is tried. The token that ends the walk (recovered or bonus) is drawn from the current p.

The random numbers come from the caller, so that the kernel and `rejection_sample_reference` can
be compared draw for draw: `accept_uniforms[i]` decides node i (each node is tried at most once),
`final_uniform` draws the last token by inverse CDF (the first token whose cumulative
probability exceeds u * total).

The host walk (`rejection_rule.walk`) needs the pass's (N+1) x V probabilities read back from the
GPU; the kernel reads back only the answer. It runs the whole walk in one program, looping over the vocabulary (~150k) in blocks for each residual and for the
final draw, and keeps the residual in a (V,) scratch buffer. Since parents come before children,
one pass over the nodes in index order meets the children of whichever node is current in
exactly the order the rule tries them.
"""

from __future__ import annotations

import torch

from localspec.kernels.rejection_rule import walk

from .triton_support import tl, triton_available, triton_jit

BLOCK_V = 1024
"""Vocabulary entries per step of the kernel's loops over V."""


def rejection_sample_reference(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    final_uniform: float | torch.Tensor,
) -> tuple[list[int], int]:
    """The rule as localspec/verify.py runs it (`rejection_rule.walk`, float32 throughout).

    target_probs (N+1, V): row 0 after the root, row i+1 after node i. tokens, parents (N,), a
    parent before its children, -1 for the root's children. draft_probs (N, V) or None (one-hot
    guesses). accept_uniforms (N,) and final_uniform in [0, 1). Returns (accepted node indices,
    next token).
    """
    uniforms = torch.cat((accept_uniforms.float().cpu(), torch.as_tensor(final_uniform, dtype=torch.float32).reshape(1)))
    q = None if draft_probs is None else draft_probs.float().numpy(force=True)
    return walk(target_probs.float().numpy(force=True), tokens.tolist(), parents.tolist(), q, uniforms.numpy())


@triton_jit
def _residual_block(src_ptr, total, q_ptr, token, start, V, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """max(0, p - q) on one block of the vocabulary, p = src / total; returns it with offsets and mask."""
    offs = start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    ok = offs < V
    p = tl.load(src_ptr + offs, mask=ok, other=0.0) / total  # (BLOCK_V,)
    if HAS_Q:
        q = tl.load(q_ptr + offs, mask=ok, other=0.0)  # (BLOCK_V,)
    else:
        q = (offs == token).to(tl.float32)  # one-hot: p(x) - 1 <= 0 clears x, the rest stays
    return tl.maximum(p - q, 0.0), offs, ok


@triton_jit
def _rejection_sample_kernel(
    target_ptr, stride_t,  # (N+1, V) float32
    draft_ptr, stride_d,  # (N, V) float32; not read when HAS_Q is False
    tokens_ptr, parents_ptr,  # (N,) int32
    uniforms_ptr,  # (N+1,) float32: one per node, then the final draw's
    scratch_ptr,  # (V,) float32: the residual, unnormalized (its sum is `total`)
    path_ptr,  # (N,) int32 out: accepted nodes, in order
    result_ptr,  # (2,) int32 out: number accepted, next token
    N, V,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # The current distribution is src / total: a row of target probs (total 1) until a rejection,
    # then the residual in scratch, kept unnormalized so that no pass is spent on normalizing.
    node = tl.full((), -1, tl.int32)
    in_scratch = tl.full((), 0, tl.int32)
    total = tl.full((), 1.0, tl.float32)
    accepted = tl.full((), 0, tl.int32)
    for i in range(0, N):
        if tl.load(parents_ptr + i) == node:
            src = scratch_ptr if in_scratch != 0 else target_ptr + (node + 1) * stride_t
            x = tl.load(tokens_ptr + i)
            px = tl.load(src + x) / total
            if HAS_Q:
                qx = tl.load(draft_ptr + i * stride_d + x)
                accept_prob = tl.minimum(px / tl.maximum(qx, 1e-20), 1.0)  # 1e-20: rejection_rule.MIN_Q
            else:
                accept_prob = px
            if tl.load(uniforms_ptr + i) < accept_prob:
                tl.store(path_ptr + accepted, i)
                accepted += 1
                node = i
                in_scratch = tl.full((), 0, tl.int32)
                total = tl.full((), 1.0, tl.float32)
            else:
                q_row = draft_ptr + i * stride_d
                rest_total = tl.full((), 0.0, tl.float32)
                for start in range(0, V, BLOCK_V):
                    rest, offs, ok = _residual_block(src, total, q_row, x, start, V, HAS_Q, BLOCK_V)
                    rest_total += tl.sum(rest)
                # p == q up to rounding: a rejection was (numerically) impossible, p stays as it is
                if rest_total > 0:
                    for start in range(0, V, BLOCK_V):
                        rest, offs, ok = _residual_block(src, total, q_row, x, start, V, HAS_Q, BLOCK_V)
                        tl.store(scratch_ptr + offs, rest, mask=ok)
                    # the next p(x) is one element read by every thread, written by any one of
                    # them: make the residual visible to the whole block first
                    tl.debug_barrier()
                    in_scratch = tl.full((), 1, tl.int32)
                    total = rest_total

    # recovered token (all children rejected) or bonus token (a leaf): either way, from src / total
    src = scratch_ptr if in_scratch != 0 else target_ptr + (node + 1) * stride_t
    mass = tl.full((), 0.0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        mass += tl.sum(tl.load(src + offs, mask=offs < V, other=0.0) / total)
    threshold = tl.load(uniforms_ptr + N) * mass
    below = tl.full((), 0.0, tl.float32)  # cumulative probability before this block
    first_above = tl.full((), V, tl.int32)  # V = none found yet
    last_nonzero = tl.full((), -1, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        ok = offs < V
        p = tl.load(src + offs, mask=ok, other=0.0) / total  # (BLOCK_V,)
        cdf = below + tl.cumsum(p, axis=0)  # (BLOCK_V,)
        first_above = tl.minimum(first_above, tl.min(tl.where(ok & (cdf > threshold), offs, V)))
        last_nonzero = tl.maximum(last_nonzero, tl.max(tl.where(p > 0, offs, -1)))
        below += tl.sum(p)
    # rounding can leave the threshold at the very top: then the last token p allows
    token = tl.where(first_above < V, first_above, last_nonzero)
    tl.store(result_ptr, accepted)
    tl.store(result_ptr + 1, token)


def rejection_sample(
    target_probs: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    final_uniform: float | torch.Tensor,
) -> tuple[list[int], int]:
    """`rejection_sample_reference` as one Triton program; same arguments, same answer.

    Tensors on a CUDA device, or on the CPU under TRITON_INTERPRET=1. Reading the answer back is
    the one host sync of the call.
    """
    if not triton_available():
        raise RuntimeError("rejection_sample needs triton (pip install 'triton>=3.0')")
    n = tokens.shape[0]
    vocab = target_probs.shape[-1]
    if target_probs.shape != (n + 1, vocab) or parents.shape != (n,) or accept_uniforms.shape != (n,):
        raise ValueError(
            f"expected target_probs (N+1, V), tokens, parents and accept_uniforms (N,); got "
            f"{tuple(target_probs.shape)}, {tuple(tokens.shape)}, {tuple(parents.shape)}, {tuple(accept_uniforms.shape)}"
        )
    if draft_probs is not None and draft_probs.shape != (n, vocab):
        raise ValueError(f"draft_probs must be (N, V) = ({n}, {vocab}), got {tuple(draft_probs.shape)}")
    # the kernel's single pass over the nodes relies on it
    if not bool(((parents >= -1) & (parents < torch.arange(n, device=parents.device))).all()):
        raise ValueError(f"each parent must be -1 or an earlier node, got {parents.tolist()}")
    device = target_probs.device
    target = target_probs.float().contiguous()  # (N+1, V)
    draft = target if draft_probs is None else draft_probs.float().contiguous()  # (N, V), or unread
    final = torch.as_tensor(final_uniform, dtype=torch.float32, device=device).reshape(1)  # (1,)
    uniforms = torch.cat((accept_uniforms.float().to(device), final))  # (N+1,)
    scratch = torch.empty(vocab, dtype=torch.float32, device=device)  # (V,)
    path = torch.empty(max(n, 1), dtype=torch.int32, device=device)  # (N,), at least one slot to point at
    result = torch.empty(2, dtype=torch.int32, device=device)  # number accepted, next token
    _rejection_sample_kernel[(1,)](
        target, target.stride(0),
        draft, draft.stride(0),
        tokens.to(device=device, dtype=torch.int32), parents.to(device=device, dtype=torch.int32),
        uniforms, scratch, path, result,
        n, vocab,
        HAS_Q=draft_probs is not None, BLOCK_V=BLOCK_V,
    )
    count, token, *path = torch.cat((result, path)).tolist()  # the one read of the call
    return path[:count], token
