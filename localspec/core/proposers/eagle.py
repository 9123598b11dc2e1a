"""EAGLE proposer: a one-layer head reads the target's own hidden states and drafts a tree.

Features come free with the target's passes: hooks on the target copy the hidden states the head
reads (EAGLE-3: the residual stream entering three layers; EAGLE-1: the final normed state) during
every prefill and verify pass, and the engine says which positions were committed (`observe`).

Each pass (EAGLE-2's dynamic tree): the head catches up on the newly committed positions, then
expands the `top_k` best nodes level by level, scoring each node by its cumulative draft
log-probability; the best `nodes` of everything it saw form the tree the target verifies in one
pass. How deep to go and how many nodes to keep is the draft policy's to say (core/policy.py,
asked through `DraftRules`): a level is drafted only while the probability mass it can add pays
for one more head step, and the node count maximises expected tokens per second under the
measured cost of a verify pass of that width, with the head's scores calibrated by the acceptance
actually seen. A fixed `nodes` or `depth` given here overrides it.
"""

from __future__ import annotations

import math
import time

import torch

from localspec.base.config import SamplingConfig
from localspec.core.proposers.base import DraftRules, Proposer
from localspec.core.proposers.eagle_head import EagleHead
from localspec.core.tree import Draft
from localspec.runtime.kv import CachedTokens, SlotLayer, Slots


class FeatureTap:
    """Hooks that keep the hidden states the head reads from the target's latest forward."""

    def __init__(self, target: torch.nn.Module, aux_layers: tuple[int, ...]) -> None:
        base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
        self.captured: dict[int, torch.Tensor] = {}
        self.order = list(aux_layers) or ["final"]
        self.handles = []
        if aux_layers:
            for index in aux_layers:
                # a layer's input is its first norm's input; hooked there, the tap also sees the
                # lean pass (localspec/decoder.py), which runs the norms but not the layer modules
                norm = base.layers[index].input_layernorm
                self.handles.append(norm.register_forward_pre_hook(self._grab_input(index), with_kwargs=True))
        else:
            self.handles.append(base.norm.register_forward_hook(self._grab_output("final")))

    def _grab_input(self, key):
        def hook(module, args, kwargs):
            self.captured[key] = args[0] if args else kwargs["hidden_states"]  # (1, T, Ht): the layer's input

        return hook

    def _grab_output(self, key):
        def hook(module, args, output):
            self.captured[key] = output  # (1, T, Ht)

        return hook

    def take(self) -> torch.Tensor:
        """(T, feature width) of the latest forward, low -> mid -> high layer."""
        parts = [self.captured[key][0] for key in self.order]
        self.captured.clear()
        return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


