"""The single stream: one generation at a time on one engine thread, the slot and the queue of
requests waiting for it (beyond the queue: 429; a waiting client can be told its place), a client
that leaves noticed and its generation stopped after the pass in flight, so the engine's cache
holds exactly the committed tokens. The model itself: loaded in the background at start-up,
unloaded once idle for the keep-alive and loaded again by the next request."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request

from localspec.apps.serve.config import ServeConfig
from localspec.apps.serve.metrics import Metrics
from localspec.apps.serve.requests import ApiError, fim_ids
from localspec.apps.serve.logprobs import TokenTexts
from localspec.core.events import TokenEvent
from localspec.core.prompt import PromptRefused, check_ids
from localspec.core.stats import GenerationStats

FINISH_REASONS = {"eos": "stop", "grammar": "stop", "stop string": "stop", "max tokens": "length", "context limit": "length"}


@dataclass
class Served:
    """The loaded model the server answers with."""

    name: str
    engine: object
    """An `Engine` (or anything with its generate / score / encode / tokenizer / context_len /
    vocab_size, as a request needs them); the numbers come from the events `generate` yields."""
    about: str = ""
    """Proposer and dtype, and why: printed in the ready line."""
    details: dict = field(default_factory=dict)
    """What the resident engine tells its clients about the pair (`Session.details()`)."""
    record: Callable[[GenerationStats], None] = lambda stats: None
    """Keeps an answer's figures in this machine's history, as an in-process run does (`Session.record`)."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def until_disconnect(request: Request, awaitable):
    """Await `awaitable` unless the client disconnects first (then cancel it: ClientGone)."""
    task = asyncio.ensure_future(awaitable)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientGone
    return task.result()


