"""The endpoints: /health, /metrics, /v1/models, /v1/chat/completions and /v1/completions (with
fill-in-the-middle when the model has the tokens), answered whole or as server-sent events, each
answer with its `usage` and `timings`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from localspec.apps.serve.metrics import timings
from localspec.apps.serve.requests import ApiError, parse_messages, parse_prompt, parse_settings, read_json
from localspec.apps.serve.turns import ClientGone, Service, Turn, until_disconnect
from localspec.base.errors import LocalspecError
from localspec.core.stats import GenerationStats


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
                             "usage": usage(stats), "timings": timings(stats)})

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
        yield chunk(None, finish, timings=timings(stats))
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(stats)})
        yield sse("[DONE]")
