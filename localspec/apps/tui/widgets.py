"""The chat's widgets. They show what they are given; none of them touches the engine."""

from __future__ import annotations

from collections import deque

from rich.table import Table
from rich.text import Text
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Label, ListItem, ListView, Markdown, Sparkline, Static

from localspec.apps.tui.history import Conversation, Message
from localspec.core.stats import GenerationStats, PassFigures

DRAFT_STYLE = "black on #87d787"
"""Text the proposer guessed and the target accepted; the target's own tokens stay plain."""
BAR_WIDTH = 16
SPARK_POINTS = 120
"""Passes kept in the tokens-per-pass sparkline."""
NOW_WINDOW_SECONDS = 1.0
"""Decode time over which 'tok/s now' is measured."""


class MessageView(Vertical):
    """One message: Markdown normally, or the answer coloured by provenance when highlighting."""

    def __init__(self, message: Message) -> None:
        super().__init__(classes=message.role)
        self.message = message
        self.stream = None

    def compose(self):
        if self.message.role == "user":
            yield Static(self.message.content, markup=False, classes="text")
        else:
            yield Markdown(self.message.content, classes="text")
            yield Static(self.highlighted(), classes="provenance")

    def highlighted(self) -> Text:
        text, start = Text(), 0
        for length, from_draft in self.message.runs:
            text.append(self.message.content[start : start + length], DRAFT_STYLE if from_draft else "")
            start += length
        return text

    async def append(self, fragment: str) -> None:
        """Add streamed text (already added to self.message by the worker)."""
        if self.stream is None:
            self.stream = Markdown.get_stream(self.query_one(Markdown))
        await self.stream.write(fragment)
        # kept current even while hidden: the highlight key then shows it without a redraw
        self.query_one(".provenance", Static).update(self.highlighted())

    async def finish(self) -> None:
        if self.stream is not None:
            await self.stream.stop()
            self.stream = None


class RateWindow:
    """Decode tokens/s over the last second of the engine's own decode time."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def add(self, decode_seconds: float, tokens: int) -> float:
        self.samples.append((decode_seconds, tokens))
        while len(self.samples) > 2 and decode_seconds - self.samples[1][0] >= NOW_WINDOW_SECONDS:
            self.samples.popleft()
        (t0, n0), (t1, n1) = self.samples[0], self.samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0


def bars(fractions: list[float]) -> Text:
    text = Text()
    for i, f in enumerate(fractions, 1):
        filled = round(f * BAR_WIDTH)
        text.append(f"{i:>2} ")
        text.append("█" * filled, "green")
        text.append("░" * (BAR_WIDTH - filled), "dim")
        text.append(f" {f:4.0%}\n")
    text.rstrip()
    return text if fractions else Text("no drafts yet", "dim")


class StatsPanel(VerticalScroll):
    """Live speculation statistics: the figures of each batch's passes folded into the answer's
    totals, then the answer's own statistics once it ends."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rate = RateWindow()
        self.stats = GenerationStats()
        self.loaded = None

    def compose(self):
        yield Static(id="engine")
        yield Static(id="figures")
        yield Label("acceptance by draft position", classes="heading")
        yield Static(bars([]), id="positions")
        yield Label("tokens per target pass", classes="heading")
        yield Sparkline([], id="spark")
        yield Static(Text.assemble(("accepted draft", DRAFT_STYLE), "  target token"), id="legend")

    def show_engine(self, loaded) -> None:
        """A new engine: its description, and no figures until it answers."""
        self.loaded = loaded
        self.start()
        self.query_one("#positions", Static).update(bars([]))
        # a grid, so that a value too long for the panel wraps under itself, not under the labels
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("model", loaded.model)
        grid.add_row("weights", loaded.weights.short)
        grid.add_row("proposer", Text(loaded.proposer_choice.short, "green"))
        self.query_one("#engine", Static).update(grid)
        self.query_one("#figures", Static).update(self.figures(None, 0.0))

    def start(self) -> None:
        """A new answer begins: the totals, the 'now' rate and the sparkline start over."""
        self.rate = RateWindow()
        self.stats = GenerationStats()
        self.query_one(Sparkline).data = []

    def show(self, figures: list[PassFigures], final: GenerationStats | None = None) -> None:
        """A batch: its passes' figures, and the answer's statistics if it has ended."""
        now = 0.0
        for pass_figures in figures:  # the 'now' rate after each pass, however they were batched
            self.stats.add(pass_figures)
            now = self.rate.add(self.stats.decode_seconds, self.stats.new_tokens)
        stats = self.stats if final is None else final
        if not figures:
            now = self.rate.add(stats.decode_seconds, stats.new_tokens)
        self.query_one("#figures", Static).update(self.figures(stats, now))
        self.query_one("#positions", Static).update(bars(stats.acceptance_by_position))
        if figures:
            spark = self.query_one(Sparkline)
            spark.data = (list(spark.data or []) + [f.accepted + 1 for f in figures])[-SPARK_POINTS:]

    def figures(self, stats, now: float) -> Table:
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold")
        grid.add_column()
        memory = self.loaded.memory() if self.loaded else "-"
        if stats is None:
            grid.add_row("memory", memory)
            return grid
        grid.add_row("decode", f"{now:.1f} tok/s now, {stats.decode_tokens_per_second:.1f} average")
        grid.add_row("TTFT", f"{stats.ttft_seconds * 1000:.0f} ms")
        grid.add_row("acceptance", f"{stats.acceptance_rate:.0%} ({stats.accepted}/{stats.drafted} drafted)")
        grid.add_row("tokens/pass", f"{stats.mean_tokens_per_pass:.2f} (draft length {stats.mean_draft_len:.1f})")
        if stats.lookup_accepted or stats.lookup_passes:  # a model proposer carrying prompt lookup's guesses
            alone = f"{stats.lookup_passes} pass{'' if stats.lookup_passes == 1 else 'es'} without the model"
            grid.add_row("from lookup", f"{stats.lookup_accepted} tokens ({alone})")
        if stats.history_passes:  # suffix decoding guessed from earlier conversations
            passes = f"{stats.history_passes} pass{'' if stats.history_passes == 1 else 'es'}"
            grid.add_row("from history", f"{stats.history_accepted} tokens ({passes})")
        grid.add_row("draft time", f"{stats.draft_seconds:.2f} s")
        grid.add_row("verify time", f"{stats.verify_seconds:.2f} s ({stats.passes} passes)")
        grid.add_row("speedup", f"{stats.measured_speedup:.2f}x measured, {stats.predicted_speedup:.2f}x formula")
        grid.add_row("tokens", f"{stats.new_tokens} ({stats.stop_reason or 'streaming'})")
        grid.add_row("memory", memory)
        return grid


class ConversationList(ListView):
    """Saved conversations, newest first; selecting one posts ListView.Selected."""

    async def show(self, conversations: list[Conversation], current: str | None) -> None:
        await self.clear()
        await self.extend(ListItem(Label(c.title, markup=False), name=c.id) for c in conversations)
        ids = [c.id for c in conversations]
        if current in ids:
            self.index = ids.index(current)
