"""Structured output: decoding held to a grammar (a JSON schema, any JSON object) that stays
lossless under speculation. The grammar library is llguidance (its matcher gives the allowed
tokens after any prefix, consumes and rolls back tokens); it is imported only when a constraint is
built, so a run without one never loads it.

The contract, per target pass (`Engine._speculative_step`):
- `Constraint.with_forced(draft, room)` grafts the tokens the grammar forces next onto a
  proposer's draft as one more fixed branch (nothing for plain decoding, which stays one token a pass);
- `Constraint.prune(draft, greedy)` walks the draft from the committed state (consume a node,
  read the allowed tokens after it, descend, roll back) and returns the draft without the nodes
  the grammar forbids (the branch below each goes too), with the allowed tokens at every verify
  row of what remains: (N'+1, V) bool, row 0 after the root, row i + 1 after node i.
- the engine masks the target's logits with those rows before the acceptance rule, so the greedy
  argmax and the sampling probabilities are both the target's own constrained distribution;
- `Constraint.advance(tokens)` after the commit moves the matcher by exactly the committed tokens;
  `finished` (the grammar is complete and allows nothing more) ends the answer as EOS would.

Why the output stays exactly plain constrained decoding's. Greedy: each row's masked argmax is what
plain constrained decoding picks after that prefix, and a forbidden guess could never equal it.
Sampling: a fixed guess (one-hot q) the grammar forbids is rejected with certainty and leaves p as
it was (p(x) = 0, so max(0, p - one-hot(x)) = p): cutting it changes nothing. A node the proposer
sampled from its own q is different: its rejection moves p to normalize(max(0, p - q)), and the
rule is exact only with that step, so a forbidden sampled node stays in the draft as a leaf (its
row unmasked: it is never accepted, so nothing reads it); only its branch goes.

The allowed tokens include the end-of-sequence tokens exactly when the grammar may end there; they
are the engine's own EOS ids, so the engine's EOS check ends the answer as usual.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from localspec.base.errors import LocalspecError
from localspec.core.tree import Draft, graft

ANY_OBJECT = {"type": "object"}
"""`response_format: json_object`: any JSON object."""
WHITESPACE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,20}"}
"""Between JSON's tokens: room for pretty printing (a newline and the indentation of a deep line),
not for the endless run of blanks a model can fall into when any amount is allowed."""


def json_grammar(schema: dict | None = None) -> str:
    """A JSON schema (None: any JSON object) as a grammar a `Constraint` runs; a schema the
    library cannot compile is a LocalspecError in one line."""
    from llguidance import LLMatcher

    if not isinstance(schema if schema is not None else ANY_OBJECT, dict):
        raise LocalspecError(f"a JSON schema must be an object, got {json.dumps(schema)[:40]}")
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema if schema is not None else ANY_OBJECT, defaults=WHITESPACE)
    except ValueError as exc:
        raise LocalspecError(f"invalid JSON schema: {_one_line(exc)}") from None
    problem = LLMatcher.validate_grammar(grammar)
    if problem:
        raise LocalspecError(f"invalid JSON schema: {_one_line(problem)}")
    return grammar


def grammar_vocabulary(tokenizer, eos: set[int], vocab: int):
    """The tokenizer as the grammar library reads it (about a second to build: keep it), with the
    engine's EOS ids as the grammar's end and `vocab` (the logits' width) as its size."""
    import llguidance.hf

    if not eos:
        raise LocalspecError("structured output needs a model with an end-of-sequence token")
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab, len(tokenizer)), eos_token=sorted(eos))
    except (ValueError, TypeError, AttributeError) as exc:
        raise LocalspecError(f"structured output needs a fast (Rust) Hugging Face tokenizer: {_one_line(exc)}") from None


