"""`localspec serve`: the OpenAI HTTP API over one engine, for editors, agents and web front-ends.

One generation at a time. The engine and its tokenizer are touched only on one worker thread,
which runs the answer ahead of the client and hands each pass's text to the event loop; the loop
stays free to stream, to queue the next requests (beyond the queue: 429) and to notice a client
that left. That client's generation then stops after the pass in flight, and closing the engine's
generator at a pass boundary leaves its cache holding exactly the committed tokens. The next request reuses the longest cached prefix (the engine's
prefill does that), which is what makes a chat client's resent history cheap.

Every response carries `timings` (llama-server's field names, plus speculation's own), read from
the same `GenerationStats` that `/metrics` adds up, so the two always agree.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.runtime.kv import common_prefix
from localspec.store.registry import load_registry
from localspec.core.stats import GenerationStats

FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
"""Fill-in-the-middle tokens, Qwen2.5-Coder's and StarCoder's spelling (prefix, suffix, middle)."""
FINISH_REASONS = {"eos": "stop", "stop string": "stop", "max tokens": "length", "context limit": "length"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "unavailable_error"}
MAX_STOPS = 32
"""Editors send a handful of stop strings for code completion; more than this is a mistake."""


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    """When set, every endpoint but /health needs `Authorization: Bearer <key>`."""
    insecure: bool = False
    """Allow a non-local host without an API key."""
    cors: tuple[str, ...] = ()
    """Browser origins allowed to call the API; none by default."""
    queue: int = 8
    """Requests that may wait while one generates; the next gets 429."""
    max_body: int = 4 << 20
    """Largest request body in bytes (413 beyond)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise LocalspecError(f"--port must be between 0 and 65535, got {self.port}")
        if self.queue < 0:
            raise LocalspecError(f"--queue must be 0 or more, got {self.queue}")
        if not is_local(self.host) and not self.api_key and not self.insecure:
            raise LocalspecError(
                f"refusing to listen on {self.host} without --api-key: anyone who can reach this machine could use "
                "the model; pass --api-key KEY (or set LOCALSPEC_API_KEY), or --insecure"
            )


def is_local(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost may resolve anywhere
        return False


@dataclass
class Served:
    """The loaded model the server answers with."""

    name: str
    engine: object
    """An `Engine` (or anything with its generate / encode / tokenizer / context_len / kv_tokens.ids / stats)."""
    about: str = ""
    """Proposer and dtype, and why: printed in the ready line."""


class ApiError(Exception):
    """A request refused: answered as an OpenAI error object with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# -- request validation ---------------------------------------------------------------------------

def _typed(body: dict, name: str, kinds: tuple[type, ...], what: str):
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) != (bool in kinds) or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:40]}", name)
    return value


def _number(body: dict, name: str, low: float, high: float, integer: bool = False, low_open: bool = False):
    what = f"{'an integer' if integer else 'a number'} from {low} to {high}"
    if low_open:
        what = f"a number in ({low}, {high}]"
    value = _typed(body, name, (int,) if integer else (int, float), what)
    if value is not None and not (low < value <= high if low_open else low <= value <= high):
        raise ApiError(400, f"'{name}' must be {what}, got {value}", name)
    return value


def _text(content, where: str) -> str:
    """A message's content: a string, or a list of text parts (as Open WebUI and Continue send)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{where}: only text content is supported", "messages")
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"{where}: 'content' must be a string or a list of text parts", "messages")


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "'messages' must be a list of {role, content} objects", "messages")
    if not messages:
        raise ApiError(400, "'messages' is empty: send at least one message", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}]: role must be system, developer, user or assistant, got {json.dumps(m.get('role'))[:40]}", "messages")
        content = m.get("content")
        out.append({"role": role, "content": "" if content is None and role == "assistant" else _text(content, f"messages[{i}]")})
    return out


def parse_prompt(body: dict, name: str) -> str:
    value = body.get(name)
    if isinstance(value, list) and len(value) == 1:  # OpenAI also takes a batch; one prompt is one
        value = value[0]
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string", name)
    return value


