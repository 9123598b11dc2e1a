"""The one home of chat templating and of the checks a prompt must pass (core/prompt.py)."""

from __future__ import annotations

import pytest

from conftest import CharTokenizer
from localspec.core.prompt import PromptRefused, chat_ids, chat_messages, chat_text, check_ids, check_text, is_blank


class TemplatedTokenizer(CharTokenizer):
    """A chat template that writes each turn as `<role>content`, as transformers 5 returns it."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"
        return {"input_ids": self.encode(text)} if tokenize else text


def test_a_system_prompt_goes_first_unless_the_chat_has_one():
    assert chat_messages("hi", "be brief") == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    own = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert chat_messages(own, "be brief") == own


def test_the_template_writes_the_chat_and_the_ids_are_its_text():
    tokenizer = TemplatedTokenizer()
    assert chat_text(tokenizer, "hi", "be brief") == "<system>be brief<user>hi<assistant>"
    assert chat_ids(tokenizer, "hi", "be brief") == tokenizer.encode("<system>be brief<user>hi<assistant>")


def test_without_a_template_the_contents_are_plain_text_one_per_line():
    tokenizer = CharTokenizer()
    assert chat_text(tokenizer, "hi", "be brief") == "be brief\nhi"
    assert chat_ids(tokenizer, "hi", "be brief") == tokenizer.encode("be brief\nhi")
    assert chat_text(tokenizer, "hi") == "hi"  # what llama.cpp is given for a model without a template


def test_a_prompt_no_generation_can_start_from_is_refused_in_one_line():
    assert is_blank(" \n\t") and not is_blank(" x ")
    with pytest.raises(PromptRefused, match="^the prompt is empty$"):
        check_text("  \n")
    with pytest.raises(PromptRefused, match="^the prompt is empty$") as empty:
        check_ids([], 8)
    assert not empty.value.too_long
    check_ids([1] * 7, 8)  # one token of room for the answer
    with pytest.raises(PromptRefused) as long:
        check_ids([1] * 8, 8, "tiny")
    assert long.value.too_long and str(long.value) == (
        "the prompt is 8 tokens; tiny's context window is 8 tokens and the answer needs room: shorten the prompt")
    with pytest.raises(PromptRefused, match="this model's context window is 8 tokens"):
        check_ids([1] * 9, 8)
