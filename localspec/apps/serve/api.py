"""The endpoints: /health, /metrics, /v1/models, /v1/chat/completions (with tool calls) and
/v1/completions (with fill-in-the-middle when the model has the tokens, and `echo`), answered whole
or as server-sent events, each answer with its `usage` and `timings`, and its log-probabilities
when asked. Both hold an answer to `response_format` (JSON, a schema) when asked; with tools a chat
refuses it unless `tool_choice` is "none": one answer cannot be held to a schema and also be free to
call a tool in the template's own form."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from localspec.apps.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs, learning
from localspec.apps.serve.metrics import timings
from localspec.apps.serve.requests import (ApiError, parse_echo, parse_logprobs, parse_messages, parse_prompt,
                                           parse_response_format, parse_settings, read_json)
from localspec.apps.serve.tools import ToolCall, ToolCallScanner, ToolRequest, parse_tools
from localspec.apps.serve.turns import ClientGone, Service, Turn, until_disconnect
from localspec.base.errors import LocalspecError
from localspec.core.events import Piece
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


@dataclass(frozen=True)
class Reply:
    """What a request wants back besides its text."""

    chat: bool
    logprobs: int | None = None
    """Alternatives per token when it asked for log-probabilities; None: it did not."""
    tools: ToolRequest | None = None
    """The tools the answer may call (read back from its text); None: plain text."""


def tool_call_deltas(call: ToolCall, index: int) -> list[dict]:
    """A call as the stream's deltas, the way the openai client assembles them: index, id and name
    first, then the arguments."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


