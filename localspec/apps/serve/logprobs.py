"""Log-probabilities in OpenAI's two shapes: chat's `logprobs.content` (token, logprob, bytes,
top_logprobs) and the legacy completions' `logprobs` (tokens, token_logprobs, top_logprobs,
text_offset). The numbers are the engine's (`Piece.likelihood`: the target's raw distribution at
each token); this module only names the tokens."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from localspec.core.events import Piece, TokenEvent

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""SentencePiece's byte fallback: a token that stands for one byte."""


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2, Llama 3, Qwen, SmolLM): every byte written as one printable
    character; printable Latin-1 bytes stand for themselves, the rest are moved to 256 and up in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(moved)}


BYTE_LEVEL = _byte_level_alphabet()


class TokenTexts:
    """Each token's text and UTF-8 bytes as OpenAI shows them. The tokenizer is read only on the
    engine thread (`learn`, as each event passes); the event loop reads what was learnt."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.known: dict[int, tuple[str, list[int]]] = {}

    def learn(self, pieces: Iterable[Piece]) -> None:
        for piece in pieces:
            alternatives = [token for token, _ in piece.likelihood.top] if piece.likelihood is not None else []
            for token in (piece.token_id, *alternatives):
                if token not in self.known:
                    self.known[token] = self._read(token)

    def __getitem__(self, token: int) -> tuple[str, list[int]]:
        return self.known[token]

    def _read(self, token: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text, list(text.encode("utf-8"))
        # part of a character: its own bytes, from the token's spelling, written as OpenAI does
        raw = self._raw_bytes(token)
        if raw is None:
            return text, list(text.encode("utf-8"))
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def _raw_bytes(self, token: int) -> bytes | None:
        spell = getattr(self.tokenizer, "convert_ids_to_tokens", None)
        spelling = spell(token) if spell is not None else None
        if not isinstance(spelling, str):
            return None
        if match := BYTE_TOKEN.fullmatch(spelling):
            return bytes([int(match.group(1), 16)])
        if spelling and all(c in BYTE_LEVEL for c in spelling):
            return bytes(BYTE_LEVEL[c] for c in spelling)
        return None


def learning(events: Iterator[TokenEvent], texts: TokenTexts) -> Iterator[TokenEvent]:
    """The engine's events, their tokens' texts learnt on the way (on the engine thread). Closing
    this closes the engine's generator at once, as the turn's end needs."""
    try:
        for event in events:
            texts.learn([*event.echoed, *event.pieces])
            yield event
    finally:
        events.close()


def chat_logprobs(pieces: list[Piece], texts: TokenTexts) -> dict:
    """Chat's `logprobs`: each token with its log-probability, bytes and most likely alternatives."""

    def entry(token: int, logprob: float) -> dict:
        text, raw = texts[token]
        return {"token": text, "logprob": logprob, "bytes": raw}

    content = [{**entry(p.token_id, p.likelihood.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.likelihood.top]}
               for p in pieces]
    return {"content": content, "refusal": None}


def completion_logprobs(pieces: list[Piece], texts: TokenTexts, offset: int) -> dict:
    """The legacy completions' `logprobs`; `offset`: where the first piece's text starts in the
    returned text. A prompt's first token has nothing before it: null there."""
    offsets = []
    for p in pieces:
        offsets.append(offset)
        offset += len(p.text)
    return {
        "tokens": [texts[p.token_id][0] for p in pieces],
        "token_logprobs": [None if p.likelihood is None else p.likelihood.logprob for p in pieces],
        "top_logprobs": [None if p.likelihood is None else {texts[t][0]: lp for t, lp in p.likelihood.top} for p in pieces],
        "text_offset": offsets,
    }
