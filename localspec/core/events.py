"""What a generation hands out, pass by pass: the committed tokens with their text and, when asked,
their log-probabilities, and the pass's figures; the last event also the finished statistics.

Plain data with no torch, so that whoever only reads events (a client of the resident engine, the
chat UI before its model loads) starts without it. `to_wire` / `from_wire` carry an event through
JSON and back unchanged (the resident engine's stream), so its reader folds the same numbers an
in-process one does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from localspec.core.stats import GenerationStats, Opening, PassFigures


@dataclass(frozen=True, slots=True)
class Likelihood:
    """The target's log-probability of one token where it stands, and the likeliest tokens there."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) of the most likely tokens at that position, most likely first."""


@dataclass
class Piece:
    text: str
    token_id: int
    from_draft: bool
    """True when a proposer guessed this token and the target accepted it."""
    likelihood: Likelihood | None = None
    """The token's log-probability under the target, when the generation asked for them (and a
    prompt token has one: the first has nothing before it)."""


@dataclass
class TokenEvent:
    """One target pass: the tokens it committed, with their text (possibly empty mid-character),
    and its figures (drafted, accepted and whose, seconds; the first pass's also the opening)."""

    pieces: list[Piece] = field(default_factory=list)
    figures: PassFigures = PassFigures()
    echoed: list[Piece] = field(default_factory=list, kw_only=True)
    """On the first event of an `echo` generation: the prompt's own tokens, before the answer's."""

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


def to_wire(event: TokenEvent) -> dict:
    """An event as JSON-ready data (`from_wire` gives it back)."""
    wire = {"pieces": [asdict(p) for p in event.pieces], "figures": asdict(event.figures)}
    if event.echoed:
        wire["echoed"] = [asdict(p) for p in event.echoed]
    if isinstance(event, FinalEvent):
        wire["stats"] = asdict(event.stats)
    return wire


def from_wire(wire: dict) -> TokenEvent:
    """The event `to_wire` was given (a FinalEvent when it carries statistics)."""

    def piece(p: dict) -> Piece:
        found = p.get("likelihood")
        likelihood = Likelihood(found["logprob"], tuple(map(tuple, found["top"]))) if found else None
        return Piece(p["text"], p["token_id"], p["from_draft"], likelihood)

    figures = dict(wire["figures"])
    figures["notices"] = tuple(figures["notices"])
    figures["opening"] = Opening(**figures["opening"]) if figures["opening"] else None
    parts = dict(pieces=[piece(p) for p in wire["pieces"]], figures=PassFigures(**figures),
                 echoed=[piece(p) for p in wire.get("echoed", ())])
    return FinalEvent(**parts, stats=GenerationStats(**wire["stats"])) if "stats" in wire else TokenEvent(**parts)
