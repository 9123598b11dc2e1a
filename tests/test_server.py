"""`localspec serve`: the OpenAI API over tiny in-process engines (exact answers, bad requests, the
single stream with its queue and disconnects, metrics, security), and over real small models (the
`openai` client on smollm2-135m, fill-in-the-middle on qwen2.5-coder-0.5b)."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import torch
import uvicorn
from starlette.testclient import TestClient

from conftest import CharTokenizer, tiny_model
from localspec.apps.cli import main
from localspec.apps.serve.app import create_app, listen
from localspec.apps.serve.config import ServeConfig
from localspec.apps.serve.metrics import timings
from localspec.apps.serve.turns import Served
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core.engine import Engine
from localspec.core.events import FinalEvent
from localspec.core.proposers import NgramProposer

GREEDY = SamplingConfig(temperature=0.0)
HELLO = [{"role": "user", "content": "abcdabcdabcd say abcd"}]
OK = {"model": "tiny", "messages": HELLO, "max_tokens": 24, "temperature": 0}


class ChatCharTokenizer(CharTokenizer):
    """Characters as tokens, with a chat template, so an answer's tokens follow its prompt's as in
    a real model's conversation."""

    chat_template = "<role>content"

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return self.encode(text + "<assistant>" * add_generation_prompt)


def tiny_engine() -> Engine:
    # the same seed every time: a fresh engine computes the answer a served one must give
    return Engine(tiny_model("llama", seed=0), ChatCharTokenizer(), NgramProposer(), SpecConfig(draft_len=3))


def expected(prompt, n: int) -> str:
    return "".join(e.text for e in tiny_engine().generate(prompt, GREEDY, GenerationLimits(n)))


class Gated:
    """A real engine whose passes wait for the test's go-ahead while `held`; records each
    generation's passes and when it started and ended."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.held = False
        self.go = threading.Semaphore(0)
        self.runs: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt, sampling, limits, **options):
        run = {"start": time.monotonic(), "end": None, "passes": 0}
        self.runs.append(run)
        inner = self.engine.generate(prompt, sampling, limits, **options)
        try:
            while True:
                if self.held:
                    self.go.acquire()
                event = next(inner, None)
                if event is None:
                    return
                yield event
        finally:
            inner.close()
            run["passes"], run["end"] = self.engine.stats.passes, time.monotonic()


def wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@contextmanager
def client_for(engine, **config):
    app = create_app(lambda: Served("tiny", engine), ServeConfig(**config))
    with TestClient(app) as client:
        wait_for(lambda: client.get("/health").status_code == 200)
        yield client


@contextmanager
def http_server(app):
    """The app on uvicorn over real HTTP on a free local port, in a thread."""
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    wait_for(lambda: server.started)
    wait_for(lambda: httpx.get(url + "/health").status_code == 200, 120)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


def events(lines) -> list:
    """Server-sent events: the JSON payloads, and '[DONE]'."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metrics(client) -> dict[str, float]:
    values = {}
    for line in client.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# -- answers --------------------------------------------------------------------------------------

def test_chat_and_completion_answers_are_exact_with_usage_and_timings():
    with client_for(tiny_engine()) as client:
        r = client.post("/v1/chat/completions", json=OK)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": expected(HELLO, 24)}
        assert choice["finish_reason"] in ("stop", "length")
        prompt_tokens = len(tiny_engine().encode(HELLO))
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": body["timings"]["predicted_n"],
                                 "total_tokens": prompt_tokens + body["timings"]["predicted_n"]}
        assert body["timings"]["proposer"] == "ngram" and body["timings"]["draft_n_accepted"] > 0

        r = client.post("/v1/completions", json={"prompt": "xyzxyzxyz", "max_tokens": 16, "temperature": 0})
        ids = CharTokenizer().encode("xyzxyzxyz")
        assert r.json()["choices"][0]["text"] == expected(ids, 16)
        assert r.json()["object"] == "text_completion" and r.json()["usage"]["prompt_tokens"] == len(ids)


