"""Structured output under speculation: greedy constrained output through every proposer equals
plain constrained decoding token for token (transformers' own one-token loop, each step's logits
masked by the grammar library's own matcher, independently of localspec's `Constraint`); sampled
constrained output is distributed as the target's constrained distribution (chi-square, with a
deliberately wrong pruning rule that the same test must catch); the answer parses and fits its
schema when the grammar ends it."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import byte_tokenizer, hf_greedy, tiny_model
from localspec.base.config import GenerationLimits, SamplingConfig, SpecConfig
from localspec.base.errors import LocalspecError
from localspec.core import constraint as constraint_module
from localspec.core.constraint import Constraint, json_grammar
from localspec.core.engine import Engine
from localspec.core.proposers import DraftModelProposer, NgramProposer, Proposer
from localspec.core.proposers.eagle import EagleProposer
from localspec.core.sampling import probs_from_logits
from localspec.core.tree import Draft
from test_eagle import CHEAP_WIDE_PASSES, random_head
from test_engine import RandomGuesser
from test_lossless_sampling import chi2, chi2_limit, models

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "ok"],
    "additionalProperties": False,
}
TOKENIZER = byte_tokenizer()
PROMPT = TOKENIZER.encode('Reply: {"name":"ab","tags":["cd"],"ok":false}\nReply: {"name":"abc')
"""Earlier answers in the prompt, so prompt lookup finds the schema's own keys to guess."""
NEW_TOKENS = 48


class GrammarMask(LogitsProcessor):
    """Plain constrained decoding's step: the logits masked by a matcher fed every token so far."""

    def __init__(self, grammar: str, tokenizer, eos: tuple[int, ...], prompt_len: int) -> None:
        self.matcher = LLMatcher(from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=list(eos)), grammar)
        self.prompt_len, self.fed = prompt_len, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        answer = input_ids[0, self.prompt_len :].tolist()
        assert self.matcher.consume_tokens(answer[self.fed :])
        self.fed = len(answer)
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: scores.shape[-1]].astype(bool))  # (V,)
        return scores.masked_fill(~allowed, float("-inf"))


def constrained_greedy(model, prompt: list[int], n: int, grammar: str, tokenizer=TOKENIZER,
                       eos: tuple[int, ...] = (TOKENIZER.eos_token_id,)) -> list[int]:
    """One token at a time: mask, argmax, up to the grammar's EOS (not returned) or n tokens; on
    the model as the engine runs it (row-exact attention, the prompt prefilled but its last token)."""
    answer = hf_greedy(model, prompt, n, eos_token_id=list(eos),
                       logits_processor=LogitsProcessorList([GrammarMask(grammar, tokenizer, eos, len(prompt))]))
    return answer[:-1] if answer and answer[-1] in eos else answer


def answer(engine: Engine, prompt: list[int], n: int, grammar: str, sampling: SamplingConfig = SamplingConfig()) -> list[int]:
    return [p.token_id for ev in engine.generate(prompt, sampling, GenerationLimits(n), grammar=grammar) for p in ev.pieces]


@pytest.fixture
def forbidden(monkeypatch) -> list[int]:
    """Counts the guesses the grammar forbids (cut by `Constraint.prune`, or kept as leaves that
    verification must reject), so a test knows the grammar had work to do."""
    counted = [0]
    prune = Constraint.prune

    def counting(self, draft, greedy):
        pruned, allowed = prune(self, draft, greedy)
        leaves = sum(not allowed[parent + 1, token] for token, parent in zip(pruned.tokens, pruned.parents))
        counted[0] += len(draft) - len(pruned) + leaves
        return pruned, allowed

    monkeypatch.setattr(Constraint, "prune", counting)
    return counted


GRAMMARS = {
    "schema": (SCHEMA, json_grammar(SCHEMA)),
    "any object": ({"type": "object"}, json_grammar(None)),
    # no white space: the tiny model's answer ends inside the test's budget
    "compact schema": (SCHEMA, LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})),
}