def parse_settings(body: dict, model: str, context_len: int) -> tuple[SamplingConfig, GenerationLimits]:
    """The sampling and stopping fields both endpoints share, checked with OpenAI's ranges."""
    name = body.get("model")
    if name is not None and name != model:
        raise ApiError(404, f"model {json.dumps(name)[:80]} is not served here; this server runs {model!r}", "model", "model_not_found")
    if _number(body, "n", 1, 128, integer=True) not in (None, 1):
        raise ApiError(400, "'n' must be 1: one answer per request", "n")
    for unsupported in ("logprobs", "echo", "tools", "functions"):
        if body.get(unsupported):
            raise ApiError(400, f"'{unsupported}' is not supported by localspec", unsupported)
    for penalty in ("frequency_penalty", "presence_penalty"):
        if _number(body, penalty, -2, 2):
            raise ApiError(400, f"'{penalty}' is not supported by localspec (only 0)", penalty)
    _typed(body, "stream", (bool,), "true or false")
    options = _typed(body, "stream_options", (dict,), "an object")
    if options is not None:
        _typed(options, "include_usage", (bool,), "true or false")
    chosen = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, chosen, 1, context_len, integer=True)
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1, low_open=True)
    top_k = _number(body, "top_k", 0, 1 << 30, integer=True)
    seed = _number(body, "seed", 0, (1 << 64) - 1, integer=True)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOPS} of them", "stop")
    sampling = SamplingConfig(
        temperature=1.0 if temperature is None else float(temperature), top_k=top_k or 0,
        top_p=1.0 if top_p is None else float(top_p), seed=seed,
    )
    return sampling, GenerationLimits(max_tokens or context_len, tuple(stops))


async def read_json(request: Request, limit: int) -> dict:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {int(length)} bytes, over the limit of {limit} bytes")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
    try:
        body = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# -- statistics -----------------------------------------------------------------------------------

def timings(stats: GenerationStats, cached: int) -> dict:
    """llama-server's `timings` names, plus what speculation adds."""
    fresh = stats.prompt_tokens - cached
    return {
        "prompt_n": stats.prompt_tokens,
        "cache_n": cached,
        "prompt_ms": stats.prefill_seconds * 1e3,
        "prompt_per_second": fresh / stats.prefill_seconds if stats.prefill_seconds > 0 else 0.0,
        "ttft_ms": stats.ttft_seconds * 1e3,
        "predicted_n": stats.new_tokens,
        "predicted_ms": stats.decode_seconds * 1e3,
        "predicted_per_second": stats.decode_tokens_per_second,
        "passes": stats.passes,
        "tokens_per_pass": stats.mean_tokens_per_pass,
        "drafts": stats.drafted_at[0] if stats.drafted_at else 0,
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
        "accepted_at_position": list(stats.accepted_at),
        "proposer": stats.proposer,
    }


COUNTERS = (
    # (name, help, key in timings)
    ("prompt_tokens_total", "Prompt tokens received.", "prompt_n"),
    ("prompt_cached_tokens_total", "Prompt tokens found in the cache from an earlier request (not prefilled again).", "cache_n"),
    ("generated_tokens_total", "Tokens generated.", "predicted_n"),
    ("passes_total", "Target forward passes after the prefill.", "passes"),
    ("drafts_total", "Passes that verified a draft.", "drafts"),
    ("drafted_tokens_total", "Tokens proposed for verification.", "draft_n"),
    ("accepted_tokens_total", "Proposed tokens the target accepted.", "draft_n_accepted"),
)


