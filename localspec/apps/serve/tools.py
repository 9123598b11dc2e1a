"""Tool calls on /v1/chat/completions: the request's `tools`, `tool_choice` and
`parallel_tool_calls` checked, the tools rendered by the model's own chat template, and the model's
answer read back into OpenAI's `tool_calls`.

Two forms of answer, chosen by what the template teaches the model:
- tagged (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any
  number, with text around them;
- whole (Llama 3.1): the answer is nothing but the call, `{"name": ..., "parameters": {...}}`
  (several: a JSON list, or objects one after the other). Read under either template: small Qwen
  models (qwen2.5-coder-0.5b) often answer a bare call without the tags.

The same `ToolCallScanner` reads a whole answer and a stream, so a stream assembles to exactly the
whole answer. A call that does not parse comes back as the text it was, never as an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from localspec.apps.serve.requests import ApiError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
TAGGED, WHOLE = "tagged", "whole"


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request's tools ask for, once checked."""

    tools: list[dict]
    """The definitions the template renders (OpenAI's {type: function, function: {...}} shape)."""
    names: frozenset[str]
    choice: str
    """auto, required, or the one function's name the model is told to call."""
    parallel: bool
    """False: at most one call is returned."""
    form: str
    """TAGGED or WHOLE: how this model writes a call."""

    def messages(self, messages: list[dict]) -> list[dict]:
        """The chat with the instruction a required or named call needs in its system message.
        Only an instruction: the model may still answer in text, which then comes back as text
        (holding it to a call is constrained decoding, a separate feature)."""
        if self.choice == "auto":
            return messages
        if self.choice == "required":
            instruction = "Answer by calling " + ("one or more of the tools" if self.parallel else "exactly one of the tools") + \
                          " above, not in plain text."
        else:
            instruction = f"Answer by calling the tool {self.choice}, not in plain text."
        if messages and messages[0]["role"] == "system":
            first = messages[0]
            return [{**first, "content": f"{first['content']}\n\n{instruction}"}, *messages[1:]]
        return [{"role": "system", "content": instruction}, *messages]


def call_form(tokenizer) -> str | None:
    """How the tokenizer's chat template asks the model to call tools; None: it renders no tools."""
    template = getattr(tokenizer, "chat_template", None) or ""
    text = template if isinstance(template, str) else " ".join(str(t) for t in (template.values() if isinstance(template, dict) else template))
    if OPEN in text:
        return TAGGED
    return WHOLE if "tools" in text else None


def _function(tool, i: int) -> dict:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ApiError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": {{...}}}}}}", "tools")
    if not isinstance(function.get("parameters", {}), dict) or not isinstance(function.get("description", ""), str):
        raise ApiError(400, f"tools[{i}]: 'parameters' must be a JSON schema object and 'description' a string", "tools")
    return function


def parse_tools(body: dict, tokenizer, model: str) -> ToolRequest | None:
    """The request's tools, checked; None when the answer is plain text (no tools, or tool_choice none)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ApiError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list of functions", "tools")
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if isinstance(choice, dict):
        named = choice.get("function") if choice.get("type") == "function" else None
        name = named.get("name") if isinstance(named, dict) else None
        if name not in names:
            raise ApiError(400, "'tool_choice' names no function in 'tools': send {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
        # only the named tool is rendered: the model then has no other to reach for
        tools, names, choice = [tools[names.index(name)]], [name], name
    elif choice in (None, "auto", "required"):
        choice = choice or "auto"
    elif choice == "none":
        return None
    else:
        raise ApiError(400, "'tool_choice' must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    form = call_form(tokenizer)
    if form is None:
        raise ApiError(400, f"{model}'s chat template does not render tools, so 'tools' is not supported with it", "tools")
    return ToolRequest(tools, frozenset(names), choice, parallel, form)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str
    """A JSON object, as text (OpenAI's form)."""

    def as_json(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _as_call(value, names: frozenset[str]) -> ToolCall | None:
    """One call the model wrote, if it is one: an object naming an offered tool, with an object of
    arguments (Qwen: "arguments", Llama: "parameters"; a JSON string of one is taken too)."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", value["name"], json.dumps(arguments, ensure_ascii=False))


def _whole_calls(text: str, names: frozenset[str]) -> list[ToolCall] | None:
    """A whole answer that is nothing but calls: one object, a list of them, or objects one after
    the other (separated by white space or ';'); None if any part is not a call."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            break
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values += value if isinstance(value, list) else [value]
    calls = [_as_call(value, names) for value in values]
    return calls if calls and all(calls) else None


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` may be the start of an opening tag."""
    return next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), 0)


class ToolCallScanner:
    """The answer's text, pushed as it comes, released as content text and `ToolCall`s.

    Held back: text that may still become a call (a partial opening tag, an open block, a whole
    answer that starts like JSON) and white space at the end of the content, which is released
    with the next text, or at the end when the answer made no call (around calls it is the
    template's layout, not content)."""

    def __init__(self, request: ToolRequest) -> None:
        self.request = request
        self.held = ""
        """Text not yet released, after what was decided."""
        self.started = False
        """The first text that is not white space has come, so the answer's form is known."""
        self.whole = False
        """The answer started as JSON: a bare call (or several), read once the answer is complete."""
        self.inside = False
        """Tagged: between an opening tag and its closing one."""
        self.blank = ""
        """White space at the end of the released content, held back."""
        self.calls = 0

    def push(self, text: str) -> list[str | ToolCall]:
        self.held += text
        return self._scan(final=False)

    def finish(self) -> list[str | ToolCall]:
        """At the end of the answer: everything still held, as calls or as text."""
        out = self._scan(final=True)
        if self.blank and not self.calls:
            out.append(self.blank)
        self.blank = ""
        return out

    def _scan(self, final: bool) -> list[str | ToolCall]:
        if not self.started:
            first = self.held.lstrip()
            if not first and not final:
                return []
            self.started, self.whole = True, first[:1] in ("{", "[")
        if self.whole or self.request.form == WHOLE:
            return self._scan_whole(final)
        out: list[str | ToolCall] = []
        while True:
            if self.inside:
                end = self.held.find(CLOSE)
                if end < 0:
                    if final:  # never closed: the text it was
                        out += self._content(OPEN + self.held)
                        self.held = ""
                    return out
                body, self.held, self.inside = self.held[:end], self.held[end + len(CLOSE) :], False
                try:
                    call = _as_call(json.loads(body), self.request.names)
                except json.JSONDecodeError:
                    call = None
                out += self._called(call) if call else self._content(OPEN + body + CLOSE)
            else:
                start = self.held.find(OPEN)
                if start < 0:
                    keep = 0 if final else _partial_tag(self.held)
                    out += self._content(self.held[: len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep :]
                    return out
                out += self._content(self.held[:start])
                self.held, self.inside = self.held[start + len(OPEN) :], True

    def _scan_whole(self, final: bool) -> list[str | ToolCall]:
        if self.whole and not final:  # a call is the whole answer: wait for all of it
            return []
        text, self.held = self.held, ""
        calls = _whole_calls(text, self.request.names) if self.whole else None
        if calls is None:
            return self._content(text)
        return [part for call in calls for part in self._called(call)]

    def _called(self, call: ToolCall) -> list[ToolCall]:
        self.calls += 1
        # without parallel calls OpenAI returns at most one; a model that writes more is cut to its first
        return [call] if self.request.parallel or self.calls == 1 else []

    def _content(self, text: str) -> list[str]:
        text = self.blank + text
        body = text.rstrip()
        self.blank = text[len(body) :]
        return [body] if body else []