def test_streamed_chat_matches_the_whole_answer_and_ends_with_usage():
    with client_for(tiny_engine()) as client:
        whole = client.post("/v1/chat/completions", json=OK).json()
        stream = {**OK, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/chat/completions", json=stream) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks = events(r.iter_lines())
        assert chunks[-1] == "[DONE]"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-2])
        assert text == whole["choices"][0]["message"]["content"]
        assert chunks[-3]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
        assert chunks[-2]["choices"] == [] and chunks[-2]["usage"] == whole["usage"]

        with client.stream("POST", "/v1/completions", json={"prompt": "xyzxyz", "max_tokens": 8, "temperature": 0, "stream": True}) as r:
            chunks = events(r.iter_lines())
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == expected(CharTokenizer().encode("xyzxyz"), 8)
        assert "usage" not in chunks[-2] and chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_and_seeded_sampling():
    with client_for(tiny_engine()) as client:
        full = client.post("/v1/chat/completions", json=OK).json()["choices"][0]["message"]["content"]
        stop = full[5:7]
        cut = client.post("/v1/chat/completions", json={**OK, "stop": stop}).json()["choices"][0]
        assert cut["message"]["content"] == full[: full.find(stop)] and cut["finish_reason"] == "stop"
        sampled = {**OK, "temperature": 0.9, "top_p": 0.9, "seed": 7}
        a, b = (client.post("/v1/chat/completions", json=sampled).json()["choices"][0]["message"]["content"] for _ in range(2))
        assert a == b


def test_a_follow_up_turn_reuses_the_cached_conversation():
    with client_for(tiny_engine()) as client:
        first = client.post("/v1/chat/completions", json=OK).json()
        history = HELLO + [first["choices"][0]["message"], {"role": "user", "content": "again"}]
        second = client.post("/v1/chat/completions", json={**OK, "messages": history}).json()
        assert second["choices"][0]["message"]["content"] == expected(history, 24)
        # the first turn's prompt and answer (all but the answer's last token) were not prefilled again
        assert second["timings"]["cache_n"] >= first["usage"]["total_tokens"] - 1
        assert first["timings"]["cache_n"] == 0