class Metrics:
    """Counters since start; each generation adds its final statistics (the ones its response's
    `timings` shows). Written on the engine thread, read on the event loop: a lock keeps reads whole."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals = {name: 0 for name, _, _ in COUNTERS}
        self.accepted_at: list[int] = []
        self.drafted_at: list[int] = []
        self.seconds = {"prefill": 0.0, "draft": 0.0, "verify": 0.0}
        self.finished: dict[str, int] = {}
        self.rejected = 0

    def record(self, stats: GenerationStats, cached: int, finish: str) -> None:
        figures = timings(stats, cached)
        with self.lock:
            for name, _, key in COUNTERS:
                self.totals[name] += figures[key]
            for mine, theirs in ((self.accepted_at, stats.accepted_at), (self.drafted_at, stats.drafted_at)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, n in enumerate(theirs):
                    mine[i] += n
            self.seconds["prefill"] += stats.prefill_seconds
            self.seconds["draft"] += stats.draft_seconds
            self.seconds["verify"] += stats.verify_seconds
            self.finished[finish] = self.finished.get(finish, 0) + 1

    def render(self, waiting: int, busy: bool) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP localspec_{name} {help_}", f"# TYPE localspec_{name} {kind}"])
            lines.extend(f"localspec_{name}{labels} {value}" for labels, value in samples)

        with self.lock:
            metric("generations_total", "counter", "Generations by how they ended (stop, length, cancelled, error).",
                   [(f'{{finish="{k}"}}', v) for k, v in sorted(self.finished.items())])
            metric("rejected_requests_total", "counter", "Requests refused with 429 because the queue was full.", [("", self.rejected)])
            for name, help_, _ in COUNTERS:
                metric(name, "counter", help_, [("", self.totals[name])])
            metric("drafted_at_position_total", "counter", "Drafts that reached each position (0-based).",
                   [(f'{{position="{i}"}}', n) for i, n in enumerate(self.drafted_at)])
            metric("accepted_at_position_total", "counter", "Drafts accepted up to and including each position.",
                   [(f'{{position="{i}"}}', n) for i, n in enumerate(self.accepted_at)])
            for part, help_ in (("prefill", "Prompt prefill time."), ("draft", "Time spent drafting."),
                                ("verify", "Time in target verify passes.")):
                metric(f"{part}_seconds_total", "counter", help_, [("", float(self.seconds[part]))])
        metric("queue_waiting", "gauge", "Requests waiting for the engine.", [("", waiting)])
        metric("busy", "gauge", "1 while a generation runs.", [("", int(busy))])
        return "\n".join(lines) + "\n"


# -- the single stream ----------------------------------------------------------------------------

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
        self.cached = 0
        self.result: tuple[GenerationStats, str] | None = None
        """Final statistics and finish reason, set on the engine thread before the last item is queued."""
        self.ended = False

    def begin(self, ids: list[int], cached: int, sampling: SamplingConfig, limits: GenerationLimits) -> None:
        self.cached = cached
        self.queue = asyncio.Queue()
        events = self.service.served.engine.generate(ids, sampling, limits)
        self.service.pool.submit(self._run, events, len(ids), asyncio.get_running_loop())

    def _run(self, events, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> None:
        """On the engine thread: every pass's event to the queue, then None (or the exception)."""
        engine = self.service.served.engine
        started, outcome, last = False, None, None
        try:
            while not self.stop.is_set():
                started = True
                event = next(events, None)
                if event is None:
                    break
                loop.call_soon_threadsafe(self.queue.put_nowait, event)
            else:
                outcome = "cancelled"
        except RuntimeError as exc:  # the event loop closed under us: the server is stopping
            outcome, last = ("cancelled", None) if loop.is_closed() else ("error", exc)
        except Exception as exc:
            outcome, last = "error", exc
        finally:
            events.close()
            if started:
                stats = engine.stats
            else:  # stopped before the engine ran: nothing computed, nothing found in the cache
                stats, self.cached = GenerationStats(prompt_tokens=prompt_tokens), 0
            finish = outcome or FINISH_REASONS.get(stats.stop_reason, "stop")
            self.service.metrics.record(stats, self.cached, finish)
            self.service.log_generation(stats, self.cached, finish)
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
        self.waiting = 0
        self.current: Turn | None = None
        """The turn holding the engine."""
        self.closing = False

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # made here, inside the server's event loop, so a test client's loop gets its own
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="localspec-engine")
        self.lock = asyncio.Lock()
        # a daemon thread, so Ctrl-C during a long load ends the process at once; nothing else
        # touches the engine until `served` is set
        threading.Thread(target=self._load, name="localspec-load", daemon=True).start()
        try:
            yield
        finally:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _load(self) -> None:
        try:
            served = self.load()
            self.fim = fim_ids(served.engine.tokenizer)
            self.served = served
        except Exception as exc:  # the CLI's loader reports and stops the server; /health shows it
            self.failure = str(exc) or type(exc).__name__

    def log_generation(self, stats: GenerationStats, cached: int, finish: str) -> None:
        self.log(f"{finish}: {stats.prompt_tokens} prompt tokens ({cached} cached), {stats.new_tokens} generated, "
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

    def ready(self) -> Served:
        if self.closing:
            raise ApiError(503, "the server is shutting down")
        if self.served is None:
            raise ApiError(503, f"the model failed to load: {self.failure}" if self.failure else "the model is still loading; try again shortly")
        return self.served

    async def turn(self, request: Request, prompt: Callable[[], list[int]], sampling: SamplingConfig,
                   limits: GenerationLimits) -> Turn:
        """Wait for the engine (429 if the queue is full), then encode the prompt there and check it."""
        if self.lock.locked() and self.waiting >= self.config.queue:
            with self.metrics.lock:
                self.metrics.rejected += 1
            raise ApiError(429, f"the server is busy: one answer is generating and {self.waiting} requests are waiting "
                                f"(the queue holds {self.config.queue}); try again shortly")
        self.waiting += 1
        try:
            await until_disconnect(request, self.lock.acquire())
        finally:
            self.waiting -= 1
        turn = self.current = Turn(self)
        try:
            if self.closing:
                raise ApiError(503, "the server is shutting down")
            ids, cached = await self.call(self._encode, prompt)
            context = self.served.engine.context_len
            if not ids:
                raise ApiError(400, "the prompt is empty")
            if len(ids) >= context:
                raise ApiError(400, f"the prompt is {len(ids)} tokens; {self.served.name}'s context window is {context} "
                                    "tokens and the answer needs room: shorten it", code="context_length_exceeded")
            turn.begin(ids, cached, sampling, limits)
        except BaseException:
            turn.end()
            raise
        return turn

    def _encode(self, prompt: Callable[[], list[int]]) -> tuple[list[int], int]:
        """On the engine thread: the prompt's ids, and how many of them (all but the last, which
        the first pass feeds) the cache already holds from the previous request."""
        try:
            ids = prompt()
        except Exception as exc:  # e.g. a chat template that refuses this order of roles
            raise ApiError(400, f"cannot build the prompt: {exc}") from None
        return ids, common_prefix(self.served.engine.kv_tokens.ids, ids[:-1])


def fim_ids(tokenizer) -> tuple[int, int, int] | None:
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return None
    unknown = getattr(tokenizer, "unk_token_id", None)
    for names in FIM_TOKENS:
        ids = tuple(convert(name) for name in names)
        if all(isinstance(i, int) and i != unknown for i in ids):
            return ids
    return None


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


class EventStream(StreamingResponse):
    """Server-sent events that end the turn however the stream ends (done, client gone, shutdown)."""

    def __init__(self, chunks: AsyncIterator[str], turn: Turn) -> None:
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.turn = turn

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.turn.end()


def sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


# -- endpoints ------------------------------------------------------------------------------------

class Api:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def health(self, request: Request) -> Response:
        self.service.ready()
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        served = self.service.ready()
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": self.service.created, "owned_by": "localspec",
             "context_length": served.engine.context_len},
        ]})

    async def metrics(self, request: Request) -> Response:
        service = self.service
        text = service.metrics.render(service.waiting, service.served is not None and service.lock.locked())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Response:
        served = self.service.ready()
        body = await read_json(request, self.service.config.max_body)
        messages = parse_messages(body)
        sampling, limits = parse_settings(body, served.name, served.engine.context_len)
        return await self._answer(request, body, lambda: served.engine.encode(messages), sampling, limits, chat=True)

    async def completions(self, request: Request) -> Response:
        served = self.service.ready()
        body = await read_json(request, self.service.config.max_body)
        prompt = parse_prompt(body, "prompt")
        suffix = parse_prompt(body, "suffix") if body.get("suffix") is not None else None
        sampling, limits = parse_settings(body, served.name, served.engine.context_len)
        tokenizer, fim = served.engine.tokenizer, self.service.fim
        if suffix is None and not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt")
        if suffix is not None and fim is None:
            raise ApiError(400, f"{served.name} has no fill-in-the-middle tokens, so 'suffix' is not supported; "
                                "use a coder model such as qwen2.5-coder-1.5b", "suffix")

        def build() -> list[int]:
            if suffix is None:  # raw text, the tokenizer's own special tokens (BOS) included
                return list(tokenizer.encode(prompt))
            before, after, middle = fim
            return [before, *tokenizer.encode(prompt, add_special_tokens=False), after,
                    *tokenizer.encode(suffix, add_special_tokens=False), middle]

        return await self._answer(request, body, build, sampling, limits, chat=False)

    async def _answer(self, request: Request, body: dict, prompt, sampling, limits, chat: bool) -> Response:
        model = self.service.served.name
        try:
            turn = await self.service.turn(request, prompt, sampling, limits)
        except ClientGone:
            return Response(status_code=499)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return EventStream(self._stream(turn, head, chat, include_usage), turn)
        try:
            text = await until_disconnect(request, self._collect(turn))
        except ClientGone:
            return Response(status_code=499)
        except LocalspecError as exc:
            raise ApiError(400, str(exc)) from None
        finally:
            turn.end()  # frees the slot; stops the generation if it was cut short
        stats, finish = turn.result
        if finish == "cancelled":
            raise ApiError(503, "the server is shutting down; the answer was cut short")
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
                  if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                             "usage": usage(stats), "timings": timings(stats, turn.cached)})

    @staticmethod
    async def _collect(turn: Turn) -> str:
        parts = []
        while (event := await turn.step()) is not None:
            parts.append(event.text)
        return "".join(parts)

    async def _stream(self, turn: Turn, head: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        def chunk(text: str | None, finish: str | None = None, **extra) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return sse({**head, "choices": [choice], **extra})

        if chat:
            yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        try:
            while (event := await turn.step()) is not None:
                if event.text:
                    yield chunk(event.text)
        except Exception as exc:  # headers are sent: the error goes in the stream, as OpenAI does
            message = str(exc) if isinstance(exc, LocalspecError) else f"generation failed: {exc!r}"
            yield sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
            return
        stats, finish = turn.result
        if finish == "cancelled":
            yield sse({"error": {"message": "the server is shutting down; the answer was cut short",
                                 "type": "unavailable_error", "param": None, "code": None}})
            return
        yield chunk(None, finish, timings=timings(stats, turn.cached))
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(stats)})
        yield sse("[DONE]")


