"""What a request may ask: its JSON body, checked against OpenAI's fields and ranges, becomes the
messages or prompt, the engine's sampling settings and limits, and the log-probabilities wanted; a
refusal is an `ApiError`, answered as an OpenAI error object (so are unknown paths, wrong methods and
internal errors). Tools are checked in `tools`; `response_format` becomes the grammar the answer is
held to (`core.constraint`)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from localspec.base.config import GenerationLimits, SamplingConfig
from localspec.base.errors import LocalspecError
from localspec.core.constraint import json_grammar

FIM_TOKENS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))
"""Fill-in-the-middle tokens, Qwen2.5-Coder's and StarCoder's spelling (prefix, suffix, middle)."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "unavailable_error"}

MAX_STOPS = 32
"""Editors send a handful of stop strings for code completion; more than this is a mistake."""

MAX_TOP_LOGPROBS = {True: 20, False: 5}
"""Alternatives per token OpenAI allows, by endpoint (chat: `top_logprobs`; completions: `logprobs`)."""


class ApiError(Exception):
    """A request refused: answered as an OpenAI error object with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def _api_error(request: Request, exc: ApiError) -> Response:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(exc.status_code, message.get(exc.status_code, str(exc.detail)), headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    return error_response(500, f"internal error: {exc!r}")


ERROR_HANDLERS = {ApiError: _api_error, HTTPException: _http_error, Exception: _server_error}
"""Starlette's exception handlers: every failure reaches the client as an OpenAI error object."""


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


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's earlier tool calls, for the template: arguments as the object they
    encode, since templates write them with `tojson` (a JSON string would be quoted twice)."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}: 'tool_calls' must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{where}: tool_calls[{j}] must be {{id, type, function: {{name, arguments}}}}", "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass  # not JSON: the model said it so; the template writes it as it stands
        out.append({"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


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
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}]: role must be system, developer, user, assistant or tool, got {json.dumps(m.get('role'))[:40]}", "messages")
        content = m.get("content")
        message = {"role": role, "content": "" if content is None and role == "assistant" else _text(content, f"messages[{i}]")}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{i}]")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(400, f"messages[{i}]: a tool message needs the 'tool_call_id' it answers", "messages")
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def parse_prompt(body: dict, name: str, vocab: int | None = None) -> str | list[int]:
    """A prompt's text; with `vocab`, also token ids (as lm-evaluation-harness sends), each below it."""
    value = body.get(name)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):  # OpenAI also takes a batch; one prompt is one
        value = value[0]
    if vocab is not None and isinstance(value, list) and value:
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in value):
            raise ApiError(400, f"'{name}' as token ids must be integers from 0 to {vocab - 1}", name)
        return value
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a string" + (" or a list of token ids" if vocab is not None else ""), name)
    return value


def parse_echo(body: dict) -> bool:
    """Completions' `echo`: the prompt's own tokens before the answer (scored with `logprobs`)."""
    return bool(_typed(body, "echo", (bool,), "true or false"))


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token a request wants with its log-probabilities; None: none asked.
    Chat asks with `logprobs: true` and `top_logprobs`, completions with `logprobs: N`."""
    most = MAX_TOP_LOGPROBS[chat]
    if not chat:
        return _number(body, "logprobs", 0, most, integer=True)
    top = _number(body, "top_logprobs", 0, most, integer=True)
    if not _typed(body, "logprobs", (bool,), "true or false"):
        if top is not None:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def parse_response_format(body: dict) -> str | None:
    """`response_format`: the grammar a JSON answer is held to; None: text. `json_object` is any
    JSON object, `json_schema` its schema (always enforced: `strict: false` is held as strictly)."""
    value = body.get("response_format")
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise ApiError(400, "'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}", "response_format")
    schema = None
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ApiError(400, "'response_format.json_schema' must be {\"name\": ..., \"schema\": {...}, \"strict\": true}", "response_format")
        _typed(spec, "strict", (bool,), "true or false")
        schema = spec.get("schema", {})  # OpenAI's default: no schema, any JSON value
    try:
        return json_grammar(schema)
    except LocalspecError as exc:
        raise ApiError(400, str(exc), "response_format") from None


def parse_settings(body: dict, model: str, context_len: int, prompt_only: bool = False) -> tuple[SamplingConfig, GenerationLimits | None]:
    """The sampling and stopping fields both endpoints share, checked with OpenAI's ranges. With
    `prompt_only` (an echo), `max_tokens: 0` asks for the prompt alone: limits None."""
    name = body.get("model")
    if name is not None and name != model:
        raise ApiError(404, f"model {json.dumps(name)[:80]} is not served here; this server runs {model!r}", "model", "model_not_found")
    if _number(body, "n", 1, 128, integer=True) not in (None, 1):
        raise ApiError(400, "'n' must be 1: one answer per request", "n")
    if body.get("functions"):
        raise ApiError(400, "'functions' is not supported by localspec; send them as 'tools'", "functions")
    for penalty in ("frequency_penalty", "presence_penalty"):
        if _number(body, penalty, -2, 2):
            raise ApiError(400, f"'{penalty}' is not supported by localspec (only 0)", penalty)
    _typed(body, "stream", (bool,), "true or false")
    options = _typed(body, "stream_options", (dict,), "an object")
    if options is not None:
        _typed(options, "include_usage", (bool,), "true or false")
    chosen = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, chosen, 0 if prompt_only else 1, context_len, integer=True)
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
    if max_tokens == 0:
        return sampling, None
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
