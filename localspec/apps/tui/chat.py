"""The main screen: conversations, messages, the prompt and the statistics panel."""

from __future__ import annotations

import threading
from dataclasses import replace

from rich.markup import escape
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, ListView, Static, TextArea

from localspec.apps.tui.backend import available_proposers
from localspec.apps.tui.history import Conversation, Message, title_for
from localspec.apps.tui.streaming import Batch, stream_answer
from localspec.apps.tui.widgets import ConversationList, MessageView, StatsPanel
from localspec.base.errors import LocalspecError
from localspec.core.prompt import is_blank


class ChatScreen(Screen):
    BINDINGS = [
        # not a priority binding: those run ahead of keys the prompt has not inserted yet
        Binding("ctrl+j,alt+enter", "send", "Send"),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+t", "toggle_highlight", "Drafts"),
        Binding("ctrl+r", "next_proposer", "Proposer"),
        Binding("f1", "app.help", "Help"),
        Binding("f2", "app.settings", "Settings"),
        Binding("f3", "app.pick_model", "Model"),
        Binding("f4", "toggle_panel('#stats')", "Stats"),
        Binding("f5", "toggle_panel('#conversations')", "Chats"),
        Binding("f8", "app.pair", "Pair"),
        Binding("ctrl+q", "app.quit", "Quit"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.conversation = Conversation()
        self.stop_event = threading.Event()
        self.answer_view: MessageView | None = None

    @property
    def generating(self) -> bool:
        return self.answer_view is not None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            yield ConversationList(id="conversations")
            with Vertical(id="chat"):
                yield VerticalScroll(id="messages")
                yield Static(id="status")
                yield TextArea(id="prompt", placeholder="Ask something. Enter: new line, Ctrl+J: send")
            yield StatsPanel(id="stats")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#messages").anchor()
        self.query_one("#prompt", TextArea).focus()
        await self.refresh_conversations()

    # -- what the app tells the screen ----------------------------------------------------------

    def show_engine(self) -> None:
        loaded = self.app.loaded
        self.app.sub_title = f"{loaded.model} · {loaded.proposer}"
        self.query_one(StatsPanel).show_engine(loaded)
        self.show_status()

    def show_status(self, note: str = "") -> None:
        """The settings line; `note` is markup (callers escape what they put in it)."""
        s = self.app.settings
        draft = "adaptive" if s.spec.draft_len is None else str(s.spec.draft_len)
        text = (f"proposer {s.spec.proposer} · draft length {draft} · temperature {s.sampling.temperature:g}"
                f" · top-p {s.sampling.top_p:g}" + (" · system prompt" if s.system else ""))
        self.query_one("#status", Static).update(f"[dim]{escape(text)}[/]" + (f"  {note}" if note else ""))

    async def refresh_conversations(self) -> None:
        await self.query_one(ConversationList).show(self.app.history.list(), self.conversation.id)

    # -- sending and streaming ------------------------------------------------------------------

    async def action_send(self) -> None:
        prompt = self.query_one("#prompt", TextArea)
        text = prompt.text
        if is_blank(text):
            return
        if self.generating:
            self.notify("An answer is still streaming: Esc stops it.", severity="warning")
            return
        if self.app.loaded is None:
            self.notify("No model is loaded yet.", severity="warning")
            return
        prompt.clear()
        conv = self.conversation
        if not conv.messages:
            conv.title = title_for(text)
        conv.model, conv.system = self.app.loaded.model, self.app.settings.system
        user, reply = Message("user", text), Message("assistant", partial=True)
        conv.messages += [user, reply]
        self.app.history.save(conv)
        messages = self.query_one("#messages", VerticalScroll)
        self.answer_view = MessageView(reply)
        await messages.mount_all([MessageView(user), self.answer_view])
        self.query_one(StatsPanel).start()
        self.show_status("[b]generating… Esc stops[/]")
        self.stop_event.clear()
        await self.refresh_conversations()
        app = self.app
        self.answer(app.loaded.engine, conv, app.settings, app.history,
                    lambda batch: app.call_from_thread(self.show_batch, batch))

    # exit_on_error off: quitting mid-answer makes the last delivery fail once the app is gone;
    # the history is saved before each delivery, and errors while the app runs are shown as notices
    @work(thread=True, exclusive=True, group="answer", exit_on_error=False)
    def answer(self, engine, conversation: Conversation, settings, history, deliver) -> None:
        stream_answer(engine, conversation, settings, history, self.stop_event, deliver)

    async def show_batch(self, batch: Batch) -> None:
        view = self.answer_view
        await view.append("".join(p.text for p in batch.pieces))
        self.query_one(StatsPanel).show(batch.figures, batch.stats)
        if batch.notice:
            self.notify(batch.notice, title="history", severity="warning", timeout=10, markup=False)
        if batch.done:
            await view.finish()
            self.answer_view = None
            if batch.error:
                self.notify(batch.error, title="generation failed", severity="error", timeout=10, markup=False)
            self.show_status(f"[dim]{escape(view.message.stop_reason)}[/]")

    def action_stop(self) -> None:
        self.stop_event.set()

    # -- conversations --------------------------------------------------------------------------

    async def open_conversation(self, conversation: Conversation) -> None:
        if self.generating:
            self.notify("Stop the answer first (Esc).", severity="warning")
            return
        self.conversation = conversation
        messages = self.query_one("#messages", VerticalScroll)
        await messages.remove_children()
        await messages.mount_all([MessageView(m) for m in conversation.messages])
        if conversation.system != self.app.settings.system:
            self.app.settings = replace(self.app.settings, system=conversation.system)
            self.show_status()
        self.query_one("#prompt", TextArea).focus()

    async def action_new_chat(self) -> None:
        await self.open_conversation(Conversation(system=self.app.settings.system))
        await self.refresh_conversations()

    @on(ListView.Selected, "#conversations")
    async def conversation_chosen(self, event: ListView.Selected) -> None:
        if event.item.name != self.conversation.id:
            try:
                conversation = self.app.history.load(event.item.name)
            except LocalspecError as exc:  # removed or damaged since the list was drawn
                self.notify(str(exc), severity="error", markup=False)
                return
            await self.open_conversation(conversation)

    # -- display toggles and quick switches -----------------------------------------------------

    def action_toggle_highlight(self) -> None:
        self.toggle_class("highlight")

    def action_toggle_panel(self, selector: str) -> None:
        widget = self.query_one(selector)
        widget.display = not widget.display

    def action_next_proposer(self) -> None:
        settings = self.app.settings
        proposers = available_proposers(self.app.backend.registry, settings.model)
        current = settings.spec.proposer
        following = proposers[(proposers.index(current) + 1) % len(proposers)] if current in proposers else proposers[0]
        self.app.apply_settings(replace(settings, spec=replace(settings.spec, proposer=following)))
