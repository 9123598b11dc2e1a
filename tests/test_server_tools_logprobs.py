"""`localspec serve`'s tool calls and likelihoods, through the real `openai` client against the
in-process app: log-probabilities that are the target's own (recomputed here by a plain forward
pass) under every proposer, in both of OpenAI's shapes, streamed and whole; `echo` with and without
an answer (lm-evaluation-harness's loglikelihood requests); tool calls read back from the model's
text in Qwen's and Llama's forms, streamed deltas that the client assembles into the whole answer,
malformed calls as text."""

from __future__ import annotations

import json
from contextlib import contextmanager

import openai
import pytest
import torch
from openai.lib.streaming.chat import ChatCompletionStreamState

from conftest import CharTokenizer, tiny_model
from test_server import HELLO, ChatCharTokenizer, client_for, events, expected
from localspec.apps.serve.logprobs import TokenTexts
from localspec.apps.serve.tools import TAGGED, WHOLE, ToolCallScanner, ToolRequest, call_form
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.core import engine as engine_module
from localspec.core.engine import Engine
from localspec.core.events import FinalEvent, Piece, TokenEvent
from localspec.core.proposers import DraftModelProposer, NgramProposer
from localspec.core.stats import GenerationStats, PassFigures

GREEDY = SamplingConfig(temperature=0.0)


def proposer(name: str):
    # the draft has the target's weights: it is right almost always, so passes accept several tokens
    return NgramProposer() if name == "ngram" else DraftModelProposer(tiny_model("llama", seed=0))


def engine_with(name: str) -> tuple[Engine, torch.nn.Module]:
    model = tiny_model("llama", seed=0)
    return Engine(model, ChatCharTokenizer(), proposer(name), SpecConfig(draft_len=3)), model


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward pass: row t is the distribution of ids[t + 1]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, V)


@contextmanager
def openai_client(engine):
    with client_for(engine) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)


# -- likelihoods -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_chat_logprobs_are_the_targets_own_under_speculation(name):
    engine, model = engine_with(name)
    with openai_client(engine) as client:
        whole = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24, temperature=0,
                                               logprobs=True, top_logprobs=3)
        chunks = list(client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=24, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True))
    text = whole.choices[0].message.content
    assert text == expected(HELLO, 24)  # asking for logprobs changes no token
    assert whole.model_extra["timings"]["draft_n_accepted"] > 0  # the numbers came from verify passes
    content = whole.choices[0].logprobs.content
    answer = CharTokenizer().encode(text)
    assert [c.token for c in content] == list(text) and [c.bytes for c in content] == [list(ch.encode()) for ch in text]

    prompt = engine.encode(HELLO)
    ref = reference_logprobs(model, prompt + answer)[len(prompt) - 1 : -1]  # (answer, V)
    assert torch.allclose(torch.tensor([c.logprob for c in content]), ref[range(len(answer)), answer], atol=1e-4)
    for c, row in zip(content, ref):
        best = row.topk(3)
        assert len(c.top_logprobs) == 3
        assert [t.token for t in c.top_logprobs] == [chr(32 + i) for i in best.indices.tolist()]
        assert torch.allclose(torch.tensor([t.logprob for t in c.top_logprobs]), best.values, atol=1e-4)
        assert c.top_logprobs[0].token == c.token  # greedy: the answer is the most likely token

    streamed = [e for chunk in chunks if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == text
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
           [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in content]


def test_sampled_answers_report_the_models_raw_distribution():
    engine, model = engine_with("ngram")
    with openai_client(engine) as client:
        r = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=16, temperature=0.9, top_p=0.9,
                                           seed=7, logprobs=True)
    content = r.choices[0].logprobs.content
    answer = CharTokenizer().encode(r.choices[0].message.content)
    prompt = engine.encode(HELLO)
    ref = reference_logprobs(model, prompt + answer)[len(prompt) - 1 : -1]
    # log_softmax of the logits themselves: temperature and top_p shape the draw, not the report
    assert torch.allclose(torch.tensor([c.logprob for c in content]), ref[range(len(answer)), answer], atol=1e-4)
    assert all(c.top_logprobs == [] for c in content)


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_completion_logprobs_whole_and_streamed(name):
    engine, model = engine_with(name)
    prompt = "xyzxyzxyz"
    ask = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    with openai_client(engine) as client:
        whole = client.completions.create(**ask).choices[0]
        chunks = list(client.completions.create(**ask, stream=True))
    ids = CharTokenizer().encode(prompt)
    answer = CharTokenizer().encode(whole.text)
    assert whole.text == expected(ids, 12)
    lp = whole.logprobs
    ref = reference_logprobs(model, ids + answer)[len(ids) - 1 : -1]
    assert lp.tokens == list(whole.text) and lp.text_offset == list(range(len(whole.text)))
    assert torch.allclose(torch.tensor(lp.token_logprobs), ref[range(len(answer)), answer], atol=1e-4)
    for top, row in zip(lp.top_logprobs, ref):
        best = row.topk(2)
        assert list(top) == [chr(32 + i) for i in best.indices.tolist()]  # most likely first
        assert torch.allclose(torch.tensor(list(top.values())), best.values, atol=1e-4)

    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [x for p in parts for x in p.token_logprobs] == lp.token_logprobs
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt_as_a_plain_forward_pass():
    engine, model = engine_with("ngram")
    prompt = "abcabcabd xyz"
    ids = CharTokenizer().encode(prompt)
    ref = reference_logprobs(model, ids)
    with openai_client(engine) as client:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=3, temperature=0)
        streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=3, stream=True))
        plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.tokens == list(prompt) and lp.text_offset == list(range(len(prompt)))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first token
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), ref[range(len(ids) - 1), ids[1:]], atol=1e-4)
    assert all(len(top) == 3 for top in lp.top_logprobs[1:])
    assert "".join(c.choices[0].text for c in streamed) == prompt
    assert [x for c in streamed if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None


def test_lm_evaluation_harness_loglikelihood_request():
    """What lm-evaluation-harness's `local-completions` sends for a loglikelihood item: the context
    and continuation as token ids, echo, one new token, logprobs 1; it sums the continuation's
    token_logprobs (all but the new token) and checks each is the most likely."""
    engine, model = engine_with("draft")
    context, continuation = CharTokenizer().encode("the cat sat on the"), CharTokenizer().encode(" mat")
    ids = context + continuation
    with client_for(engine) as client:
        first = client.post("/v1/completions", json={"prompt": "warm the cache"})  # a cached prefix must not leak in
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": [ids], "max_tokens": 1, "temperature": 0,
                                                 "logprobs": 1, "echo": True, "seed": 1234})
    assert first.status_code == 200 and r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    ref = reference_logprobs(model, ids)
    want = ref[range(len(context) - 1, len(ids) - 1), continuation]
    got = lp["token_logprobs"][len(context) : -1]
    assert sum(got) == pytest.approx(want.sum().item(), abs=1e-4)
    greedy = all(token == max(top.values()) for token, top in zip(got, lp["top_logprobs"][len(context) : -1]))
    assert greedy == all(ref[len(context) - 1 + i].argmax().item() == t for i, t in enumerate(continuation))