@pytest.mark.parametrize("name", GRAMMARS)
def test_greedy_constrained_output_equals_plain_constrained_decoding_under_every_proposer(arch, name, forbidden):
    schema, grammar = GRAMMARS[name]
    target = tiny_model(arch, seed=0)
    expected = constrained_greedy(target, PROMPT, NEW_TOKENS, grammar)
    unconstrained = [p.token_id for ev in Engine(target, TOKENIZER, None).generate(PROMPT, limits=GenerationLimits(NEW_TOKENS)) for p in ev.pieces]
    assert expected != unconstrained, "the grammar changes the answer"
    proposers = {
        "none": None,
        "ngram": NgramProposer(),
        "self draft": DraftModelProposer(target),
        "other draft": DraftModelProposer(tiny_model(arch, seed=1)),
        "eagle-1 tree": EagleProposer(random_head(target, 1), target, top_k=4, nodes=10, depth=3),
        "random chain": RandomGuesser(expected, len(PROMPT), seed=0),
        "random tree": RandomGuesser(expected, len(PROMPT), seed=1, tree=True),
    }
    for kind, proposer in proposers.items():
        engine = Engine(target, TOKENIZER, proposer, SpecConfig(draft_len=None if "eagle" in kind else 4), costs=CHEAP_WIDE_PASSES)
        assert answer(engine, PROMPT, NEW_TOKENS, grammar) == expected, kind
        if proposer is not None and kind != "other draft":
            assert engine.stats.accepted > 0, f"{kind}: guesses went through the masked verification"
        if isinstance(proposer, EagleProposer):
            proposer.close()
    assert forbidden[0] > 0, "drafts held tokens the grammar forbids"
    if name == "compact schema":  # the grammar ended the answer: JSON of the schema
        assert len(expected) < NEW_TOKENS and engine.stats.stop_reason == "grammar"
        jsonschema.validate(json.loads(TOKENIZER.decode(expected)), schema)


def test_the_grammar_ends_the_answer_without_another_pass():
    grammar = json_grammar({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False})
    engine = Engine(tiny_model("llama", seed=0), TOKENIZER, NgramProposer())
    events = list(engine.generate(PROMPT, limits=GenerationLimits(40), grammar=grammar))
    text = "".join(ev.text for ev in events)
    assert json.loads(text) in ({"ok": True}, {"ok": False})
    assert engine.stats.stop_reason == "grammar"
    # the answer after the closing brace needs nothing more: the last pass's own token closed it
    assert TOKENIZER.encode(text)[-1] == TOKENIZER.encode("}")[0]


class NoGuesses(Proposer):
    """A proposer that never guesses: whatever a pass verifies beyond its own token is forced."""

    name = "silent"

    def propose(self, tokens, max_len, sampling, generator, rules=None) -> Draft:
        return Draft.chain([])


def test_the_tokens_a_grammar_forces_are_free_guesses_and_plain_decoding_stays_one_a_pass(arch):
    schema, grammar = GRAMMARS["compact schema"]
    target = tiny_model(arch, seed=0)
    expected = constrained_greedy(target, PROMPT, NEW_TOKENS, grammar)
    engine = Engine(target, TOKENIZER, NoGuesses(), SpecConfig(draft_len=4))
    assert answer(engine, PROMPT, NEW_TOKENS, grammar) == expected
    # the keys and punctuation of the schema ('{"name":"', '","tags":[', ...) came as guesses
    assert engine.stats.accepted >= 8 and engine.stats.passes < len(expected)
    plain = Engine(target, TOKENIZER, None)
    assert answer(plain, PROMPT, NEW_TOKENS, grammar) == expected and plain.stats.drafted == 0


def test_prune_cuts_forbidden_guesses_and_their_branches_and_keeps_sampled_ones_as_leaves():
    grammar = json_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    engine = Engine(tiny_model("llama", seed=0), TOKENIZER, None)
    constraint = engine._constraint(grammar)
    brace, quote, a, x = (TOKENIZER.encode(c)[0] for c in '{"ax')
    # root's children: '{' (allowed) then 'x' (forbidden, with a child); under '{': '"' then 'a' (forbidden)
    draft = Draft([brace, x, quote, a, quote], [-1, -1, 0, 1, 0])
    pruned, allowed = constraint.prune(draft, greedy=True)
    assert (pruned.tokens, pruned.parents) == ([brace, quote, quote], [-1, 0, 0])
    assert allowed.shape == (4, engine.vocab_size)
    assert allowed[0].nonzero().flatten().tolist() == [brace]  # a schema's JSON opens with the brace
    assert allowed[1, quote] and not allowed[1, a]  # then a key's quote (or white space), never its letter
    assert allowed[2, a] and not allowed[2, x]  # after '{"': the key's first letter
    sampled = Draft([x, brace], [-1, -1], [torch.full((engine.vocab_size,), 1 / engine.vocab_size), None])
    pruned, allowed = constraint.prune(sampled, greedy=False)
    assert pruned.tokens == [x, brace] and allowed[1].all(), "a sampled node stays, as a leaf with its row unread"
    assert constraint.prune(sampled, greedy=True)[0].tokens == [brace]
    assert constraint.matcher.consume_token(brace), "the walk rolled the matcher back to the committed state"


