"""The speculative decoding loop: prefill, then one `_speculative_step` per target pass.

Invariant: the target's KV cache holds every committed token but the last; that last token (the
root) is fed again at the head of the next verify pass, together with the draft, so every pass
both checks the draft and yields the target's own next token.

The step, read top to bottom in one function: plan (the draft policy decides whether to draft,
prompt lookup's guess alone or the model's chain / tree with the guess grafted in, and every size),
one target pass over [root] + draft (`runtime/target_pass.py`), the acceptance rule (`verify`),
commit (the cache keeps the root and the accepted path, the proposer observes which entries
stayed), learn (the policy credits each part's guesses). Words: a draft's nodes are "guesses";
the ones the target agrees with are "accepted"; the target's own token after them ends every pass.
An out-of-memory pass is retried with half the nodes (and drafts stay that small); a pass cut short
puts the cache back to the committed tokens; a proposer that fails is dropped with a notice.

Log-probabilities, only when a generation asks for them (`logprobs`): the verify pass has the
target's logits at every position it commits (row 0 after the root, row node + 1 after an accepted
node), so each emitted token carries its exact log-probability under the target, whatever drafted
it. `echo` adds the prompt's own tokens; scored, they need every prompt row's logits, which the
prefill otherwise skips (`_prefill`'s `scored`).

Structured output, only when a generation asks for it (`grammar`): a `core.constraint.Constraint`
adds the tokens its grammar forces to a proposer's guesses, cuts the ones it forbids before the
pass and masks the pass's logits before the
acceptance rule (so log-probabilities are those of the distribution the grammar leaves); after the
commit it advances by the committed tokens, and a complete grammar ends the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import is_out_of_memory
from localspec.core.constraint import Constraint, grammar_vocabulary
from localspec.core.policy import DraftPolicy, Proposal
from localspec.core.prompt import chat_ids, check_ids, check_text
from localspec.core.proposers.base import Proposer
from localspec.core.proposers.ngram import NgramProposer
from localspec.core.events import FinalEvent, Likelihood, Piece, TokenEvent
from localspec.core.sampling import likelihoods, make_generator
from localspec.core.stats import GenerationStats, Opening, PassFigures
from localspec.core.tree import Draft, matched_path, verify_inputs, visible_rows
from localspec.core.verify import verify
from localspec.runtime.attention import RowPlan
from localspec.runtime.costs import CostModel
from localspec.runtime.kv import CachedTokens, common_prefix
from localspec.runtime.quant import prompt_pass
from localspec.runtime.target_pass import PREFILL_CHUNK, TargetPass


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
                out.append(replace(piece, text=piece.text[:keep]))
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
        clock: Callable[[], float] = time.perf_counter,
        lookup: Proposer | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.proposer = proposer
        self.costs = costs
        self.context_len = context_len or model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size
        """Token ids the model reads (a prompt sent as ids is checked against it)."""
        self.proposer_reason = proposer_reason
        self.eos = eos_ids(model, tokenizer) if tokenizer is not None else set()
        self.target_pass = TargetPass(model, notify=lambda notice: self.stats.notices.append(notice))
        self.device = self.target_pass.device
        self.kv = self.target_pass.new_cache(self.context_len)
        self.kv_tokens = CachedTokens(self.kv.truncate)
        # a model proposer also carries a lookup's guesses (prompt lookup, or `lookup`: suffix
        # decoding's over earlier conversations too): free, and right where text repeats
        carries = spec.lookup and proposer is not None and proposer.has_model
        self.lookup = (lookup or NgramProposer(spec.ngram_min, spec.ngram_max)) if carries else None
        self.policy = DraftPolicy(spec, costs)
        self.max_nodes = 64
        """Most draft nodes per pass; halved when a wide pass runs out of memory."""
        self.clock = clock
        """Seconds, for every figure the engine measures (a test gives a clock of its own)."""
        self.stats = GenerationStats()
        self.before_turn: Callable[[], None] | None = None
        """Called as each generation starts, before its prefill (the session's look at the machine
        between turns: how many cores are free now)."""
        self.vocabulary = None
        """The tokenizer as the grammar library reads it, built for the first constrained answer."""

    @property
    def proposer_name(self) -> str:
        return self.proposer.name if self.proposer else "none"

    def forget(self) -> None:
        """Drop the cached conversation: the next prompt is prefilled from scratch (benchmarks)."""
        self.kv_tokens.follow([])

    # -- prompt ---------------------------------------------------------------------------------

    def encode(self, prompt: str | list[dict], system: str | None = None, tools: list[dict] | None = None) -> list[int]:
        """A prompt string or a list of chat messages (and the tools it may call) -> token ids through
        the chat template."""
        return chat_ids(self.tokenizer, prompt, system, tools)

    # -- the step --------------------------------------------------------------------------------

    def _speculative_step(self, tokens: list[int], room: int, sampling: SamplingConfig, generator,
                          logprobs: int | None = None, constraint: Constraint | None = None,
                          ) -> tuple[list[int], int, list[Likelihood] | None]:
        """One target pass, top to bottom: plan the draft, verify it and take the target's own next
        token in the same pass, commit what was accepted, learn. Returns the accepted guesses, the
        target's token and, with `logprobs` (alternatives per token), the likelihoods of those
        tokens (room: tokens the answer may still take). A `constraint` (structured output) cuts
        the guesses its grammar forbids and masks the target's logits before the acceptance rule."""
        started = self.clock()
        past = len(self.kv)  # every committed token but the last, the root
        if self.costs is not None:
            self.costs.context = past  # the costs that size this pass's draft are read here
        # 1. plan: the policy decides lookup or model and the draft's size; the pass's own token needs room too
        limit = min(room - 1, self.max_nodes)
        proposal = self._guarded(self.policy.plan, Proposal(Draft.chain([])), self.proposer, self.lookup, tokens,
                                 limit, sampling, generator)
        draft, allowed = proposal.draft, None
        if constraint is not None:  # the grammar's forced tokens join a proposer's guesses; forbidden ones go
            forced = constraint.with_forced(draft, limit) if self.proposer is not None else draft
            draft, allowed = constraint.prune(forced, sampling.greedy)  # allowed (N+1, V) bool
        drafted = self.clock()
        # 2. one target pass over [root] + draft; out of memory: half the nodes, now and from then on
        while True:
            ids, positions, mask = verify_inputs(draft, tokens[-1], past)  # (1, N+1) each; a tree's mask (1, 1, N+1, past+N+1)
            plan = None if mask is None else RowPlan.from_rows(past, visible_rows(draft), self.device)
            try:
                logits = self._pass(ids, positions, len(draft) + 1, mask, plan)  # (N+1, V)
                break
            except Exception as exc:  # out of memory in any of its forms (an MPS one is a RuntimeError)
                if not is_out_of_memory(exc) or len(draft) == 0:
                    raise
                self.max_nodes = len(draft) // 2
                self.stats.notices.append(f"out of memory verifying {len(draft)} drafted tokens; drafting at most {self.max_nodes} from now on")
                draft = draft.first(self.max_nodes)
        if allowed is not None:  # the grammar's tokens only, for greedy and sampling alike
            logits = logits.masked_fill(~allowed[: len(draft) + 1].to(logits.device), float("-inf"))  # (N+1, V)
        # 3. the acceptance rule: the path the target agrees with (greedy, or lossless rejection sampling), then its own token
        verdict = verify(draft, logits, sampling, generator)
        accepted = [draft.tokens[node] for node in verdict.accepted]
        rows = [0] + [node + 1 for node in verdict.accepted]  # the pass rows each committed token was read from
        scored = None if logprobs is None else likelihoods(logits[rows], [*accepted, verdict.next_token], logprobs)
        # 4. commit: the root and the accepted path stay in the cache (pass rows 0 and node + 1), the rejected nodes go
        self._commit(past, [tokens[-1], *accepted], rows)
        if constraint is not None:
            constraint.advance([*accepted, verdict.next_token])
        verified = self.clock()
        # 5. learn: the policy credits each part's guesses; the statistics and the kill switch count the pass
        own = self.policy.learn(proposal, accepted, verified - started)  # the model's own accepted guesses, or None
        self.stats.record_pass(len(draft), len(accepted), drafted - started, verified - drafted)
        if self.costs is not None:
            self.stats.expected_verify_seconds += self.costs.verify(len(draft) + 1)
        if proposal.model is not None:
            self.stats.lookup_accepted += len(accepted) - own
            self.stats.draft_steps += proposal.model.steps if proposal.model.steps is not None else len(proposal.model)
        elif proposal.skipped_model:
            self.stats.lookup_passes += 1
            self.stats.lookup_accepted += len(accepted)
        if proposal.lookup is not None and proposal.lookup.history:
            self.stats.history_passes += 1
            self.stats.history_accepted += len(matched_path(proposal.lookup, accepted))
        if self.policy.guard is not None and (notice := self.policy.guard.record(len(draft), len(accepted) + 1, verified - started)):
            self.stats.notices.append(notice)
        return accepted, verdict.next_token, scored

    # -- what the step is made of -----------------------------------------------------------------

    def _pass(self, ids: torch.Tensor, positions: torch.Tensor, logit_rows: int, mask: torch.Tensor | None = None,
              plan: RowPlan | None = None) -> torch.Tensor:
        """One target pass -> logits (logit_rows, V); if it is cut short (Ctrl-C, out of memory) the
        cache is put back to exactly the committed tokens, so the next pass or the next prompt
        starts from a sound state."""
        try:
            return self.target_pass(self.kv, ids, positions, logit_rows, mask, plan)
        except BaseException:
            self.kv_tokens.restore()
            raise

    def _commit(self, start: int, tokens: list[int], kept: list[int] | None) -> None:
        """A pass from cache entry `start` committed `tokens`: its rows `kept` stay in the cache and
        the rest go (None: every row, a prefill chunk), and the proposer sees which stayed."""
        if kept is not None:
            self.kv.keep(start, kept)
        self.kv_tokens.extend(tokens)
        if self.proposer is not None:
            self._guarded(self.proposer.observe, None, start, kept)

    def _guarded(self, work, fallback, *args):
        """A proposer's part of the work: one that fails must not end the answer, so it is closed
        and the answer goes on with plain decoding."""
        try:
            return work(*args)
        except Exception as exc:
            self.stats.notices.append(f"proposer failed ({exc!r}); continuing with plain decoding")
            self.proposer.close()
            self.proposer = self.lookup = None
            return fallback

    def _prefill(self, tokens: list[int], scored: int | None = None) -> list[Likelihood]:
        """Bring the cache to hold tokens[:-1], reusing the longest prefix it already holds. With
        `scored` (alternatives per token) every row's logits are kept and the likelihoods of
        tokens[1:] returned; the cache is then filled from the start, since a reused prefix has no logits."""
        prompt = tokens[:-1]
        reused = self.kv_tokens.follow(prompt if scored is None else [])
        found: list[Likelihood] = []
        for start in range(reused, len(prompt), PREFILL_CHUNK):
            chunk = prompt[start : start + PREFILL_CHUNK]
            ids = torch.tensor([chunk], dtype=torch.long)  # (1, C)
            positions = torch.arange(start, start + len(chunk))[None]  # (1, C)
            with prompt_pass():
                logits = self._pass(ids, positions, logit_rows=1 if scored is None else len(chunk))  # (1 or C, V)
            if scored is not None:  # row i: the distribution of the token after chunk[i]
                found += likelihoods(logits, tokens[start + 1 : start + 1 + len(chunk)], scored)
            self._commit(start, chunk, None)
        return found

    def _echo(self, tokens: list[int], scored: list[Likelihood] | None) -> list[Piece]:
        """The prompt's tokens as pieces, with their likelihoods when scored (the first has none)."""
        detok = Detokenizer(self.tokenizer, []) if self.tokenizer is not None else None
        found = [None, *scored] if scored is not None else [None] * len(tokens)
        return [Piece(detok.push(token) if detok else "", token, False, likelihood) for token, likelihood in zip(tokens, found)]

    def _constraint(self, grammar: str) -> Constraint:
        """An answer's grammar at its start (the tokenizer as the grammar reads it is built once)."""
        if self.vocabulary is None:
            self.vocabulary = grammar_vocabulary(self.tokenizer, self.eos, self.vocab_size)
        return Constraint(grammar, self.vocabulary, self.eos, self.vocab_size)

    @torch.inference_mode()
    def score(self, prompt: list[int], logprobs: int | None = None) -> Iterator[TokenEvent]:
        """The prompt alone, no answer (`echo` with max_tokens 0): one FinalEvent whose `echoed`
        pieces are the prompt's tokens, each with its likelihood when `logprobs` asks for them."""
        cached = 0 if logprobs is not None else common_prefix(self.kv_tokens.ids, prompt[:-1])  # scored: prefilled from the start
        stats = self.stats = GenerationStats(proposer=self.proposer_name, reason=self.proposer_reason, prompt_tokens=len(prompt),
                                             cached_tokens=cached, stop_reason="max tokens")
        started = self.clock()
        scored = self._prefill(prompt, logprobs)
        stats.prefill_seconds = self.clock() - started
        yield FinalEvent(figures=PassFigures(elapsed=stats.prefill_seconds, notices=tuple(stats.notices)), stats=stats,
                         echoed=self._echo(prompt, None if logprobs is None else scored))

    @torch.inference_mode()
    def generate(
        self,
        prompt: str | list[dict] | list[int],
        sampling: SamplingConfig = SamplingConfig(),
        limits: GenerationLimits = GenerationLimits(),
        system: str | None = None,
        logprobs: int | None = None,
        echo: bool = False,
        grammar: str | None = None,
    ) -> Iterator[TokenEvent]:
        """Stream the answer: one TokenEvent per target pass (its pieces may be empty while a stop
        string or an unfinished character holds text back), so a consumer (the server on a
        disconnect, the chat's stop key) can stop between any two passes. Each event carries its
        pass's figures, the last one (a FinalEvent) the finished statistics. `logprobs`: each piece
        also carries its token's likelihood with that many alternatives; `echo`: the first event
        also carries the prompt's tokens (scored too, with `logprobs`); `grammar` (from
        `constraint.json_grammar`): the answer is held to it, and ends where it ends."""
        if isinstance(prompt, str):
            check_text(prompt)
        tokens = list(prompt) if prompt and isinstance(prompt[0], int) else self.encode(prompt, system)
        check_ids(tokens, self.context_len)
        generator = make_generator(sampling.seed, self.device)
        constraint = self._constraint(grammar) if grammar is not None else None
        if self.before_turn is not None:
            self.before_turn()
        scoring = logprobs if echo else None  # the prompt's own tokens scored: a prefill that keeps nothing cached
        stats = self.stats = GenerationStats(
            proposer=self.proposer_name, reason=self.proposer_reason, prompt_tokens=len(tokens),
            cached_tokens=0 if scoring is not None else common_prefix(self.kv_tokens.ids, tokens[:-1]),  # what the prefill will keep
        )
        budget = min(limits.max_new_tokens, self.context_len - len(tokens))
        detok = Detokenizer(self.tokenizer, tokens) if self.tokenizer is not None else None
        scanner = StopScanner(limits.stop)
        produced = 0

        started = self.clock()
        scored = self._prefill(tokens, scoring)
        echoed = self._echo(tokens, scored if scoring is not None else None) if echo else []
        stats.prefill_seconds = self.clock() - started
        opening = Opening(stats.proposer, stats.reason, stats.prompt_tokens, stats.cached_tokens, stats.prefill_seconds)
        noticed = 0  # notices already on an event (one raised in the prefill goes on the first)
        while True:
            before, produced_before = stats.counted(), produced  # the step counts into stats
            accepted, next_token, found = self._speculative_step(tokens, budget - produced, sampling, generator, logprobs, constraint)
            plain = (len(accepted) + 1) * self.costs.verify(1) if self.costs is not None else 0.0

            new = [(token, True) for token in accepted] + [(next_token, False)]
            pieces: list[Piece] = []
            stop = ""
            for i, (token, from_draft) in enumerate(new):
                if token in self.eos:
                    stop = "eos"
                    break
                tokens.append(token)
                produced += 1
                likelihood = found[i] if found is not None else None
                pieces += scanner.push(Piece(detok.push(token) if detok else "", token, from_draft, likelihood))
                if scanner.stopped:
                    stop = "stop string"
                    break
                if produced >= budget:
                    stop = "max tokens" if produced >= limits.max_new_tokens else "context limit"
                    break
            if stop in ("", "eos") and constraint is not None and constraint.finished:
                stop = "grammar"  # complete: only an EOS could follow, so no pass is spent on one
            if stop and not scanner.stopped:
                pieces += scanner.flush()
            # Tokens after a stop never happened; the cache entries past them are dropped by the
            # next prefill, which keeps only the prefix that matches the next prompt.
            figures = stats.counted().since(
                before, tokens=produced - produced_before, plain_seconds=plain, elapsed=self.clock() - started,
                notices=tuple(stats.notices[noticed:]), opening=opening,
            )
            opening, noticed = None, len(stats.notices)
            stats.advance(figures)
            if stop:
                stats.stop_reason = stop
                yield FinalEvent(pieces, figures, stats, echoed=echoed)
                # after the answer is out: a proposer that learns from finished conversations
                # (suffix decoding's index) may take a moment to keep this one
                for proposer in {self.proposer, self.lookup} - {None}:
                    self._guarded(proposer.finished, None, tokens)
                return
            # every pass, even one whose text is held back: a consumer can stop between any two
            yield TokenEvent(pieces, figures, echoed=echoed)
            echoed = []