def test_echo_then_an_answer_and_a_chat_follow_up_on_the_same_cache():
    engine, model = engine_with("ngram")
    prompt = "xyzxyzxyz"
    ids = CharTokenizer().encode(prompt)
    with client_for(engine) as client:
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 0}).json()
        again = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
    text = r["choices"][0]["text"]
    assert text == prompt + expected(ids, 6) and again["choices"][0]["text"] == expected(ids, 6)
    assert again["timings"]["cache_n"] == len(ids) - 1  # the scoring prefill left a sound cache
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"] == list(text) and lp["top_logprobs"][1:] == [{}] * (len(text) - 1)
    ref = reference_logprobs(model, CharTokenizer().encode(text))
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), ref[range(len(text) - 1), CharTokenizer().encode(text)[1:]], atol=1e-4)


def test_no_likelihood_is_computed_unless_asked(monkeypatch):
    def refuse(*args):
        raise AssertionError("log-probabilities computed for a generation that did not ask")

    monkeypatch.setattr(engine_module, "likelihoods", refuse)
    engine, _ = engine_with("draft")
    pieces = [p for event in engine.generate(HELLO, GREEDY, GenerationLimits(16)) for p in event.pieces]
    assert pieces and all(p.likelihood is None for p in pieces)


def test_token_texts_name_part_of_a_character_by_its_bytes():
    class ByteLevel(CharTokenizer):
        """Two tokens that are each half of 'é' (0xC3 0xA9), spelt in byte-level BPE's alphabet."""

        def decode(self, ids, skip_special_tokens: bool = True) -> str:
            return "\ufffd" if ids[0] in (1, 2) else super().decode(ids)

        def convert_ids_to_tokens(self, token: int) -> str:
            return {1: "\u00c3", 2: "\u00a9"}[token]

    texts = TokenTexts(ByteLevel())
    texts.learn([Piece("", 1, False), Piece("é", 2, False), Piece("a", 65, False)])
    assert texts[1] == ("bytes:\\xc3", [0xC3]) and texts[2] == ("bytes:\\xa9", [0xA9]) and texts[65] == ("a", [97])


