"""A prompt, from what a user typed to the token ids a generation starts from, and whether it can start.

- `chat_text` / `chat_ids`: a prompt string or a list of chat messages (and the tools a chat may
  call) through the tokenizer's chat template; a tokenizer without one reads the messages'
  contents, one per line, as plain text (with the tokenizer's own special tokens, BOS included, as
  any plain text gets them). The engine,
  the EAGLE trainer's data and the benchmark's llama.cpp prompts all come through here, so each
  model sees a prompt the same way wherever it is built.
- `check_text` / `check_ids`: the one refusal of a prompt no generation can start from (empty, or
  leaving the context window no room for an answer), as a `PromptRefused` each app shows its way
  (the CLI and the chat as one line, the server as a 400 error object).

No files, no options: the engine sits above this.
"""

from __future__ import annotations

from localspec.base.errors import LocalspecError


class PromptRefused(LocalspecError):
    """A prompt no generation can start from; `too_long` says it is the context window that refuses it."""

    def __init__(self, message: str, too_long: bool = False) -> None:
        super().__init__(message)
        self.too_long = too_long


def is_blank(text: str) -> bool:
    return not text.strip()


def check_text(text: str) -> None:
    """Refuse a prompt with nothing but white space in it, before any model is asked."""
    if is_blank(text):
        raise PromptRefused("the prompt is empty")


def check_ids(ids: list[int], context_len: int, model: str = "this model") -> None:
    """Refuse a prompt of no tokens, or one that leaves no room in the context window for an answer."""
    if not ids:
        raise PromptRefused("the prompt is empty")
    if len(ids) >= context_len:
        raise PromptRefused(
            f"the prompt is {len(ids)} tokens; {model}'s context window is {context_len} tokens and the "
            "answer needs room: shorten the prompt",
            too_long=True,
        )


def chat_messages(prompt: str | list[dict], system: str | None = None) -> list[dict]:
    """A prompt string as one user message; a system prompt put first unless the chat has one."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    return messages


def _has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_text(tokenizer, prompt: str | list[dict], system: str | None = None) -> str:
    """The chat as text, ready for the answer (special tokens written out), as `chat_ids` reads it."""
    messages = chat_messages(prompt, system)
    if _has_template(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages)


def chat_ids(tokenizer, prompt: str | list[dict], system: str | None = None, tools: list[dict] | None = None) -> list[int]:
    """The chat's token ids, ready for the answer; `tools` (OpenAI's function definitions) are
    rendered by the template itself, as the model was trained to read them."""
    if _has_template(tokenizer):
        offered = {"tools": tools} if tools else {}  # only then: a template call without the keyword stays as it was
        ids = tokenizer.apply_chat_template(chat_messages(prompt, system), add_generation_prompt=True, tokenize=True, **offered)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 returns a BatchEncoding
    return list(tokenizer.encode(chat_text(tokenizer, prompt, system)))