def test_an_invalid_schema_is_one_line():
    for schema, message in (({"type": "nonsense"}, "invalid JSON schema: Invalid type: nonsense"),
                            ({"type": "object", "properties": {"a": {"minimum": "x"}}}, "invalid JSON schema: Expected f64"),
                            ([1, 2], "a JSON schema must be an object")):
        with pytest.raises(LocalspecError, match=message) as caught:
            json_grammar(schema)
        assert "\n" not in str(caught.value)


def test_structured_output_needs_a_fast_tokenizer_and_an_eos():
    from transformers import PreTrainedTokenizerFast

    from conftest import CharTokenizer

    with pytest.raises(LocalspecError, match="fast"):
        list(Engine(tiny_model(), CharTokenizer(), None).generate(PROMPT, grammar=json_grammar()))
    without_eos = PreTrainedTokenizerFast(tokenizer_object=TOKENIZER.backend_tokenizer)
    with pytest.raises(LocalspecError, match="end-of-sequence"):
        list(Engine(tiny_model(), without_eos, None).generate(PROMPT, grammar=json_grammar()))


# -- sampling ---------------------------------------------------------------------------------------

LETTERS = byte_tokenizer("abcde")  # ids 0-4, EOS 5: the sampling tests' vocabulary of six
PAIRS = LLMatcher.grammar_from_regex("(a[bc]|b[de]|c[ab])e*")
"""The first token one of a, b, c, the second allowed by the first: both positions constrained."""
SAMPLED_RUNS = {"draft": ([1, 2, 3, 4], 2), "lookup": ([4, 0, 3, 4], 3)}
"""Prompt and room per proposer. The draft's: nothing for prompt lookup to find, so the draft's own
sampled guesses are verified (one a pass: two tokens of room leave one guess); prompt lookup's: it
guesses 0, 3 ("a", "d"), the first allowed, the second cut (three of room: a pass holds both)."""


def exact_constrained_pairs(target, sampling: SamplingConfig, prompt: list[int]) -> dict:
    """P(first two tokens) under the target's constrained distribution, the masks written out by hand."""
    first = {0: [1, 2], 1: [3, 4], 2: [0, 1]}  # a -> b c, b -> d e, c -> a b

    def constrained(ids: list[int], allowed: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = target(torch.tensor([ids])).logits[0, -1]  # (V,)
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed] = 0
        return probs_from_logits(logits + mask, sampling)

    p1 = constrained(prompt, list(first))
    return {(a, b): float(p1[a] * constrained(prompt + [a], seconds)[b]) for a, seconds in first.items() for b in seconds}


def sampled_pairs(target, proposer, sampling_kw: dict, n: int, prompt: list[int], room: int = 2) -> dict:
    """Counts of the first two tokens over n seeds, each answer given `room` tokens."""
    engine = Engine(target, LETTERS, proposer, SpecConfig(draft_len=2))
    counts: dict = {}
    for seed in range(n):
        out = tuple(answer(engine, prompt, room, PAIRS, SamplingConfig(seed=seed, **sampling_kw))[:2])
        counts[out] = counts.get(out, 0) + 1
    return counts


@pytest.mark.parametrize("kind, sampling_kw", [("draft", dict(temperature=1.0)), ("draft", dict(temperature=0.8, top_k=2)),
                                                ("lookup", dict(temperature=1.0))])
def test_constrained_speculative_sampling_matches_the_constrained_target(kind, sampling_kw, forbidden):
    target, draft = models()
    n = 1000
    prompt, room = SAMPLED_RUNS[kind]
    proposer = DraftModelProposer(draft) if kind == "draft" else NgramProposer()
    counts = sampled_pairs(target, proposer, sampling_kw, n, prompt, room)
    stat, df = chi2(counts, exact_constrained_pairs(target, SamplingConfig(**sampling_kw), prompt), n)
    assert stat < chi2_limit(df), (stat, df, counts)
    assert forbidden[0] > n / 10, "guesses the grammar forbids were drafted"


def test_cutting_a_sampled_forbidden_guess_is_detected(monkeypatch):
    """Dropping a node the proposer sampled from its q skips the residual step its rejection owes:
    the chi-square test must see the bias (the reason such nodes stay as leaves)."""
    prune = Constraint.prune
    monkeypatch.setattr(Constraint, "prune", lambda self, draft, greedy: prune(self, draft, True))
    target, draft = models()
    n = 1000
    prompt = SAMPLED_RUNS["draft"][0]
    counts = sampled_pairs(target, DraftModelProposer(draft), dict(temperature=1.0), n, prompt)
    stat, df = chi2(counts, exact_constrained_pairs(target, SamplingConfig(temperature=1.0), prompt), n)
    assert stat > chi2_limit(df), (stat, df)


