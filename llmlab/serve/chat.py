"""Chat messages to prompt tokens: the tokenizer's chat template, a ``--chat-template`` file, or
a plain template for tokenizers without one (the byte-level ``shakespeare`` model).

A chat template is a Jinja2 program over ``messages`` (each ``{"role", "content"}``) and
``add_generation_prompt``, as in Hugging Face ``tokenizer.apply_chat_template``; it is rendered in
Jinja's sandbox. The plain template writes each message as ``role: content`` on its own line and,
for the generation prompt, ``assistant:`` (the play-script shape the shakespeare model knows).

Turns cannot be forged: a special token's text (``<|im_end|>``, ``<|im_start|>``) written inside a
message's content is tokenized as plain text, never as the marker (unless
``allow_special_tokens``). Such a request is rendered with a placeholder for each content, the
template's own text is tokenized with its special tokens and each content without them
(``split_special_tokens``). Requests without special-token text in any content are tokenized as
the whole rendered text, exactly as ``apply_chat_template(tokenize=True)``.

``continue_final_message`` (as Hugging Face and vLLM): the prompt ends right after the last
message's content, so the model continues that message instead of answering it.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def load_template(path: str | None) -> str | None:
    """The text of a ``--chat-template`` file (None for None). Raises ``FileNotFoundError``."""
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--chat-template {path}: no such file")
    return p.read_text()


class ChatRenderer:
    """``render(messages) -> (prompt text, token ids)``.

    ``tokenizer``: the engine's tokenizer (an HF tokenizer or llmlab's ``ByteTokenizer``);
    ``template``: Jinja source overriding the tokenizer's own; ``allow_special_tokens``: let
    special tokens inside message content act as markers. Raises ``ValueError`` for a model
    without a tokenizer (chat needs text) and for a content it cannot keep apart from the
    template's markers."""

    def __init__(self, tokenizer, template: str | None = None, allow_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.allow_special_tokens = allow_special_tokens
        own = getattr(tokenizer, "chat_template", None)
        self.uses_tokenizer_template = (
            template is None and bool(own) and hasattr(tokenizer, "apply_chat_template")
        )
        self.template = template or (None if self.uses_tokenizer_template else PLAIN_TEMPLATE)
        self._compiled = None
        if self.template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._compiled = env.from_string(self.template)
        self.special_tokens = special_token_texts(tokenizer)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False
    ) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            raise ValueError(
                "this model has no tokenizer: chat completions need one (use /v1/completions with token ids)"
            )
        text = self._text(messages, add_generation_prompt, continue_final_message)
        if self.allow_special_tokens or not any(
            t in (m.get("content") or "") for m in messages for t in self.special_tokens
        ):
            return text, self.encode(text)
        return text, self._encode_apart(messages, add_generation_prompt, continue_final_message)

    def _text(self, messages, add_generation_prompt: bool, continue_final_message: bool) -> str:
        if self.uses_tokenizer_template:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        else:
            if self._compiled is None:  # a template is compiled whenever the tokenizer's is not used
                raise RuntimeError("no chat template to render the messages with")
            special = {k: getattr(self.tokenizer, k, None) or "" for k in ("bos_token", "eos_token")}
            text = self._compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **special
            )
        if continue_final_message:
            final = (messages[-1].get("content") or "") if messages else ""
            if final and final not in text:  # a template that trims its contents
                final = final.strip()
            i = text.rfind(final) if final else -1
            if i < 0:
                raise ValueError(
                    "continue_final_message: the last message's content is not in "
                    "the rendered prompt (it needs a non-empty content)"
                )
            text = text[: i + len(final)]
        return text

    def _encode_apart(self, messages, add_generation_prompt, continue_final_message) -> list[int]:
        """Render with a placeholder per content; the template's text keeps its special tokens,
        each content is tokenized with special tokens as plain text."""
        tag = f"LLMLABCONTENT{secrets.token_hex(8)}N"
        marked = [{**m, "content": f"{tag}{i}E"} for i, m in enumerate(messages)]
        text = self._text(marked, add_generation_prompt, continue_final_message)
        parts = re.split(f"{tag}(\\d+)E", text)
        order = [int(x) for x in parts[1::2]]
        if sorted(order) != list(range(len(messages))):
            raise ValueError(
                "a message's content holds a special token's text and this chat "
                "template does not place each content once, so it cannot be kept "
                "apart from the template's markers"
            )
        ids: list[int] = []
        for k, piece in enumerate(parts):
            if k % 2 == 0:
                ids += self.encode(piece) if piece else []
            else:
                ids += self.encode_plain(messages[int(piece)].get("content") or "")
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; an HF template already holds its special tokens."""
        from llmlab.data import ByteTokenizer

        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with any special token's text tokenized as ordinary text."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def special_token_texts(tokenizer) -> list[str]:
    """The texts of a tokenizer's special tokens (none for a byte-level ``ByteTokenizer``)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    texts = {str(t) for t in added.values() if getattr(t, "special", False)}
    texts |= set(getattr(tokenizer, "all_special_tokens", None) or [])
    return sorted(t for t in texts if t)
