"""The speculative decoding loop: prefill -> (propose -> verify in one pass -> accept -> roll back)*.

Invariant: the target's KV cache holds every committed token but the last; that last token (the
root) is fed again at the head of the next verify pass, together with the draft, so every pass
both checks the draft and yields the target's own next token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from localspec.runtime.attention import RowPlan
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.runtime.costs import CostModel
from localspec.runtime.decoder import use_exact_pass
from localspec.base.errors import LocalspecError, is_out_of_memory
from localspec.runtime.graphs import GraphRunner, capacity
from localspec.runtime.kv import CachedTokens, KVCache, common_prefix
from localspec.core.policy import DraftPolicy, Proposal
from localspec.core.proposers.base import Proposer
from localspec.core.proposers.ngram import NgramProposer
from localspec.runtime.quant import prompt_pass
from localspec.core.sampling import make_generator
from localspec.core.stats import GenerationStats, Opening, PassFigures
from localspec.core.tree import Draft, graft, verify_inputs, visible_rows
from localspec.core.verify import verify

PREFILL_CHUNK = 512
"""Prompt tokens per prefill pass: bounds the attention scratch memory of long prompts."""


@dataclass
class Piece:
    text: str
    token_id: int
    from_draft: bool
    """True when a proposer guessed this token and the target accepted it."""


@dataclass
class TokenEvent:
    """One target pass: the tokens it committed, with their text (possibly empty mid-character),
    and its figures (drafted, accepted and whose, seconds; the first pass's also the opening)."""

    pieces: list[Piece] = field(default_factory=list)
    figures: PassFigures = PassFigures()

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    def fold(self, so_far: GenerationStats) -> GenerationStats:
        """The answer's statistics up to this event, from those up to the one before (updated)."""
        so_far.add(self.figures)
        return so_far


@dataclass
class FinalEvent(TokenEvent):
    """The last pass's event, which also carries the generation's finished statistics."""

    stats: GenerationStats = field(default_factory=GenerationStats)

    def fold(self, so_far: GenerationStats) -> GenerationStats:
        return self.stats


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
        use_exact_pass(model)  # verify passes must compute each row as plain decoding would
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.costs = costs
        self.context_len = context_len or model.config.max_position_embeddings
        self.proposer_reason = proposer_reason
        self.device = next(model.parameters()).device
        self.eos = eos_ids(model, tokenizer) if tokenizer is not None else set()
        # on CUDA, decode and verify passes replay from CUDA graphs, over a cache that keeps its buffers
        self.graphs = GraphRunner(model) if self.device.type == "cuda" else None
        self.kv = KVCache(capacity(self.context_len) if self.graphs else 0)
        self.kv_tokens = CachedTokens(self.kv.truncate)
        # a model proposer also carries prompt lookup's guesses: free, and right where text repeats
        self.lookup = NgramProposer(spec.ngram_min, spec.ngram_max) if spec.lookup and proposer is not None and proposer.has_model else None
        self.policy = DraftPolicy(spec, costs)
        self.max_nodes = 64
        """Most draft nodes per pass; halved when a wide pass runs out of memory."""
        self.stats = GenerationStats()

    @property
    def proposer_name(self) -> str:
        return self.proposer.name if self.proposer else "none"

    def forget(self) -> None:
        """Drop the cached conversation: the next prompt is prefilled from scratch (benchmarks)."""
        self.kv_tokens.follow([])

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
            self.kv_tokens.restore()
            raise

    def _forward_unguarded(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, keep: int,
                           plan: RowPlan | None):
        if self.graphs is not None:
            logits = self.graphs.run(self.kv, ids, positions, plan, keep)  # None: this pass runs eagerly
            if self.graphs.off:
                self.stats.notices.append(self.graphs.off)
                self.graphs = None
            if logits is not None:
                return logits
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
        keep = self.kv_tokens.follow(target)
        for start in range(keep, len(target), PREFILL_CHUNK):
            chunk = target[start : start + PREFILL_CHUNK]
            ids = torch.tensor([chunk], dtype=torch.long)
            positions = torch.arange(start, start + len(chunk))[None]
            with prompt_pass():
                self._forward(ids, positions, None, keep=1)
            self.kv_tokens.extend(chunk)
            self._observe(start, None)

    def _propose(self, tokens: list[int], room: int, sampling: SamplingConfig, generator) -> Proposal:
        """This pass's guesses: at most room - 1 tokens, so the pass's own token fits too."""
        limit = min(room - 1, self.max_nodes)
        if self.proposer is None or limit <= 0 or not self.policy.allows:
            return Proposal(Draft.chain([]))
        try:
            if not self.proposer.has_model:
                guess = self._lookup_guess(self.proposer, tokens, limit, sampling, generator)
                return Proposal(guess, lookup=guess)
            guess = self._lookup_guess(self.lookup, tokens, limit, sampling, generator) if self.lookup else Draft.chain([])
            if len(guess) and self.policy.lookup_alone_pays(guess):
                self.stats.lookup_passes += 1
                return Proposal(guess, lookup=guess)
            wanted = self.policy.model_len(limit - len(guess), self.proposer.builds_trees)
            own = self.proposer.propose(tokens, wanted, sampling, generator, self.policy.stop_rule) if wanted > 0 else Draft.chain([])
            return Proposal(graft(own, guess.tokens), model=own, lookup=guess if len(guess) else None)
        except Exception as exc:  # a broken proposer must not end the stream: go on plainly
            self.stats.notices.append(f"proposer failed ({exc!r}); continuing with plain decoding")
            self.proposer.close()
            self.proposer = self.lookup = None
            return Proposal(Draft.chain([]))

    def _lookup_guess(self, lookup: Proposer, tokens: list[int], limit: int, sampling: SamplingConfig, generator) -> Draft:
        """A lookup guesses as far as it can for free; keep the prefix that pays for its label."""
        guess = lookup.propose(tokens, self.policy.chain_limit(limit), sampling, generator)
        return guess.first(self.policy.lookup_len(guess.label, len(guess)))

    def _credit(self, proposal: Proposal, accepted: list[int], seconds: float) -> None:
        """The policy, the proposer and the statistics learn whose guesses the pass accepted."""
        own = self.policy.judge(proposal, accepted, seconds)
        if proposal.model is not None:
            self.stats.lookup_accepted += len(accepted) - own
            self.stats.draft_steps += proposal.model.steps if proposal.model.steps is not None else len(proposal.model)
            if self.proposer is not None:
                self.proposer.judged(own)
        elif self.proposer is not None and self.proposer.has_model:
            self.stats.lookup_accepted += len(accepted)  # the lookup's guess was verified alone

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
        self.kv_tokens.extend([tokens[-1], *(draft.tokens[node] for node in verdict.accepted)])
        return draft, verdict

    # -- the loop -------------------------------------------------------------------------------

    def _speculative_step(self, tokens: list[int], room: int, sampling: SamplingConfig, generator) -> tuple[list[int], int]:
        """One target pass: guess, verify the guesses and take the target's own next token in one
        forward, learn from the verdict. Returns the accepted guesses and the target's token (room:
        tokens the answer may still take)."""
        if self.costs is not None:
            self.costs.context = len(self.kv)  # the costs that size this pass's draft are read here
        started = time.perf_counter()
        proposal = self._propose(tokens, room, sampling, generator)
        drafted = time.perf_counter()
        draft, verdict = self._verify_pass(tokens, proposal.draft, sampling, generator)
        verified = time.perf_counter()
        accepted = [draft.tokens[node] for node in verdict.accepted]
        self.stats.record_pass(len(draft), len(accepted), drafted - started, verified - drafted)
        if self.policy.guard is not None and (notice := self.policy.guard.record(len(draft), len(accepted) + 1, verified - started)):
            self.stats.notices.append(notice)
        self._credit(proposal, accepted, verified - started)
        return accepted, verdict.next_token

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
        disconnect, the chat's stop key) can stop between any two passes. Each event carries its
        pass's figures, the last one (a FinalEvent) the finished statistics."""
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
            proposer=self.proposer_name, reason=self.proposer_reason, prompt_tokens=len(tokens),
            cached_tokens=common_prefix(self.kv_tokens.ids, tokens[:-1]),  # what the prefill will keep
        )
        budget = min(limits.max_new_tokens, self.context_len - len(tokens))
        detok = Detokenizer(self.tokenizer, tokens) if self.tokenizer is not None else None
        scanner = StopScanner(limits.stop)
        produced = 0

        started = time.perf_counter()
        self._prefill(tokens)
        stats.prefill_seconds = time.perf_counter() - started
        opening = Opening(stats.proposer, stats.reason, stats.prompt_tokens, stats.cached_tokens, stats.prefill_seconds)
        noticed = 0  # notices already on an event (one raised in the prefill goes on the first)
        while True:
            before, produced_before = stats.counted(), produced  # the step counts into stats
            accepted, next_token = self._speculative_step(tokens, budget - produced, sampling, generator)
            plain = (len(accepted) + 1) * self.costs.verify(1) if self.costs is not None else 0.0

            new = [(token, True) for token in accepted] + [(next_token, False)]
            pieces: list[Piece] = []
            stop = ""
            for token, from_draft in new:
                if token in self.eos:
                    stop = "eos"
                    break
                tokens.append(token)
                produced += 1
                pieces += scanner.push(Piece(detok.push(token) if detok else "", token, from_draft))
                if scanner.stopped:
                    stop = "stop string"
                    break
                if produced >= budget:
                    stop = "max tokens" if produced >= limits.max_new_tokens else "context limit"
                    break
            if stop and not scanner.stopped:
                pieces += scanner.flush()
            # Tokens after a stop never happened; the cache entries past them are dropped by the
            # next prefill, which keeps only the prefix that matches the next prompt.
            figures = stats.counted().since(
                before, tokens=produced - produced_before, plain_seconds=plain, elapsed=time.perf_counter() - started,
                notices=tuple(stats.notices[noticed:]), opening=opening,
            )
            opening, noticed = None, len(stats.notices)
            stats.advance(figures)
            if stop:
                stats.stop_reason = stop
                yield FinalEvent(pieces, figures, stats)
                return
            # every pass, even one whose text is held back: a consumer can stop between any two
            yield TokenEvent(pieces, figures)