class Turn:
    """One request's hold on the engine, from its place in the queue to the end of its answer.

    The generation runs on the engine thread ahead of the client, handing each pass's event to the
    event loop, so the engine never waits for the network. `end` (idempotent) frees the slot at
    once and, if the answer is not complete, asks the engine thread to stop: it checks between
    passes, so the pass in flight is the last one, and it closes the generator before anything the
    next request queues there runs."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.stop = threading.Event()
        self.queue: asyncio.Queue | None = None
        self.result: tuple[GenerationStats, str] | None = None
        """Final statistics and finish reason, set on the engine thread before the last item is queued."""
        self.ended = False

    def begin(self, ids: list[int], start: Callable[[list[int]], Iterator[TokenEvent]]) -> None:
        """Start the answer: `start` makes the engine's events for the prompt's ids (nothing runs
        until the engine thread asks for the first)."""
        self.queue = asyncio.Queue()
        self.service.pool.submit(self._run, start(ids), len(ids), asyncio.get_running_loop())

    def _run(self, events, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: every pass's event to the queue, then None (or the exception)."""
        # the answer's statistics, folded from its events; before any: nothing computed, nothing cached
        engine = self.service.served.engine
        stats = GenerationStats(engine.proposer_name, engine.proposer_reason, prompt_tokens=prompt_tokens)
        outcome, last = None, None
        try:
            while not self.stop.is_set():
                event = next(events, None)
                if event is None:
                    break
                stats = event.fold(stats)
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            else:
                outcome = "cancelled"
        except RuntimeError as exc:  # the event loop closed under us: the server is stopping
            outcome, last = ("cancelled", None) if loop.is_closed() else ("error", exc)
        except Exception as exc:
            outcome, last = "error", exc
        finally:
            events.close()
            finish = outcome or FINISH_REASONS.get(stats.stop_reason, "stop")
            self.service.metrics.record(stats, finish)
            self.service.log_generation(stats, finish)
            self.service.served.record(stats)
            self.result = stats, finish
        if not loop.is_closed():
            loop.call_soon_threadsafe(self.queue.put_nowait, last)

    async def step(self):
        """The next TokenEvent, or None when the answer is complete (its statistics in `result`)."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        if self.result is None:
            self.stop.set()
        if self.service.current is self:
            self.service.current = None
        self.service.last_used = time.monotonic()
        self.service.lock.release()


class Service:
    """The app's state: the model (loaded in the background at startup), the engine thread, the
    slot and its queue, the metrics."""

    def __init__(self, load: Callable[[], Served], config: ServeConfig, log: Callable[[str], None]) -> None:
        self.load, self.config, self.log = load, config, log
        self.served: Served | None = None
        self.failure: str | None = None
        self.created = int(time.time())
        self.metrics = Metrics()
        self.fim: tuple[int, int, int] | None = None
        self.token_texts: TokenTexts | None = None
        """The model's tokens as log-probabilities name them, learnt as answers pass."""
        self.waiting = 0
        self.line: list[object] = []
        """A ticket per waiting request, first come first: the lock hands the engine on in this order."""
        self.current: Turn | None = None
        """The turn holding the engine."""
        self.closing = False
        self.last_used = time.monotonic()
        self.unloaded = False
        """The model was loaded, then unloaded after the keep-alive: the next request loads it again."""
        self.reloading: asyncio.Task | None = None
        self.on_unload: Callable[[], None] = lambda: None

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # made here, inside the server's event loop, so a test client's loop gets its own
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="localspec-engine")
        self.lock = asyncio.Lock()
        # a daemon thread, so Ctrl-C during a long load ends the process at once; nothing else
        # touches the engine until `served` is set
        threading.Thread(target=self._load, name="localspec-load", daemon=True).start()
        keeper = asyncio.ensure_future(self._keep_alive()) if self.config.keep_alive is not None else None
        try:
            yield
        finally:
            if keeper is not None:
                keeper.cancel()
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _load(self) -> None:
        try:
            served = self.load()
            self.fim = fim_ids(served.engine.tokenizer)
            self.token_texts = TokenTexts(served.engine.tokenizer)
            self.served, self.last_used = served, time.monotonic()  # idle from now, not since before the load
        except Exception as exc:  # the CLI's loader reports and stops the server; /health shows it
            self.failure = str(exc) or type(exc).__name__

    async def _keep_alive(self) -> None:
        """Unload the model once nothing has asked for it for `keep_alive` seconds."""
        limit = self.config.keep_alive
        while True:
            await asyncio.sleep(min(max(limit / 4, 0.05), 1.0))
            if self.served is None or self.lock.locked() or self.waiting or time.monotonic() - self.last_used < limit:
                continue
            # here, not at the top: the server's module loads before torch, so that its port opens at once
            from localspec.store.loading import release_memory

            async with self.lock:  # no answer may start on an engine being dropped
                name, self.served, self.unloaded = self.served.name, None, True
                self.fim = self.token_texts = None
                await self.call(release_memory)
            self.log(f"unloaded {name} after {limit:g} s idle (--keep-alive); the next request loads it again")
            self.on_unload()

    async def _reload(self) -> None:
        """Load the model again after the keep-alive unloaded it (one load for every request asking)."""
        if self.reloading is None:
            self.log("loading the model again")
            self.failure, self.unloaded = None, False
            self.reloading = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, self._load))
        try:
            await asyncio.shield(self.reloading)
        finally:
            if self.reloading is not None and self.reloading.done():
                self.reloading = None

    def log_generation(self, stats: GenerationStats, finish: str) -> None:
        self.log(f"{finish}: {stats.prompt_tokens} prompt tokens ({stats.cached_tokens} cached), "
                 f"{stats.new_tokens} generated, "
                 f"TTFT {stats.ttft_seconds * 1e3:.0f} ms, {stats.decode_tokens_per_second:.1f} tok/s, "
                 f"{stats.mean_tokens_per_pass:.2f} tokens/pass ({stats.proposer})")

    async def call(self, fn, *args):
        """Run fn on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        """Ctrl-C: refuse new work and stop the answer in progress after its pass, so its client
        hears why and the server can exit before its grace period runs out."""
        self.closing = True
        if self.current is not None:
            self.current.stop.set()

    def ready_now(self) -> Served:
        """The model, or 503 while it loads (or failed to)."""
        if self.closing:
            raise ApiError(503, "the server is shutting down")
        if self.served is None:
            raise ApiError(503, f"the model failed to load: {self.failure}" if self.failure else "the model is still loading; try again shortly")
        return self.served

    async def ready(self) -> Served:
        """The model, loaded again first if the keep-alive unloaded it; 503 while the first load runs."""
        if self.unloaded and not self.closing:
            await self._reload()
        self.last_used = time.monotonic()
        return self.ready_now()

    async def loaded(self, notify: Callable[[dict], None]) -> Served:
        """The model, waiting for the first load too (`notify` hears that it is loading)."""
        told = False
        while self.served is None and self.failure is None and not self.closing:
            if not told:
                notify({"type": "loading"})
                told = True
            if self.unloaded:
                await self._reload()
            else:
                await asyncio.sleep(0.05)
        return await self.ready()

    async def turn(self, request: Request, prompt: Callable[[], list[int]],
                   start: Callable[[list[int]], Iterator[TokenEvent]], notify: Callable[[dict], None] | None = None) -> Turn:
        """Wait for the engine (429 if the queue is full; `notify` hears the answers ahead as they
        go), then encode the prompt there, check it, and start the answer (`Turn.begin`)."""
        if self.lock.locked() and self.waiting >= self.config.queue:
            with self.metrics.lock:
                self.metrics.rejected += 1
            raise ApiError(429, f"the server is busy: one answer is generating and {self.waiting} requests are waiting "
                                f"(the queue holds {self.config.queue}); try again shortly")
        self.waiting += 1
        ticket = object()
        self.line.append(ticket)
        try:
            await until_disconnect(request, self._acquire(ticket, notify))
        finally:
            self.waiting -= 1
            self.line.remove(ticket)
        turn = self.current = Turn(self)
        try:
            if self.closing:
                raise ApiError(503, "the server is shutting down")
            ids = await self.call(self._encode, prompt)
            try:
                check_ids(ids, self.served.engine.context_len, self.served.name)
            except PromptRefused as refused:
                raise ApiError(400, str(refused), code="context_length_exceeded" if refused.too_long else None) from None
            turn.begin(ids, start)
        except BaseException:
            turn.end()
            raise
        return turn

    async def _acquire(self, ticket: object, notify: Callable[[dict], None] | None) -> None:
        """The engine's lock, telling `notify` how many answers are ahead whenever that changes."""
        acquiring = asyncio.ensure_future(self.lock.acquire())
        try:
            told = 0
            await asyncio.wait({acquiring}, timeout=0)  # a free engine: taken at once, nothing to tell
            while not acquiring.done():
                ahead = self.line.index(ticket) + (self.lock.locked())  # those waiting before it, and the one generating
                if notify is not None and ahead != told:
                    notify({"type": "queued", "ahead": ahead})
                    told = ahead
                await asyncio.wait({acquiring}, timeout=0.25)
        except BaseException:
            if acquiring.done() and not acquiring.cancelled():
                self.lock.release()
            acquiring.cancel()
            raise

    def _encode(self, prompt: Callable[[], list[int]]) -> list[int]:
        """On the engine thread: the prompt's ids."""
        try:
            ids = prompt()
        except Exception as exc:  # e.g. a chat template that refuses this order of roles
            raise ApiError(400, f"cannot build the prompt: {exc}") from None
        return ids
