"""The resident engine's side: the engine file that lets `localspec run` and `chat` find this
server (`claim`), and the private routes they stream from.

POST /localspec/v1/generate takes {prompt (text or chat messages), system, sampling, limits} and
answers one JSON object per line: {"type": "queued", "ahead": n} while other answers hold the
engine, {"type": "loading"} while the model loads, {"type": "start", "about": Session.details()},
then {"type": "event", "event": core.events.to_wire(...)} per pass, the last carrying the
statistics; or {"type": "error", "message": ...}. GET /localspec/v1/engine says what is loaded
(`?load=1`: once it is).
Both need the engine file's key, whatever the OpenAI routes allow: the file is this user's alone.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import AsyncIterator
from dataclasses import asdict

import psutil

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from localspec.apps.resident import EngineRecord, engine_file, find_engine, read_record, write_record
from localspec.apps.serve.config import has_key
from localspec.apps.serve.requests import ApiError, read_json
from localspec.apps.serve.turns import Service, Turn
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.base.files import locked
from localspec.core.events import FinalEvent, to_wire


def claim(url: str, model: str, dtype: str, spec: SpecConfig, keep_alive: float | None,
          say) -> EngineRecord | None:
    """Become this home's resident engine, unless a live one already is (then None, said once)."""
    running = find_engine(say)  # a killed engine's file is removed here
    with locked(engine_file()):
        running = running or read_record()  # one that started meanwhile
        if running is not None and psutil.pid_exists(running.pid):
            say(f"the resident engine for `localspec run` and `chat` stays pid {running.pid} ({running.model}); "
                "this server answers the API only")
            return None
        record = EngineRecord(os.getpid(), url, secrets.token_urlsafe(32), model, dtype, asdict(spec), keep_alive)
        write_record(record)
    return record


class NdjsonStream(StreamingResponse):
    """One JSON object per line; however the stream ends (done, client gone, shutdown), its
    generator is closed, which ends the turn it holds."""

    def __init__(self, lines: AsyncIterator[dict]) -> None:
        super().__init__((json.dumps(line) + "\n" async for line in lines), media_type="application/x-ndjson")
        self.lines = lines

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.lines.aclose()


class ResidentRoutes:
    def __init__(self, service: Service, key: str | None) -> None:
        self.service, self.key = service, key

    def _check(self, request: Request) -> None:
        if self.key is None:
            raise ApiError(403, "this server is not this home's resident engine")
        if not has_key(request.headers.get("authorization", ""), self.key):
            raise ApiError(401, "missing or wrong engine key (it is in the engine file of the user who started it)")

    async def engine(self, request: Request) -> Response:
        """What is loaded; with ?load=1, after loading it (again) if it is not."""
        self._check(request)
        if request.query_params.get("load") == "1":
            await self.service.loaded(lambda note: None)
        served = self.service.served
        return JSONResponse({"pid": os.getpid(), "loaded": served is not None, "unloaded": self.service.unloaded,
                             "details": served.details if served else None, "waiting": self.service.waiting})

    async def generate(self, request: Request) -> Response:
        self._check(request)
        body = await read_json(request, self.service.config.max_body)
        try:
            prompt, system = body["prompt"], body.get("system")
            sampling = SamplingConfig(**body.get("sampling", {}))
            limits = GenerationLimits(**{**body.get("limits", {}), "stop": tuple(body.get("limits", {}).get("stop", ()))})
        except (KeyError, TypeError) as exc:
            raise ApiError(400, f"not a resident engine request: {exc}") from None
        except LocalspecError as exc:
            raise ApiError(400, str(exc)) from None
        if not isinstance(prompt, (str, list)) or not (system is None or isinstance(system, str)):
            raise ApiError(400, "the prompt must be text or chat messages, the system prompt text")
        return NdjsonStream(self._answer(request, prompt, system, sampling, limits))

    async def _answer(self, request: Request, prompt, system, sampling: SamplingConfig,
                      limits: GenerationLimits) -> AsyncIterator[dict]:
        service, notes = self.service, asyncio.Queue()
        turn: Turn | None = None

        async def begin():
            served = await service.loaded(notes.put_nowait)
            return served, await service.turn(request, lambda: served.engine.encode(prompt, system),
                                              lambda ids: served.engine.generate(ids, sampling, limits), notes.put_nowait)

        starting = asyncio.ensure_future(begin())
        try:
            while not starting.done() or not notes.empty():
                note = asyncio.ensure_future(notes.get())
                await asyncio.wait({starting, note}, return_when=asyncio.FIRST_COMPLETED)
                if note.done():
                    yield note.result()
                else:
                    note.cancel()
            try:
                served, turn = starting.result()
            except ApiError as exc:
                yield {"type": "error", "message": exc.message}
                return
            yield {"type": "start", "about": served.details}
            while True:
                try:
                    event = await turn.step()
                    if isinstance(event, FinalEvent):
                        await turn.step()  # the engine's side is finished (and recorded) before the client hears the end
                except Exception as exc:  # the generation failed: the client says why, in one line
                    yield {"type": "error", "message": str(exc) or type(exc).__name__}
                    return
                if event is None:
                    return
                yield {"type": "event", "event": to_wire(event)}
        finally:
            if turn is None and starting.done() and not starting.cancelled() and starting.exception() is None:
                turn = starting.result()[1]  # the client left just as its turn began
            starting.cancel()
            if turn is not None:
                turn.end()
