"""The speculative decoding loop: prefill -> (propose -> verify in one pass -> accept -> roll back)*.

Invariant: the target's KV cache holds every committed token but the last; that last token (the
root) is fed again at the head of the next verify pass, together with the draft, so every pass
both checks the draft and yields the target's own next token.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from localspec.attention import RowPlan, use_exact_attention
from localspec.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.costs import AcceptanceTracker, CostModel, SpeedGuard
from localspec.errors import LocalspecError, is_out_of_memory
from localspec.kv import KVCache
from localspec.proposers.base import Proposer
from localspec.proposers.draft_model import common_prefix
from localspec.proposers.ngram import NgramProposer
from localspec.sampling import make_generator
from localspec.stats import GenerationStats
from localspec.tree import Draft, graft, matched_path, verify_inputs, visible_rows
from localspec.verify import verify

PREFILL_CHUNK = 512
"""Prompt tokens per prefill pass: bounds the attention scratch memory of long prompts."""


@dataclass
class Piece:
    text: str
    token_id: int
    from_draft: bool
    """True when a proposer guessed this token and the target accepted it."""


@dataclass
class Proposal:
    """What one pass verifies, and whose guesses it holds: each part is judged on its own."""

    draft: Draft
    model: Draft | None = None
    """The model proposer's own guesses (draft model, EAGLE), when it drafted this pass."""
    lookup: Draft | None = None
    """Prompt lookup's guesses (a chain), judged under their label."""


@dataclass
class TokenEvent:
    """Tokens committed by one target pass, with their text (possibly empty mid-character)."""

    pieces: list[Piece] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


class Detokenizer:
    """Incremental decoding: emits text only once the bytes of a character are complete."""

    def __init__(self, tokenizer, prompt_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-4:])  # a little left context so leading spaces decode right
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""