def split_tool_calls(text: str, tools: ToolRequest) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and calls, read as its stream would be."""
    scanner = ToolCallScanner(tools)
    parts = scanner.push(text) + scanner.finish()
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, ToolCall)]


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


class Api:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def health(self, request: Request) -> Response:
        if self.service.unloaded:
            return JSONResponse({"status": "ok", "model": "unloaded after the keep-alive; the next request loads it"})
        self.service.ready_now()
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        served = await self.service.ready()
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": self.service.created, "owned_by": "localspec",
             "context_length": served.engine.context_len},
        ]})

    async def metrics(self, request: Request) -> Response:
        service = self.service
        text = service.metrics.render(service.waiting, service.served is not None and service.lock.locked())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def chat(self, request: Request) -> Response:
        served = await self.service.ready()
        body = await read_json(request, self.service.config.max_body)
        messages = parse_messages(body)
        if body.get("echo"):
            raise ApiError(400, "'echo' is for /v1/completions; chat answers do not repeat the prompt", "echo")
        tools = parse_tools(body, served.engine.tokenizer, served.name)
        grammar = parse_response_format(body)
        if grammar is not None and tools is not None:
            raise ApiError(400, "'response_format' cannot be combined with 'tools' that the model may call; "
                                "send tool_choice \"none\" for a JSON answer, or drop 'response_format'", "response_format")
        sampling, limits = parse_settings(body, served.name, served.engine.context_len)
        reply = Reply(chat=True, logprobs=parse_logprobs(body, chat=True), tools=tools)
        shown = tools.messages(messages) if tools else messages

        def start(ids: list[int]):
            return served.engine.generate(ids, sampling, limits, logprobs=reply.logprobs, grammar=grammar)

        return await self._answer(request, body, lambda: served.engine.encode(shown, tools=tools.tools if tools else None),
                                  start, reply)

    async def completions(self, request: Request) -> Response:
        served = await self.service.ready()
        body = await read_json(request, self.service.config.max_body)
        prompt = parse_prompt(body, "prompt", served.engine.vocab_size)
        suffix = parse_prompt(body, "suffix") if body.get("suffix") is not None else None
        echo = parse_echo(body)
        grammar = parse_response_format(body)
        sampling, limits = parse_settings(body, served.name, served.engine.context_len, prompt_only=echo)
        reply = Reply(chat=False, logprobs=parse_logprobs(body, chat=False))
        tokenizer, fim = served.engine.tokenizer, self.service.fim
        if suffix is None and not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt")
        if suffix is not None and fim is None:
            raise ApiError(400, f"{served.name} has no fill-in-the-middle tokens, so 'suffix' is not supported; "
                                "use a coder model such as qwen2.5-coder-1.5b", "suffix")
        if suffix is not None and echo:
            raise ApiError(400, "'echo' cannot be combined with 'suffix'", "echo")

        def build() -> list[int]:
            if isinstance(prompt, list):  # token ids, as sent
                return list(prompt)
            if suffix is None:  # raw text, the tokenizer's own special tokens (BOS) included
                return list(tokenizer.encode(prompt))
            before, after, middle = fim
            return [before, *tokenizer.encode(prompt, add_special_tokens=False), after,
                    *tokenizer.encode(suffix, add_special_tokens=False), middle]

        def start(ids: list[int]):
            if limits is None:  # max_tokens 0: the prompt alone
                return served.engine.score(ids, reply.logprobs)
            return served.engine.generate(ids, sampling, limits, logprobs=reply.logprobs, echo=echo, grammar=grammar)

        return await self._answer(request, body, build, start, reply)

    async def _answer(self, request: Request, body: dict, prompt, start, reply: Reply) -> Response:
        model, texts = self.service.served.name, self.service.token_texts
        # with log-probabilities, the tokens' texts are read on the engine thread as each event passes
        events = start if reply.logprobs is None else (lambda ids: learning(start(ids), texts))
        try:
            turn = await self.service.turn(request, prompt, events)
        except ClientGone:
            return Response(status_code=499)
        head = {"id": f"{'chatcmpl' if reply.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion.chunk" if reply.chat else "text_completion",
                "created": int(time.time()), "model": model}
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return EventStream(self._stream(turn, head, reply, texts, include_usage), turn)
        try:
            pieces = await until_disconnect(request, self._collect(turn))
        except ClientGone:
            return Response(status_code=499)
        except LocalspecError as exc:
            raise ApiError(400, str(exc)) from None
        finally:
            turn.end()  # frees the slot; stops the generation if it was cut short
        stats, finish = turn.result
        if finish == "cancelled":
            raise ApiError(503, "the server is shutting down; the answer was cut short")
        text = "".join(p.text for p in pieces)
        if reply.chat:
            message: dict = {"role": "assistant", "content": text}
            if reply.tools is not None:
                content, calls = split_tool_calls(text, reply.tools)
                message["content"] = content
                if calls:
                    message = {"role": "assistant", "content": content or None, "tool_calls": [c.as_json() for c in calls]}
                    finish = "tool_calls"
            logprobs = chat_logprobs(pieces, texts) if reply.logprobs is not None else None
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            logprobs = completion_logprobs(pieces, texts, 0) if reply.logprobs is not None else None
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return JSONResponse({**head, "object": "chat.completion" if reply.chat else "text_completion", "choices": [choice],
                             "usage": usage(stats), "timings": timings(stats)})

    @staticmethod
    async def _collect(turn: Turn) -> list[Piece]:
        pieces = []
        while (event := await turn.step()) is not None:
            pieces += event.echoed + event.pieces
        return pieces

    async def _stream(self, turn: Turn, head: dict, reply: Reply, texts: TokenTexts, include_usage: bool) -> AsyncIterator[str]:
        def chunk(delta: dict | str | None, finish: str | None = None, logprobs: dict | None = None, **extra) -> str:
            """A chat delta, or a completion's text."""
            if reply.chat:
                choice = {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}
            return sse({**head, "choices": [choice], **extra})

        scanner = ToolCallScanner(reply.tools) if reply.tools is not None else None
        calls = 0  # tool calls streamed so far: the next one's index

        def deltas(parts: list[str | ToolCall]) -> list[dict]:
            nonlocal calls
            out = []
            for part in parts:
                if isinstance(part, ToolCall):
                    out += tool_call_deltas(part, calls)
                    calls += 1
                elif part:
                    out.append({"content": part})
            return out

        if reply.chat:
            yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        offset = 0  # completions: where the next piece's text starts in the returned text
        try:
            while (event := await turn.step()) is not None:
                pieces = event.echoed + event.pieces
                text = "".join(p.text for p in pieces)
                scored = reply.logprobs is not None and bool(pieces)
                if reply.chat:
                    logprobs = chat_logprobs(pieces, texts) if scored else None
                    # an event's log-probabilities ride on its first delta, or alone while its text is held back
                    out = deltas(scanner.push(text) if scanner is not None else [text]) or ([{}] if scored else [])
                    for i, delta in enumerate(out):
                        yield chunk(delta, logprobs=logprobs if i == 0 else None)
                elif text or scored:
                    yield chunk(text, logprobs=completion_logprobs(pieces, texts, offset) if scored else None)
                offset += len(text)
        except Exception as exc:  # headers are sent: the error goes in the stream, as OpenAI does
            message = str(exc) if isinstance(exc, LocalspecError) else f"generation failed: {exc!r}"
            yield sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})
            return
        stats, finish = turn.result
        if finish == "cancelled":
            yield sse({"error": {"message": "the server is shutting down; the answer was cut short",
                                 "type": "unavailable_error", "param": None, "code": None}})
            return
        if scanner is not None:
            for delta in deltas(scanner.finish()):
                yield chunk(delta)
        yield chunk(None, "tool_calls" if calls else finish, timings=timings(stats))
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(stats)})
        yield sse("[DONE]")