# -- tool calls: the scanner -----------------------------------------------------------------------

def tools_for(form: str, parallel: bool = True, names=("get_weather", "get_time")) -> ToolRequest:
    return ToolRequest([], frozenset(names), "auto", parallel, form)


def scan(text: str, request: ToolRequest, step: int | None = None) -> tuple[str, list[tuple[str, dict]]]:
    """The text pushed whole, or `step` characters at a time: (content, [(name, arguments)])."""
    scanner = ToolCallScanner(request)
    parts = []
    for at in range(0, len(text), step or max(len(text), 1)):
        parts += scanner.push(text[at : at + (step or len(text))])
    parts += scanner.finish()
    content = "".join(p for p in parts if isinstance(p, str))
    return content, [(p.name, json.loads(p.arguments)) for p in parts if not isinstance(p, str)]


QWEN_TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                  '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')

SCANNED = [
    (TAGGED, QWEN_TWO_CALLS, ("Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})])),
    (TAGGED, '<tool_call>\n{"name": "get_time"}\n</tool_call>', ("", [("get_time", {})])),
    (TAGGED, '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>', ("", [("get_time", {"zone": "UTC"})])),
    (TAGGED, "No tools needed: 2 < 3 and <b>bold</b>.\n", ("No tools needed: 2 < 3 and <b>bold</b>.\n", [])),
    (TAGGED, '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
     ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', [])),  # malformed JSON
    (TAGGED, '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
     ('<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>', [])),  # a tool not offered
    (TAGGED, '<tool_call>\n{"name": "get_time", "arguments": {', ('<tool_call>\n{"name": "get_time", "arguments": {', [])),  # cut short
    (TAGGED, '{"name": "get_weather", "arguments": {"city": "Paris"}}', ("", [("get_weather", {"city": "Paris"})])),  # no tags
    (TAGGED, '{"answer": 42}', ('{"answer": 42}', [])),
    (WHOLE, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', ("", [("get_weather", {"city": "Oslo"})])),
    (WHOLE, ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
     ("", [("get_weather", {"city": "Oslo"}), ("get_time", {})])),
    (WHOLE, '[{"name": "get_time", "arguments": {"zone": "CET"}}]', ("", [("get_time", {"zone": "CET"})])),
    (WHOLE, 'The answer is {"name": "get_time"}', ('The answer is {"name": "get_time"}', [])),
    (WHOLE, '{"name": "get_weather", "parameters": {"city": "Oslo"}', ('{"name": "get_weather", "parameters": {"city": "Oslo"}', [])),
    (WHOLE, '{"city": "Oslo"}', ('{"city": "Oslo"}', [])),  # JSON, but no call
]


@pytest.mark.parametrize("form, text, want", SCANNED)
def test_tool_calls_are_read_from_the_models_text_whole_and_streamed(form, text, want):
    assert scan(text, tools_for(form)) == want
    for step in (1, 3, 7):  # a stream cut anywhere, even inside a tag, reads the same
        assert scan(text, tools_for(form), step) == want


def test_without_parallel_calls_only_the_first_is_returned():
    assert scan(QWEN_TWO_CALLS, tools_for(TAGGED, parallel=False), 5) == ("Let me look.", [("get_weather", {"city": "Paris"})])


def test_text_is_held_back_only_while_it_may_start_a_tag():
    scanner = ToolCallScanner(tools_for(TAGGED))
    assert scanner.push("Hot <tool") == ["Hot"]  # " <tool" may open a call; the space may end the content
    assert scanner.push("box> today") == [" <toolbox> today"]
    assert scanner.finish() == []


def test_the_template_decides_the_form():
    class Template:
        def __init__(self, text):
            self.chat_template = text

    assert call_form(Template("{% if tools %}...<tool_call>{{ name }}</tool_call>{% endif %}")) == TAGGED
    assert call_form(Template('{% if tools %}{"name": function name, "parameters": ...}{% endif %}')) == WHOLE
    assert call_form(Template("{{ message.content }}")) is None
    assert call_form(CharTokenizer()) is None


# -- tool calls through the server -----------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


class ToolTemplateTokenizer(ChatCharTokenizer):
    """A chat template in Qwen's manner: tools listed in the system turn, calls as <tool_call> blocks,
    tool results as <tool_response>."""

    chat_template = "{% if tools %}<tools>...</tools><tool_call>{% endif %}"

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool, tools=None):
        text = f"<tools>{json.dumps([t['function']['name'] for t in tools])}\n" if tools else ""
        for m in messages:
            calls = "".join(f"<tool_call>{json.dumps(c['function'])}</tool_call>" for c in m.get("tool_calls", ()))
            text += f"<{m['role']}>{m['content']}{calls}\n"
        text += "<assistant>" * add_generation_prompt
        return self.encode(text) if tokenize else text


class ScriptedEngine:
    """Answers with the same scripted token texts, one pass each: a tiny random model cannot be made
    to call a tool on cue. Records the prompts the template rendered."""

    proposer_name, proposer_reason, context_len, vocab_size = "scripted", "", 4096, 96

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.tokenizer, self.rendered = texts, ToolTemplateTokenizer(), []

    def encode(self, messages, tools=None) -> list[int]:
        self.rendered.append(self.tokenizer.apply_chat_template(messages, True, tokenize=False, tools=tools))
        return self.tokenizer.encode(self.rendered[-1])

    def generate(self, ids, sampling, limits, **options):
        for i, text in enumerate(self.texts):
            pieces, figures = [Piece(text, 65, False)], PassFigures(tokens=1)
            if i + 1 < len(self.texts):
                yield TokenEvent(pieces, figures)
            else:
                yield FinalEvent(pieces, figures, GenerationStats(prompt_tokens=len(ids), new_tokens=len(self.texts), stop_reason="eos"))


SCRIPTED_CALLS = ["Let me ", "look.\n<tool", '_call>\n{"name": "get_', 'weather", "arguments": {"city": "Pa',
                  'ris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>']


def streamed_and_whole(engine, **ask):
    with openai_client(engine) as client:
        whole = client.chat.completions.create(model="tiny", **ask)
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(model="tiny", stream=True, **ask):
            state.handle_chunk(chunk)
    return whole.choices[0], state.get_final_completion().choices[0]


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def test_tool_calls_whole_and_streamed_assemble_alike_and_history_with_tools_is_accepted():
    engine = ScriptedEngine(SCRIPTED_CALLS)
    history = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "And Paris, and the time?"},
    ]
    whole, streamed = streamed_and_whole(engine, messages=history, tools=TOOLS)
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    assert whole.message.content == streamed.message.content == "Let me look."
    assert calls_of(whole.message) == calls_of(streamed.message) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert [c.id for c in whole.message.tool_calls] != [c.id for c in streamed.message.tool_calls]  # one id per call made
    assert all(c.id.startswith("call_") and c.type == "function" for c in whole.message.tool_calls)
    rendered = engine.rendered[0]
    assert rendered.startswith('<tools>["get_weather", "get_time"]')
    # the earlier call reached the template as an object, the tool's answer in its own turn
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in rendered
    assert "<tool>sunny" in rendered


def test_a_malformed_call_comes_back_as_text_with_stop():
    engine = ScriptedEngine(["<tool_call>\n", '{"name": "get_weather", "arguments": {"city": ', "Paris}}\n</tool_call>"])
    whole, streamed = streamed_and_whole(engine, messages=HELLO, tools=TOOLS)
    text = "".join(engine.texts)
    assert whole.finish_reason == streamed.finish_reason == "stop"
    assert whole.message.content == streamed.message.content == text
    assert whole.message.tool_calls is None and not streamed.message.tool_calls


def test_tool_choice_renders_what_it_asks():
    engine = ScriptedEngine(["It is sunny."])
    system = [{"role": "system", "content": "Be brief."}, *HELLO]
    with openai_client(engine) as client:
        def ask(**choice):
            r = client.chat.completions.create(model="tiny", messages=system, tools=TOOLS, **choice)
            return r.choices[0], engine.rendered[-1]

        choice, rendered = ask(tool_choice="none")
        assert not rendered.startswith("<tools>") and choice.message.content == "It is sunny."
        _, rendered = ask(tool_choice="auto")
        assert rendered.startswith('<tools>["get_weather", "get_time"]') and "Answer by calling" not in rendered
        # required: told in the system prompt; a model that answers in text anyway is answered as text
        choice, rendered = ask(tool_choice="required")
        assert "<system>Be brief.\n\nAnswer by calling one or more of the tools above" in rendered
        assert choice.message.content == "It is sunny." and choice.finish_reason == "stop"
        _, rendered = ask(tool_choice="required", parallel_tool_calls=False)
        assert "exactly one of the tools" in rendered
        _, rendered = ask(tool_choice={"type": "function", "function": {"name": "get_time"}})
        assert rendered.startswith('<tools>["get_time"]') and "Answer by calling the tool get_time" in rendered
        bad = client.chat.completions.with_raw_response  # the refusals, as OpenAI error objects
        for wrong, message in ((dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "names no function"),
                               (dict(tool_choice="sometimes"), "'tool_choice' must be"),
                               (dict(parallel_tool_calls="yes"), "'parallel_tool_calls' must be true or false")):
            with pytest.raises(openai.BadRequestError, match=message):
                bad.create(model="tiny", messages=HELLO, tools=TOOLS, **wrong)
        with pytest.raises(openai.BadRequestError, match=r"tools\[0\] must be"):
            bad.create(model="tiny", messages=HELLO, tools=[{"type": "function", "function": {"description": "no name"}}])


def test_a_real_engine_with_tools_answers_in_text_when_it_makes_no_call():
    engine = Engine(tiny_model("llama", seed=0), ToolTemplateTokenizer(), NgramProposer(), SpecConfig(draft_len=3))
    with client_for(engine) as client:
        r = client.post("/v1/chat/completions", json={"messages": HELLO, "tools": TOOLS[1:], "max_tokens": 12, "temperature": 0,
                                                      "logprobs": True})
        with client.stream("POST", "/v1/chat/completions", json={"messages": HELLO, "tools": TOOLS[1:], "max_tokens": 12,
                                                                 "temperature": 0, "stream": True}) as s:
            chunks = events(s.iter_lines())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    reference = Engine(tiny_model("llama", seed=0), ToolTemplateTokenizer(), None)
    ids = reference.encode(HELLO, tools=TOOLS[1:])
    text = "".join(e.text for e in reference.generate(ids, GREEDY, GenerationLimits(12)))
    assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "length"
    assert "".join(t["token"] for t in choice["logprobs"]["content"]) == text
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == text


# -- a real template -------------------------------------------------------------------------------

@pytest.mark.real_model
def test_qwen_template_renders_tools_and_history_and_names_partial_characters():
    from localspec.apps.serve.requests import parse_messages
    from localspec.core.prompt import chat_ids
    from localspec.store.registry import load_registry
    from localspec.store.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(load_registry().get("qwen2.5-coder-0.5b"), progress=False)
    assert call_form(tokenizer) == TAGGED
    messages = parse_messages({"messages": [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]})
    text = tokenizer.decode(chat_ids(tokenizer, messages, tools=TOOLS))
    assert '"name": "get_weather", "description": "Weather in a city"' in text  # the definitions, as the template lists them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")

    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("ꙮ!")  # a rare character: its bytes are split over tokens
    texts.learn([Piece("", i, False) for i in ids])
    assert b"".join(bytes(texts[i][1]) for i in ids) == "ꙮ!".encode()
    assert texts[ids[0]][0].startswith("bytes:\\x")


@pytest.mark.real_model
def test_a_real_qwen_model_calls_a_tool_and_scores_a_prompt():
    from starlette.testclient import TestClient

    from localspec.apps.serve.app import create_app
    from localspec.apps.serve.turns import Served
    from localspec.store.loading import load_model
    from localspec.store.registry import load_registry
    from test_server import wait_for

    coder = load_model(load_registry().get("qwen2.5-coder-0.5b"), torch.float32, quant="none", progress=False)
    engine = Engine(coder.model, coder.tokenizer, NgramProposer())
    with TestClient(create_app(lambda: Served("qwen2.5-coder-0.5b", engine))) as http:
        wait_for(lambda: http.get("/health").status_code == 200, 60)
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http)
        ask = dict(model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": "What is the weather in Paris right now?"}],
                   tools=TOOLS, max_tokens=40, temperature=0)
        whole = client.chat.completions.create(**ask).choices[0]
        state = ChatCompletionStreamState()
        for chunk in client.chat.completions.create(**ask, stream=True):
            state.handle_chunk(chunk)
        streamed = state.get_final_completion().choices[0]
        prompt = "The capital of France is Paris"
        scored = client.completions.create(model="qwen2.5-coder-0.5b", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert whole.finish_reason == streamed.finish_reason == "tool_calls"
    assert calls_of(whole.message) == calls_of(streamed.message) == [("get_weather", '{"city": "Paris"}')]
    assert not whole.message.content and not streamed.message.content

    lp = scored.choices[0].logprobs
    ids = coder.tokenizer.encode(prompt)
    assert "".join(lp.tokens) == prompt and len(lp.tokens) == len(ids)
    ref = reference_logprobs(coder.model, ids)
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), ref[range(len(ids) - 1), ids[1:]], atol=1e-3)