class Constraint:
    """One answer's grammar, at the committed tokens."""

    def __init__(self, grammar: str, vocabulary, eos: set[int], vocab: int) -> None:
        from llguidance import LLMatcher

        self.matcher = LLMatcher(vocabulary, grammar, log_level=0)
        if self.matcher.is_error():
            raise LocalspecError(f"invalid grammar: {_one_line(self.matcher.get_error())}")
        self.eos, self.vocab = eos, vocab
        self.words = (vocabulary.vocab_size + 31) // 32  # the mask's 32-bit words per row

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end."""
        return self.matcher.is_stopped()

    def with_forced(self, draft: Draft, room: int) -> Draft:
        """`draft` and, as one more branch from the root, the tokens the grammar forces next (a
        schema's keys and punctuation), within `room` nodes: free guesses, which the target's
        constrained distribution accepts unless it spells the same text with other tokens."""
        forced = self.matcher.compute_ff_tokens()[: max(room - len(draft), 0)]
        return graft(draft, forced) if forced else draft

    def prune(self, draft: Draft, greedy: bool) -> tuple[Draft, torch.Tensor]:
        """The draft without the nodes the grammar forbids (`greedy`: every one; sampling: the
        fixed guesses, a sampled node stays as a leaf, see the module's docstring), and the allowed
        tokens at each verify row of it: (N'+1, V) bool on the CPU."""
        words = np.full((len(draft) + 1, self.words), -1, dtype=np.int32)  # (N+1, W) bits: all allowed
        self._fill(words[0])
        children: list[list[int]] = [[] for _ in range(len(draft) + 1)]  # by row: the root's, then each node's
        for node, parent in enumerate(draft.parents):
            children[parent + 1].append(node)
        kept: set[int] = set()
        # depth first, consuming on the way down and rolling back on the way up; each node's row
        # is filled before its children are judged against it
        stack = [(node, 0) for node in reversed(children[0])]
        path_depth = 0
        while stack:
            node, depth = stack.pop()
            if depth < path_depth:
                self.matcher.rollback(path_depth - depth)
                path_depth = depth
            token = draft.tokens[node]
            parent_row = draft.parents[node] + 1
            if not (words[parent_row, token >> 5] >> (token & 31)) & 1:
                if not greedy and draft.probs[node] is not None:
                    kept.add(node)  # a sampled node: its rejection still moves p to the residual
                continue
            kept.add(node)
            if token in self.eos:
                continue  # nothing follows the end
            if not self.matcher.consume_token(token):
                raise LocalspecError(f"the grammar refused a token it allowed: {_one_line(self.matcher.get_error())}")
            path_depth += 1
            self._fill(words[node + 1])
            stack += [(child, path_depth) for child in reversed(children[node + 1])]
        self.matcher.rollback(path_depth)
        order = sorted(kept)  # the draft's own order: parents before children, siblings as ranked
        index = {node: i for i, node in enumerate(order)}
        pruned = Draft([draft.tokens[n] for n in order], [index.get(draft.parents[n], -1) for n in order],
                       [draft.probs[n] for n in order], draft.label,
                       [draft.confidences[n] for n in order] if draft.confidences else [], draft.steps, draft.history)
        rows = words[[0] + [n + 1 for n in order]]  # (N'+1, W)
        # a word's bytes lowest first (little-endian, as every machine torch runs on), each byte's bits lowest first
        bits = np.unpackbits(rows.view(np.uint8), axis=1, count=self.vocab, bitorder="little")  # (N'+1, V) uint8
        return pruned, torch.from_numpy(bits.view(np.bool_))  # (N'+1, V): 0 and 1 read as bool, no copy

    def advance(self, tokens: list[int]) -> None:
        """The committed tokens, each allowed by the mask it was chosen under, up to an EOS (the
        answer ends there; what a pass read after it is never used)."""
        end = next((i for i, token in enumerate(tokens) if token in self.eos), len(tokens))
        if not self.matcher.consume_tokens(tokens[:end]):
            raise LocalspecError(f"the grammar refused a committed token: {_one_line(self.matcher.get_error())}")

    def _fill(self, row: np.ndarray) -> None:
        """The allowed tokens after the matcher's state, as bits into `row` (W,) int32."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


def _one_line(problem) -> str:
    return " ".join(str(problem).split())[:300]