class EagleProposer(Proposer):
    name = "eagle"
    has_model = True
    builds_trees = True

    def __init__(self, head: EagleHead, target: torch.nn.Module,
                 top_k: int = 8, nodes: int | None = None, depth: int | None = None, max_depth: int = 12) -> None:
        self.head = head
        self.tap = FeatureTap(target, head.cfg.aux_layers)
        self.top_k, self.fixed_nodes, self.fixed_depth, self.max_depth = top_k, nodes, depth, max_depth
        self.device = head.fc.weight.device
        self.features = Slots()  # (S, F): one per committed cache entry of the target
        # the head's keys/values: committed positions, then (while drafting) the tree's levels
        self.cache = SlotLayer()
        self.head_tokens = CachedTokens(self.cache.set_length, lookahead=1)  # position t read token t + 1

    def close(self) -> None:
        self.tap.remove()

    # -- features from the target's passes ---------------------------------------------------

    def observe(self, start: int, kept: list[int] | None) -> None:
        """The target's latest pass wrote cache entries from `start`; `kept` (indices into the
        pass, None = all) are the ones now committed. Their features are kept in the same order."""
        new = self.tap.take().to(self.device, self.head.dtype)  # (T, F)
        if kept is not None:
            new = new[torch.tensor(kept, device=self.device)]
        self.features.write(start, new)

    # -- drafting -------------------------------------------------------------------------------

    def _catch_up(self, tokens: list[int]) -> torch.Tensor:
        """Run the head over committed positions it has not seen; returns its output at the last
        one, (1, h), whose logits guess the token after `tokens`."""
        n = len(tokens)
        reused = self.head_tokens.follow(tokens, at_most=n - 2)
        hidden = self.features.filled[reused : n - 1][None]  # (1, T, F)
        ids = torch.tensor([tokens[reused + 1 : n]], device=self.device)  # (1, T)
        positions = torch.arange(reused, n - 1, device=self.device)[None]  # (1, T)
        out, k, v = self.head(hidden, ids, positions, self.cache.keys, self.cache.values)
        self.cache.update(k, v)
        self.head_tokens.extend(tokens[reused + 1 : n])
        return out[:, -1]  # (1, h)

    def _node_count(self, probs: list[float], depth: int, limit: int, rules: DraftRules | None) -> int:
        """How many candidates (path probabilities `probs`, most likely first) the tree keeps
        after `depth` head steps: the fixed count, else the policy's."""
        if self.fixed_nodes is not None:
            return min(self.fixed_nodes, limit, len(probs))
        if rules is None:
            return min(limit, len(probs))
        return rules.tree_nodes(probs, depth, limit)

    def _deeper(self, scores: list[float], frontier: list[int], depth: int, limit: int, rules: DraftRules | None) -> bool:
        """Whether to draft one more level: to the fixed depth, else while the policy says it pays."""
        if self.fixed_depth is not None or rules is None:
            return True
        probs = sorted((math.exp(s) for s in scores), reverse=True)
        return rules.another_level(probs, self._node_count(probs, depth, limit, rules), [math.exp(scores[c]) for c in frontier],
                                   depth, limit)

    @torch.inference_mode()
    def propose(
        self, tokens: list[int], max_len: int, sampling: SamplingConfig, generator: torch.Generator,
        rules: DraftRules | None = None,
    ) -> Draft:
        # The engine's cache holds tokens[:-1]; a new prompt that shares a prefix with the last
        # conversation only truncates it (no pass), so features past that prefix are stale.
        self.features.cut(len(tokens) - 1)
        if max_len <= 0 or self.features.length != len(tokens) - 1 or len(tokens) < 2:
            return Draft.chain([])
        last = self._catch_up(tokens)  # (1, h)
        stable = self.cache.length
        k = max(1, min(self.top_k, max_len))
        logp = torch.log_softmax(self.head.logits(last).float(), dim=-1)[0]  # (Vd,)
        top = torch.topk(logp, k)
        # one read per level (draft-vocabulary ids are exact in float32)
        read = torch.cat((top.indices.float(), top.values)).tolist()
        # every candidate seen: draft-vocabulary token, parent candidate (-1 = root), score, depth
        cand_tokens: list[int] = [int(t) for t in read[:k]]
        cand_parent: list[int] = [-1] * k
        cand_score: list[float] = read[k:]
        cand_logp: list[float] = read[k:]
        cand_depth: list[int] = [1] * k
        frontier = list(range(k))  # candidates to expand next
        frontier_hidden = last.expand(k, -1)  # (k, h): the output whose logits proposed each frontier node
        tree_rows: list[int] = []  # candidate index of each expanded entry
        visible = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # (m, m): entry sees entry
        depth = 1
        max_depth = self.fixed_depth or min(self.max_depth, max_len)
        while depth < max_depth:
            if not self._deeper(cand_score, frontier, depth, max_len, rules):
                break
            t0 = time.perf_counter()
            m = len(tree_rows)
            # attention: the committed context, the frontier node's ancestors among expanded entries, itself
            rows = torch.zeros(len(frontier), m + len(frontier), dtype=torch.bool, device=self.device)
            for i, c in enumerate(frontier):
                parent = cand_parent[c]
                if parent >= 0:
                    rows[i, :m] = visible[tree_rows.index(parent)]
                rows[i, m + i] = True
            mask = torch.cat([torch.ones(len(frontier), stable, dtype=torch.bool, device=self.device), rows], dim=1)[None]
            ids = torch.tensor([[cand_tokens[c] for c in frontier]], device=self.device)
            ids = self.head.to_target_ids(ids)
            positions = torch.full((1, len(frontier)), len(tokens) - 2 + depth, device=self.device)
            # past: the committed entries, then the expanded candidates' (m of them)
            out, nk, nv = self.head(frontier_hidden[None], ids, positions, self.cache.keys, self.cache.values, mask)  # out (1, f, h)
            self.cache.update(nk, nv)
            grown = torch.zeros(m + len(frontier), m + len(frontier), dtype=torch.bool, device=self.device)
            grown[:m, :m] = visible
            grown[m:] = rows
            visible = grown
            tree_rows.extend(frontier)
            child_logp = torch.log_softmax(self.head.logits(out[0]).float(), dim=-1)  # (f, Vd)
            child = torch.topk(child_logp, k, dim=-1)  # (f, k)
            parent_scores = torch.tensor([cand_score[c] for c in frontier], device=child.values.device)
            scores = (parent_scores[:, None] + child.values).flatten()  # (f * k,)
            best = torch.topk(scores, min(k, scores.numel())).indices  # (k,): the next frontier
            frontier_hidden = out[0][best // k]  # (k, h): each new frontier node's parent output
            n = scores.numel()
            read = torch.cat((child.indices.flatten().float(), scores, child.values.flatten(), best.float())).tolist()
            depth += 1
            first_new = len(cand_tokens)
            cand_tokens += [int(t) for t in read[:n]]
            cand_parent += [c for c in frontier for _ in range(k)]
            cand_score += read[n : 2 * n]
            cand_logp += read[2 * n : 3 * n]
            cand_depth += [depth] * n
            frontier = [first_new + int(b) for b in read[3 * n :]]
            if rules is not None:
                rules.timed_level(time.perf_counter() - t0)
        self.cache.set_length(stable)  # the tree's entries go; the committed ones stay

        order = sorted(range(len(cand_tokens)), key=lambda c: -cand_score[c])
        probs = [math.exp(cand_score[c]) for c in order]
        chosen = set(order[: self._node_count(probs, depth, max_len, rules)])
        chosen = {c for c in chosen if all(a in chosen for a in self._ancestors(c, cand_parent))}
        # parents first (by depth), most likely sibling first: the order the acceptance rule tries them
        picked = sorted(chosen, key=lambda c: (cand_depth[c], -cand_score[c]))
        index = {c: i for i, c in enumerate(picked)}
        target_ids = self.head.to_target_ids(torch.tensor([cand_tokens[c] for c in picked], dtype=torch.long, device=self.device)).tolist()
        return Draft(
            target_ids, [index[cand_parent[c]] if cand_parent[c] >= 0 else -1 for c in picked],
            label="eagle", confidences=[math.exp(cand_logp[c]) for c in picked], steps=depth,
        )

    @staticmethod
    def _ancestors(c: int, parents: list[int]) -> list[int]:
        out = []
        while parents[c] >= 0:
            c = parents[c]
            out.append(c)
        return out
