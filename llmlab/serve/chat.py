"""Chat messages to prompt tokens: the tokenizer's chat template, a ``--chat-template`` file, or
a plain template for tokenizers without one (the byte-level ``shakespeare`` model).

A chat template is a Jinja2 program over ``messages`` (each ``{"role", "content"}``) and
``add_generation_prompt``, as in Hugging Face ``tokenizer.apply_chat_template``; it is rendered in
Jinja's sandbox. The plain template writes each message as ``role: content`` on its own line and,
for the generation prompt, ``assistant:`` (the play-script shape the shakespeare model knows).
"""
from __future__ import annotations

from pathlib import Path

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}assistant:{% endif %}")


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
    ``template``: Jinja source overriding the tokenizer's own. Raises ``ValueError`` for a model
    without a tokenizer (chat needs text)."""

    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        self.uses_tokenizer_template = template is None and bool(own) and hasattr(
            tokenizer, "apply_chat_template")
        self.template = template or (None if self.uses_tokenizer_template else PLAIN_TEMPLATE)
        self._compiled = None
        if self.template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._compiled = env.from_string(self.template)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat completions need one "
                             "(use /v1/completions with token ids)")
        if self.uses_tokenizer_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        else:
            special = {k: getattr(self.tokenizer, k, None) or "" for k in ("bos_token", "eos_token")}
            text = self._compiled.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt, **special)
        return text, self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text; an HF template already holds its special tokens."""
        from llmlab.data import ByteTokenizer
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))