class RequireKey:
    """Bearer-key check for every path but /health (plain ASGI, so streaming is untouched)."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(500, f"internal error: {exc!r}")


def create_app(load: Callable[[], Served], config: ServeConfig = ServeConfig(), log: Callable[[str], None] | None = None) -> Starlette:
    """The ASGI app; `load` runs in the background at startup (until it returns, /health says 503)."""
    service = Service(load, config, log or (lambda line: None))
    api = Api(service)
    routes = [
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
    ]
    middleware = []
    if config.cors:  # outermost, so a browser's preflight is answered without a key
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(config.cors), allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    if config.api_key:
        middleware.append(Middleware(RequireKey, key=config.api_key))
    app = Starlette(routes=routes, middleware=middleware, lifespan=service.lifespan,
                    exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _server_error})
    app.state.service = service
    return app


# -- the command ----------------------------------------------------------------------------------

def session_loader(model: str | None, proposer: str, dtype: str, spec: SpecConfig) -> Callable[[], Served]:
    """What `localspec serve` loads; an unknown model name fails here, before the port opens."""
    entry = load_registry().get(model)

    def load() -> Served:
        # torch loads here, in the engine thread, once the port is open: /health answers meanwhile
        from localspec.store.session import open_session

        session = open_session(entry.name, proposer, dtype, spec)
        return Served(entry.name, session.engine, f"{session.proposer} proposer ({session.reason}); {session.dtype_reason}")

    return load


def listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        # create_server's own text repeats the address; a failed name lookup has its own errno space
        reason = (exc.strerror or str(exc)) if isinstance(exc, socket.gaierror) or not exc.errno else os.strerror(exc.errno)
        raise LocalspecError(f"cannot listen on {host}:{port}: {reason}") from None


class GracefulServer(uvicorn.Server):
    """uvicorn, stopping the answer in progress as soon as Ctrl-C arrives, instead of letting its
    stream run on until the grace period cancels it with a traceback."""

    def __init__(self, config: uvicorn.Config, service: Service) -> None:
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.shutdown()
        super().handle_exit(sig, frame)


def serve(config: ServeConfig, load: Callable[[], Served]) -> int:
    """Listen, load the model behind /health's 503, serve until Ctrl-C."""

    def say(line: str) -> None:
        print(f"localspec: {line}", file=sys.stderr, flush=True)

    sock = listen(config.host, config.port)
    host = f"[{config.host}]" if ":" in config.host else config.host
    failed: list[BaseException] = []

    def load_then_announce() -> Served:
        try:
            served = load()
        except BaseException as exc:
            failed.append(exc)
            server.should_exit = True
            raise
        say(f"ready: {served.name}, {served.about}")
        return served

    app = create_app(load_then_announce, config, log=say)
    server = GracefulServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), app.state.service)
    say(f"serving the OpenAI API at http://{host}:{sock.getsockname()[1]}/v1 (loading the model; /health says 503 until ready)")
    server.run(sockets=[sock])
    if failed:
        raise failed[0]
    say("stopped")
    return 0