@pytest.mark.real_model
def test_smollm2_answers_json_of_the_schema_exactly_as_plain_constrained_decoding():
    from localspec.store.loading import load_model
    from localspec.store.registry import load_registry

    smollm2 = load_model(load_registry().get("smollm2-135m"), torch.float32, progress=False)
    model, tokenizer = smollm2.model, smollm2.tokenizer
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "colours": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
              "required": ["name", "age", "colours"], "additionalProperties": False}
    grammar = json_grammar(schema)
    plain = Engine(model, tokenizer, None)
    ids = plain.encode("Give a JSON object describing a person named Ada, aged 36, with her three favourite colours.")
    expected = constrained_greedy(model, ids, 120, grammar, tokenizer, tuple(sorted(plain.eos)))
    assert len(expected) < 120, "the grammar ended the answer"
    jsonschema.validate(json.loads(tokenizer.decode(expected)), schema)
    for proposer in (NgramProposer(), DraftModelProposer(model)):
        engine = Engine(model, tokenizer, proposer, SpecConfig(draft_len=6))
        assert answer(engine, ids, 120, grammar) == expected, proposer
        assert engine.stats.stop_reason == "grammar"


# -- the server -------------------------------------------------------------------------------------

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
ASK = [{"role": "user", "content": 'Reply: {"name":"ab","tags":["cd"],"ok":false}'}]
FORMATS = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}},
    "json_object": {"type": "json_object"},
}


def served_engine() -> Engine:
    return Engine(tiny_model("llama", seed=0), byte_tokenizer(chat_template=CHAT_TEMPLATE), NgramProposer(), SpecConfig(draft_len=3))


@pytest.mark.parametrize("kind", FORMATS)
def test_the_server_holds_chat_and_completions_to_response_format_whole_and_streamed(kind):
    from test_server_tools_logprobs import openai_client

    schema = SCHEMA if kind == "json_schema" else None
    reference = served_engine()
    chat_ids = reference.encode(ASK)
    want_chat = "".join(ev.text for ev in reference.generate(chat_ids, limits=GenerationLimits(40), grammar=json_grammar(schema)))
    text_ids = reference.tokenizer.encode("Reply: ")
    want_text = "".join(ev.text for ev in reference.generate(text_ids, limits=GenerationLimits(40), grammar=json_grammar(schema)))
    assert want_chat.startswith("{") and want_text.startswith("{")
    with openai_client(served_engine()) as client:
        ask = dict(model="tiny", max_tokens=40, temperature=0)
        whole = client.chat.completions.create(messages=ASK, response_format=FORMATS[kind], **ask)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            messages=ASK, response_format=FORMATS[kind], stream=True, **ask) if c.choices)
        # the client's completions take no response_format of their own: it goes as llama-server's extra field
        text_format = {"extra_body": {"response_format": FORMATS[kind]}}
        completion = client.completions.create(prompt="Reply: ", **ask, **text_format)
        streamed_text = "".join(c.choices[0].text for c in client.completions.create(prompt="Reply: ", stream=True, **ask, **text_format))
        plain = client.chat.completions.create(messages=ASK, model="tiny", max_tokens=40, temperature=0, response_format={"type": "text"})
    assert whole.choices[0].message.content == streamed == want_chat
    assert completion.choices[0].text == streamed_text == want_text
    assert plain.choices[0].message.content != want_chat, "a text answer is not held to the grammar"


def test_the_server_refuses_a_bad_response_format_in_one_line():
    import openai

    from test_server_tools_logprobs import openai_client

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    engine = served_engine()
    engine.tokenizer.chat_template = CHAT_TEMPLATE + "{# tools #}"  # a template that renders tools, as far as the server can tell
    with openai_client(engine) as client:
        for wrong, message in (
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "invalid JSON schema: Invalid type: nonsense"),
            ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "a JSON schema must be an object"),
            ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "'response_format.json_schema' must be"),
            ({"type": "yaml"}, "'response_format' must be"),
        ):
            with pytest.raises(openai.BadRequestError, match=message) as caught:
                client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, response_format=wrong)
            assert "\n" not in caught.value.body["message"]
        with pytest.raises(openai.BadRequestError, match="cannot be combined with 'tools'"):
            client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, tools=tools, response_format=FORMATS["json_object"])
        # tools the model may not call leave the answer free to be held to the schema
        held = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=4, temperature=0, tools=tools,
                                              tool_choice="none", response_format=FORMATS["json_object"])
    assert held.choices[0].message.content.startswith("{")