class StopScanner:
    """Holds back text that could still become a stop string; cuts the text at the first one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1  # characters that may start a stop
        self.text = ""  # everything pushed so far
        self.released = 0  # characters of self.text already handed out
        self.held: list[Piece] = []
        self.stopped = False

    def push(self, piece: Piece) -> list[Piece]:
        """Add a piece; return the pieces now known to be free of any stop string."""
        self.text += piece.text
        self.held.append(piece)
        hits = [i for i in (self.text.find(s, max(self.released - len(s), 0)) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._release_until(min(hits), cut=True)
        return self._release_until(len(self.text) - self.hold, cut=False)

    def flush(self) -> list[Piece]:
        return self._release_until(len(self.text), cut=True)

    def _release_until(self, end: int, cut: bool) -> list[Piece]:
        """Release whole held pieces ending at or before `end`; with cut, also the part of the
        next piece before `end` (the rest of the text is dropped)."""
        out = []
        while self.held:
            piece = self.held[0]
            if self.released + len(piece.text) <= end:
                out.append(self.held.pop(0))
                self.released += len(piece.text)
            elif cut:
                keep = max(end - self.released, 0)
                out.append(Piece(piece.text[:keep], piece.token_id, piece.from_draft))
                self.held.clear()
                self.released += keep
            else:
                break
        return out


def eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        proposer: Proposer | None,
        spec: SpecConfig = SpecConfig(),
        costs: CostModel | None = None,
        context_len: int | None = None,
        proposer_reason: str = "",
    ) -> None:
        self.model = model
        use_exact_attention(model)  # verify passes must compute each row as plain decoding would
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.spec = spec
        self.costs = costs
        self.context_len = context_len or model.config.max_position_embeddings
        self.proposer_reason = proposer_reason
        self.device = next(model.parameters()).device
        self.eos = eos_ids(model, tokenizer) if tokenizer is not None else set()
        self.kv = KVCache()
        self.kv_tokens: list[int] = []  # the token ids whose keys/values self.kv holds
        self.acceptance: dict[str, AcceptanceTracker] = defaultdict(AcceptanceTracker)
        # a model proposer also carries prompt lookup's guesses: free, and right where text repeats
        self.lookup = NgramProposer(spec.ngram_min, spec.ngram_max) if spec.lookup and proposer is not None and proposer.has_model else None
        self.model_rate: float | None = None
        """Tokens per second of the passes the model proposer drafted for (a running average)."""
        self.lookup_evidence: dict[str, AcceptanceTracker] = defaultdict(lambda: AcceptanceTracker(prior=0.0))
        """Per lookup label, acceptance believed only from what was seen: skipping the model on a
        guess is a bet, so it is made on evidence (the grafted branch gathers it for free)."""
        self.max_nodes = 64
        """Most draft nodes per pass; halved when a wide pass runs out of memory."""
        self.guard = SpeedGuard(costs) if costs is not None else None
        self.stats = GenerationStats()

    @property
    def proposer_name(self) -> str:
        return self.proposer.name if self.proposer else "none"

    def forget(self) -> None:
        """Drop the cached conversation: the next prompt is prefilled from scratch (benchmarks)."""
        self.kv.truncate(0)
        self.kv_tokens.clear()

    # -- prompt ---------------------------------------------------------------------------------

    def encode(self, prompt: str | list[dict], system: str | None = None) -> list[int]:
        """A prompt string or a list of chat messages -> token ids through the chat template."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system and not any(m.get("role") == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": system})
        if getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return self.tokenizer.encode("\n".join(m["content"] for m in messages))

    # -- target passes --------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, keep: int,
                 plan: RowPlan | None = None):
        """One target forward; if it is cut short (Ctrl-C, out of memory) the cache is put back to
        exactly the committed tokens, so the next pass or the next prompt starts from a sound state."""
        try:
            return self._forward_unguarded(ids, positions, mask, keep, plan)
        except BaseException:
            self.kv.truncate(len(self.kv_tokens))
            raise

    def _forward_unguarded(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, keep: int,
                           plan: RowPlan | None):
        out = self.model(
            input_ids=ids.to(self.device),
            position_ids=positions.to(self.device),
            attention_mask=None if mask is None else mask.to(self.device),
            cache=self.kv.cache,
            use_cache=True,
            logits_to_keep=keep,
            row_plan=plan,  # a tree pass: which keys each row sees, so the attention reads nothing back
        )
        return out.logits[0]  # (keep, V)

    def _prefill(self, tokens: list[int]) -> None:
        """Bring the cache to hold tokens[:-1], reusing the longest prefix it already holds."""
        target = tokens[:-1]
        keep = 0
        limit = min(len(self.kv_tokens), len(target))
        while keep < limit and self.kv_tokens[keep] == target[keep]:
            keep += 1
        self.kv.truncate(keep)
        del self.kv_tokens[keep:]
        for start in range(keep, len(target), PREFILL_CHUNK):
            chunk = target[start : start + PREFILL_CHUNK]
            ids = torch.tensor([chunk], dtype=torch.long)
            positions = torch.arange(start, start + len(chunk))[None]
            self._forward(ids, positions, None, keep=1)
            self.kv_tokens.extend(chunk)
            self._observe(start, None)

    def _lookup_len(self, label: str, limit: int) -> int:
        """Tokens of a lookup guess worth verifying: fixed, or the best expected rate under the
        measured verify costs (a lookup's guesses cost no draft steps) and the acceptance seen so
        far for this label."""
        if self.spec.draft_len is not None:
            wanted = self.spec.draft_len
        elif self.costs is not None:
            wanted = self.costs.best_draft_len(self.acceptance[label].rate, self.spec.max_draft_len, free=True)
        else:
            wanted = min(4, self.spec.max_draft_len)
        return max(0, min(wanted, limit))

    def _confidence_tracker(self, confidence: float) -> AcceptanceTracker:
        """How often guesses of about this confidence are accepted (ten bins, learned as we go).

        A sibling draft is accepted more often than its own confidence says (the two models share
        their doubts), so each bin starts halfway between its confidence and certainty, and the
        measurements take over from there.
        """
        b = min(int(confidence * 10), 9)
        label = f"confidence-{b}"
        if label not in self.acceptance:
            self.acceptance[label] = AcceptanceTracker(prior=(1 + (b + 0.5) / 10) / 2)
        return self.acceptance[label]

    def _worth_another(self, confidences: list[float]) -> bool:
        """Whether keeping the newest guess raises the expected tokens per second of this pass,
        with each guess's acceptance estimated from the bin of its confidence."""
        k = len(confidences)
        expected = [1.0]  # tokens this pass yields on average with 0, 1, ..., k guesses
        survive = 1.0
        for c in confidences:
            survive *= self._confidence_tracker(c).rate
            expected.append(expected[-1] + survive)
        step = self.costs.draft_step_seconds
        without = expected[k - 1] / ((k - 1) * step + self.costs.verify(k))
        with_it = expected[k] / (k * step + self.costs.verify(k + 1))
        if with_it > without:
            return True
        # a refused guess is never judged: let its bin drift back to its prior, so it is tried again
        self._confidence_tracker(confidences[-1]).update(0, 0)
        return False

    def _propose(self, tokens: list[int], room: int, sampling: SamplingConfig, generator) -> Proposal:
        """This pass's guesses: at most room - 1 tokens, so the pass's own token fits too."""
        nothing = Proposal(Draft.chain([]))
        if self.proposer is None or room <= 1 or (self.guard is not None and not self.guard.allows):
            return nothing
        limit = min(room - 1, self.max_nodes)
        try:
            if not self.proposer.has_model:
                guess = self._lookup_guess(self.proposer, tokens, limit, sampling, generator)
                return Proposal(guess, lookup=guess)
            guess = self._lookup_guess(self.lookup, tokens, limit, sampling, generator) if self.lookup else Draft.chain([])
            if len(guess) and self._lookup_alone_pays(guess):
                self.stats.lookup_passes += 1
                return Proposal(guess, lookup=guess)
            own = self._model_draft(tokens, limit - len(guess), sampling, generator)
            return Proposal(graft(own, guess.tokens), model=own, lookup=guess if len(guess) else None)
        except Exception as exc:  # a broken proposer must not end the stream: go on plainly
            self.stats.notices.append(f"proposer failed ({exc!r}); continuing with plain decoding")
            self.proposer.close()
            self.proposer = self.lookup = None
            return nothing

    def _lookup_guess(self, lookup: Proposer, tokens: list[int], limit: int, sampling: SamplingConfig, generator) -> Draft:
        """A lookup guesses as far as it can for free; keep the prefix that pays for its label."""
        guess = lookup.propose(tokens, min(limit, self.spec.draft_len or self.spec.max_draft_len), sampling, generator)
        return guess.first(self._lookup_len(guess.label, len(guess)))

    def _lookup_alone_pays(self, guess: Draft) -> bool:
        """Whether verifying the lookup's guess alone is expected to beat the model proposer's
        measured rate, so this pass need not spend the model's drafting time."""
        if self.costs is None or self.model_rate is None:
            return False
        return self.costs.expected_rate(self.lookup_evidence[guess.label].rate, len(guess), free=True) >= self.model_rate

    def _model_draft(self, tokens: list[int], limit: int, sampling: SamplingConfig, generator) -> Draft:
        if limit <= 0:
            return Draft.chain([])
        if self.proposer.builds_trees:  # sized by the proposer from the same measured costs
            return self.proposer.propose(tokens, limit, sampling, generator)
        if self.spec.draft_len is not None:
            return self.proposer.propose(tokens, min(self.spec.draft_len, limit), sampling, generator)
        # each guess costs a draft step: stop when the next is not worth it
        worth = self._worth_another if self.costs is not None else None
        return self.proposer.propose(tokens, min(limit, self.spec.max_draft_len), sampling, generator, worth)

    def _judge(self, proposal: Proposal, accepted: list[int], seconds: float) -> None:
        """Credit each part of the proposal with the accepted tokens it had guessed."""
        if proposal.lookup is not None:
            right = common_prefix(proposal.lookup.tokens, accepted)
            self.acceptance[proposal.lookup.label].update(len(proposal.lookup), right)
            self.lookup_evidence[proposal.lookup.label].update(len(proposal.lookup), right)
        if proposal.model is None:
            if self.proposer is not None and self.proposer.has_model:
                self.stats.lookup_accepted += len(accepted)
            return
        own = proposal.model
        path = matched_path(own, accepted)
        self.stats.lookup_accepted += len(accepted) - len(path)
        self.stats.draft_steps += own.steps if own.steps is not None else len(own)
        rate = (len(accepted) + 1) / seconds
        self.model_rate = rate if self.model_rate is None else 0.8 * self.model_rate + 0.2 * rate
        if own.is_chain:  # per guess: accepted ones succeeded, the first rejected one failed, later ones were never judged
            for i, confidence in enumerate(own.confidences[: len(path) + 1]):
                self._confidence_tracker(confidence).update(1, 1 if i < len(path) else 0)
        if self.proposer is not None:
            self.proposer.judged(len(path))

    def _observe(self, start: int, kept: list[int] | None) -> None:
        if self.proposer is None:
            return
        try:
            self.proposer.observe(start, kept)
        except Exception as exc:  # as in _propose: the answer goes on without the proposer
            self.stats.notices.append(f"proposer failed ({exc!r}); continuing with plain decoding")
            self.proposer.close()
            self.proposer = None

    def _verify_pass(self, tokens: list[int], draft: Draft, sampling: SamplingConfig, generator):
        """One target pass over root + draft; returns (draft actually verified, verdict).

        A pass that runs out of memory is retried with half the nodes, and later drafts stay that
        small: the answer goes on, only slower.
        """
        past = len(self.kv)
        while True:
            ids, positions, mask = verify_inputs(draft, tokens[-1], past)
            plan = None if mask is None else RowPlan.from_rows(past, visible_rows(draft), self.device)
            try:
                logits = self._forward(ids, positions, mask, keep=len(draft) + 1, plan=plan)  # (N+1, V)
                break
            except Exception as exc:  # out of memory in any of its forms (an MPS one is a RuntimeError)
                if not is_out_of_memory(exc) or len(draft) == 0:
                    raise
                self.max_nodes = len(draft) // 2
                self.stats.notices.append(f"out of memory verifying {len(draft)} drafted tokens; drafting at most {self.max_nodes} from now on")
                draft = draft.first(self.max_nodes)
        verdict = verify(draft, logits, sampling, generator)
        # keep the root and the accepted path; rejected nodes' entries go
        kept = [0] + [node + 1 for node in verdict.accepted]
        self.kv.keep(past, kept)
        self._observe(past, kept)
        self.kv_tokens.append(tokens[-1])
        self.kv_tokens.extend(draft.tokens[node] for node in verdict.accepted)
        return draft, verdict

    # -- the loop -------------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self,
        prompt: str | list[dict] | list[int],
        sampling: SamplingConfig = SamplingConfig(),
        limits: GenerationLimits = GenerationLimits(),
        system: str | None = None,
    ) -> Iterator[TokenEvent]:
        """Stream the answer: one TokenEvent per target pass (its pieces may be empty while a stop
        string or an unfinished character holds text back), so a consumer (the server on a
        disconnect, the chat's stop key) can stop between any two passes; self.stats is updated
        after every pass and final when this ends."""
        if isinstance(prompt, str) and not prompt.strip():
            raise LocalspecError("the prompt is empty")
        tokens = list(prompt) if prompt and isinstance(prompt[0], int) else self.encode(prompt, system)
        if not tokens:
            raise LocalspecError("the prompt is empty")
        if len(tokens) >= self.context_len:
            raise LocalspecError(
                f"the prompt is {len(tokens)} tokens; this model's context window is {self.context_len} "
                "tokens and the answer needs room: shorten the prompt"
            )
        generator = make_generator(sampling.seed, self.device)
        stats = self.stats = GenerationStats(
            proposer=self.proposer_name, reason=self.proposer_reason, prompt_tokens=len(tokens)
        )
        budget = min(limits.max_new_tokens, self.context_len - len(tokens))
        detok = Detokenizer(self.tokenizer, tokens) if self.tokenizer is not None else None
        scanner = StopScanner(limits.stop)
        produced = 0

        started = time.perf_counter()
        self._prefill(tokens)
        stats.prefill_seconds = time.perf_counter() - started
        first_at = None
        plain_seconds = 0.0  # what plain decoding's passes would have cost for the tokens so far
        while True:
            if self.costs is not None:
                self.costs.context = len(self.kv)  # the costs that size this pass's draft are read here
            t0 = time.perf_counter()
            proposal = self._propose(tokens, budget - produced, sampling, generator)
            t1 = time.perf_counter()
            draft, verdict = self._verify_pass(tokens, proposal.draft, sampling, generator)
            t2 = time.perf_counter()
            accepted = len(verdict.accepted)
            stats.record_pass(len(draft), accepted, t1 - t0, t2 - t1)
            if self.guard is not None and (notice := self.guard.record(len(draft), accepted + 1, t2 - t0)):
                stats.notices.append(notice)
            self._judge(proposal, [draft.tokens[n] for n in verdict.accepted], t2 - t0)
            if self.costs is not None:
                plain_seconds += (accepted + 1) * self.costs.verify(1)
                stats.plain_token_seconds = plain_seconds / (stats.passes + stats.accepted)

            new = [(draft.tokens[n], True) for n in verdict.accepted] + [(verdict.next_token, False)]
            event = TokenEvent()
            stop = ""
            for token, from_draft in new:
                if token in self.eos:
                    stop = "eos"
                    break
                tokens.append(token)
                produced += 1
                event.pieces += scanner.push(Piece(detok.push(token) if detok else "", token, from_draft))
                if scanner.stopped:
                    stop = "stop string"
                    break
                if produced >= budget:
                    stop = "max tokens" if produced >= limits.max_new_tokens else "context limit"
                    break
            if stop and not scanner.stopped:
                event.pieces += scanner.flush()
            # Tokens after a stop never happened; the cache entries past them are dropped by the
            # next prefill, which keeps only the prefix that matches the next prompt.
            stats.new_tokens = produced
            now = time.perf_counter()
            if first_at is None and produced:
                first_at = now
                stats.ttft_seconds = now - started
            if first_at is not None:
                stats.decode_seconds = now - first_at
            yield event  # every pass, even one whose text is held back: a consumer can stop between any two
            if stop:
                stats.stop_reason = stop
                return