class EventsOnly:
    """A real engine with only what the server may use: no `stats`, no `kv_tokens`, so a number
    taken from anywhere but the events fails. Keeps each answer's finished statistics."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.tokenizer, self.context_len = engine, engine.tokenizer, engine.context_len
        self.proposer_name, self.proposer_reason = engine.proposer_name, engine.proposer_reason
        self.finals = []

    def encode(self, *args, **kw):
        return self.engine.encode(*args, **kw)

    def generate(self, prompt, sampling, limits, **options):
        for event in self.engine.generate(prompt, sampling, limits, **options):
            if isinstance(event, FinalEvent):
                self.finals.append(event.stats)
            yield event


def test_timings_are_the_final_events_statistics():
    engine = EventsOnly(tiny_engine())
    with client_for(engine) as client:
        first = client.post("/v1/chat/completions", json=OK).json()
        history = HELLO + [first["choices"][0]["message"], {"role": "user", "content": "again"}]
        with client.stream("POST", "/v1/chat/completions", json={**OK, "messages": history, "stream": True}) as r:
            second = events(r.iter_lines())[-2]["timings"]
    assert [first["timings"], second] == [timings(stats) for stats in engine.finals]
    assert first["timings"]["cache_n"] == 0 and second["cache_n"] == engine.finals[1].cached_tokens > 0


# -- bad requests ---------------------------------------------------------------------------------

BAD = [
    ("/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", b'{"messages": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("/v1/chat/completions", "[1, 2]", 400, "must be a JSON object"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "'messages' must be a list"),
    ("/v1/chat/completions", {"messages": []}, 400, "'messages' is empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "'content' must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role must be"),
    ("/v1/chat/completions", {**OK, "temperature": "hot"}, 400, "'temperature' must be a number"),
    ("/v1/chat/completions", {**OK, "max_tokens": 1.5}, 400, "'max_tokens' must be an integer"),
    ("/v1/chat/completions", {**OK, "max_tokens": 10**12}, 400, "'max_tokens' must be an integer from 1 to 512"),
    ("/v1/chat/completions", {**OK, "stream": "yes"}, 400, "'stream' must be true or false"),
    ("/v1/chat/completions", {**OK, "model": "gpt-4o"}, 404, "is not served here"),
    ("/v1/chat/completions", {**OK, "n": 2}, 400, "'n' must be 1"),
    ("/v1/chat/completions", {**OK, "top_p": 0}, 400, "'top_p' must be a number in (0, 1]"),
    ("/v1/chat/completions", {**OK, "stop": ["", "x"]}, 400, "'stop' must be"),
    ("/v1/chat/completions", {**OK, "top_logprobs": 2}, 400, "'top_logprobs' needs 'logprobs': true"),
    ("/v1/chat/completions", {**OK, "logprobs": True, "top_logprobs": 21}, 400, "'top_logprobs' must be an integer from 0 to 20"),
    ("/v1/chat/completions", {**OK, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "does not render tools"),
    ("/v1/chat/completions", {**OK, "tool_choice": "required"}, 400, "'tool_choice' needs 'tools'"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400, "needs the 'tool_call_id'"),
    ("/v1/completions", {"prompt": "xyz", "logprobs": 6}, 400, "'logprobs' must be an integer from 0 to 5"),
    ("/v1/completions", {"prompt": "xyz", "max_tokens": 0}, 400, "'max_tokens' must be an integer from 1"),
    ("/v1/completions", {"prompt": [1, 2, 96]}, 400, "token ids must be integers from 0 to 95"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 600}]}, 400, "context window is 512 tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 70_000}]}, 413, "limit of 65536 bytes"),
    ("/v1/completions", {"prompt": 5}, 400, "'prompt' must be a string"),
    ("/v1/completions", {"prompt": "def f(", "suffix": ")"}, 400, "no fill-in-the-middle tokens"),
    ("/v1/nope", {}, 404, "no such endpoint: /v1/nope"),
]


def test_every_bad_request_gets_an_openai_error_and_the_next_request_succeeds():
    with client_for(tiny_engine(), max_body=65536) as client:
        for path, body, status, message in BAD:
            content = body if isinstance(body, (str, bytes)) else json.dumps(body)
            r = client.post(path, content=content, headers={"content-type": "application/json"})
            assert r.status_code == status, (body, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert message in error["message"] and "\n" not in error["message"] and "Traceback" not in error["message"]
            assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
            good = client.post("/v1/chat/completions", json={**OK, "max_tokens": 2})
            assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"]
        r = client.get("/v1/chat/completions")
        assert r.status_code == 405 and "GET is not allowed" in r.json()["error"]["message"]


def test_health_is_503_while_the_model_loads_and_when_loading_fails():
    release = threading.Event()

    def slow_load():
        release.wait(10)
        return Served("tiny", tiny_engine())

    with TestClient(create_app(slow_load)) as client:
        r = client.get("/health")
        assert r.status_code == 503 and "still loading" in r.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=OK).status_code == 503
        release.set()
        wait_for(lambda: client.get("/health").status_code == 200)
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"

    def broken():
        raise LocalspecError("no such file")

    with TestClient(create_app(broken)) as client:
        wait_for(lambda: "failed" in client.get("/health").text)
        assert client.get("/health").json()["error"]["message"] == "the model failed to load: no such file"


# -- one stream at a time -------------------------------------------------------------------------

def test_queue_serves_clients_one_after_the_other_and_refuses_beyond_it():
    gated = Gated(tiny_engine())
    app = create_app(lambda: Served("tiny", gated), ServeConfig(queue=1))
    service = app.state.service
    other = [{"role": "user", "content": "xyzw xyzw"}]
    answers = {}
    with http_server(app) as url:
        gated.held = True

        def ask(name, messages):
            r = httpx.post(url + "/v1/chat/completions", json={**OK, "messages": messages}, timeout=30)
            answers[name] = r.json()["choices"][0]["message"]["content"]

        first = threading.Thread(target=ask, args=("first", HELLO))
        first.start()
        wait_for(lambda: len(gated.runs) == 1)  # the first is generating (held between passes)
        second = threading.Thread(target=ask, args=("second", other))
        second.start()
        wait_for(lambda: service.waiting == 1)
        r = httpx.post(url + "/v1/chat/completions", json=OK)
        assert r.status_code == 429 and "the server is busy" in r.json()["error"]["message"]
        gated.held = False
        gated.go.release()
        first.join(30)
        second.join(30)
        text = httpx.get(url + "/metrics").text
    assert answers == {"first": expected(HELLO, 24), "second": expected(other, 24)}
    assert gated.runs[0]["end"] <= gated.runs[1]["start"]
    assert "localspec_rejected_requests_total 1" in text


def test_a_client_that_disconnects_frees_the_server_within_one_pass():
    gated = Gated(tiny_engine())
    app = create_app(lambda: Served("tiny", gated))
    service = app.state.service
    with http_server(app) as url:
        gated.held = True
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", url + "/v1/chat/completions", json={**OK, "max_tokens": 200, "stream": True}) as r:
                lines = r.iter_lines()
                assert "assistant" in next(lines)  # the role chunk comes before any pass
                gated.go.release()
                assert "content" in next(line for line in lines if line)  # one pass's text
        # the server notices and frees the slot; the pass it had asked for is the last one
        wait_for(lambda: not service.lock.locked())
        gated.held = False
        gated.go.release()
        history = HELLO + [{"role": "assistant", "content": "abcd"}, {"role": "user", "content": "more"}]
        r = httpx.post(url + "/v1/chat/completions", json={**OK, "messages": history}, timeout=30)
        body = r.json()
        text = httpx.get(url + "/metrics").text
    # the pass read, and at most the one asked for before the server saw the client leave
    assert gated.runs[0]["passes"] <= 2
    assert body["choices"][0]["message"]["content"] == expected(history, 24)
    assert body["timings"]["cache_n"] > 0  # the cut-short conversation's cache was sound and reused
    assert 'localspec_generations_total{finish="cancelled"} 1' in text


def test_a_client_that_gives_up_on_a_whole_answer_stops_it_too():
    gated = Gated(tiny_engine())
    app = create_app(lambda: Served("tiny", gated))
    with http_server(app) as url:
        gated.held = True
        with pytest.raises(httpx.ReadTimeout):  # the client stops waiting and closes the connection
            httpx.post(url + "/v1/chat/completions", json={**OK, "max_tokens": 200}, timeout=0.5)
        wait_for(lambda: not app.state.service.lock.locked())
        gated.held = False
        gated.go.release()
        wait_for(lambda: all(run["end"] is not None for run in gated.runs))
        assert sum(run["passes"] for run in gated.runs) <= 1  # at most the pass it was waiting for
        assert httpx.post(url + "/v1/chat/completions", json=OK).json()["choices"][0]["message"]["content"] == expected(HELLO, 24)


def test_shutdown_cuts_the_answer_in_progress_short_and_says_why():
    gated = Gated(tiny_engine())
    app = create_app(lambda: Served("tiny", gated))
    with http_server(app) as url:
        gated.held = True
        with httpx.stream("POST", url + "/v1/chat/completions", json={**OK, "max_tokens": 200, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert "assistant" in next(lines)
            wait_for(lambda: len(gated.runs) == 1)  # its first pass is waiting at the gate
            app.state.service.shutdown()  # what Ctrl-C does first
            gated.held = False
            gated.go.release()
            chunks = events(lines)
        assert chunks[-1]["error"]["message"] == "the server is shutting down; the answer was cut short"
        assert gated.runs[0]["passes"] == 1
        r = httpx.post(url + "/v1/chat/completions", json=OK)
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"


def test_metrics_move_by_exactly_what_timings_report():
    keys = {"prompt_n": "prompt_tokens_total", "cache_n": "prompt_cached_tokens_total",
            "predicted_n": "generated_tokens_total", "passes": "passes_total", "drafts": "drafts_total",
            "draft_n": "drafted_tokens_total", "draft_n_accepted": "accepted_tokens_total"}
    with client_for(tiny_engine()) as client:
        for stream in (False, True):
            before = metrics(client)
            request = {**OK, "messages": HELLO + [{"role": "user", "content": f"stream {stream}"}], "stream": stream}
            if stream:
                with client.stream("POST", "/v1/chat/completions", json=request) as r:
                    figures = events(r.iter_lines())[-2]["timings"]
            else:
                figures = client.post("/v1/chat/completions", json=request).json()["timings"]
            after = metrics(client)
            assert figures["draft_n_accepted"] > 0
            for key, name in keys.items():
                assert after[f"localspec_{name}"] - before.get(f"localspec_{name}", 0) == figures[key], key
            for i, n in enumerate(figures["accepted_at_position"]):
                name = f'localspec_accepted_at_position_total{{position="{i}"}}'
                assert after[name] - before.get(name, 0) == n
        assert after['localspec_generations_total{finish="length"}'] + after.get('localspec_generations_total{finish="stop"}', 0) == 2


# -- security -------------------------------------------------------------------------------------

def test_bind_defaults_key_and_cors():
    assert ServeConfig().host == "127.0.0.1"
    for host in ("localhost", "::1", "127.0.0.2"):
        ServeConfig(host=host)
    with pytest.raises(LocalspecError, match="refusing to listen on 0.0.0.0 without --api-key"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", api_key="k")
    ServeConfig(host="0.0.0.0", insecure=True)

    with client_for(tiny_engine(), api_key="sesame") as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert client.get("/metrics", headers=headers).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer sesame"}).status_code == 200
        preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
        assert "access-control-allow-origin" not in client.options("/v1/chat/completions", headers=preflight).headers

    with client_for(tiny_engine(), cors=("http://ui.example",)) as client:
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = client.get("/v1/models", headers={"Origin": "http://ui.example"})
        assert r.headers["access-control-allow-origin"] == "http://ui.example"


@pytest.mark.parametrize("argv, message", [
    (["serve", "--host", "0.0.0.0"], "refusing to listen on 0.0.0.0"),
    (["serve", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["serve", "--port", "70000"], "--port must be between 0 and 65535"),
])
def test_serve_refuses_bad_options_in_one_line_before_loading(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("localspec: error:") and message in err and "\n" not in err


# -- real models ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_server():
    from localspec.store.loading import load_model
    from localspec.store.registry import load_registry

    smollm2 = load_model(load_registry().get("smollm2-135m"), torch.float32, progress=False)
    engine = Engine(smollm2.model, smollm2.tokenizer, NgramProposer())
    with http_server(create_app(lambda: Served("smollm2-135m", engine))) as url:
        yield url, smollm2


@pytest.mark.real_model
def test_openai_client_gets_what_localspec_run_prints(smollm2_server, capsys):
    import openai

    url, smollm2 = smollm2_server
    prompt = "List three colours."
    assert main(["run", prompt, "--model", "smollm2-135m", "--proposer", "ngram", "--dtype", "float32",
                 "--quant", "none", "--max-new-tokens", "12", "--json"]) == 0
    run = json.loads(capsys.readouterr().out)

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["smollm2-135m"]
    ask = dict(model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].message.content == run["text"]
    assert whole.usage.prompt_tokens == run["stats"]["prompt_tokens"]
    assert whole.usage.completion_tokens == run["stats"]["new_tokens"]

    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == run["text"]
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens

    code = "def fibonacci(n):\n"
    completion = client.completions.create(model="smollm2-135m", prompt=code, max_tokens=8, temperature=0)
    reference = Engine(smollm2.model, smollm2.tokenizer, None)
    ids = smollm2.tokenizer.encode(code)
    assert completion.choices[0].text == "".join(e.text for e in reference.generate(ids, GREEDY, GenerationLimits(8)))
    assert completion.usage.prompt_tokens == len(ids) and completion.usage.completion_tokens == 8


@pytest.mark.real_model
def test_fill_in_the_middle_on_a_coder_model():
    from localspec.store.loading import load_model
    from localspec.store.registry import load_registry

    coder = load_model(load_registry().get("qwen2.5-coder-0.5b"), torch.float32, quant="none", progress=False)
    engine = Engine(coder.model, coder.tokenizer, NgramProposer())
    app = create_app(lambda: Served("qwen2.5-coder-0.5b", engine))
    with TestClient(app) as client:
        wait_for(lambda: client.get("/health").status_code == 200, 60)
        r = client.post("/v1/completions", json={
            "prompt": "def add(a, b):\n    return ", "suffix": "\n\n\nprint(add(1, 2))\n",
            "max_tokens": 8, "temperature": 0, "stop": ["\n"],
        })
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"].strip() == "a + b"
