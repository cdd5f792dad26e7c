"""Incremental detokenization: output text that only ever grows, as vLLM and HF's text streamer
make it.

The text of an output is ``decode(prompt + output) - decode(prompt)``, not ``decode(output)``:
with a SentencePiece tokenizer (Llama 2, Mistral) a word-initial token carries a "▁" that
``decode`` turns into a space except at the very start of the decoded ids, so decoding the output
alone loses the first word's leading space; and byte-level tokens (GPT-2 style, or SentencePiece
byte fallback) may hold part of a multi-byte UTF-8 character, decoded as U+FFFD until the rest
arrives.

:class:`IncrementalDetokenizer` keeps two offsets into the token ids, as vLLM's
``detokenize_incrementally`` does: ``prefix_offset`` (where the context window for decoding
starts: a few prompt tokens at first) and ``read_offset`` (the tokens already turned into text).
For every new token it decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``; the
difference is new text, emitted only when it does not end in an incomplete character (U+FFFD),
otherwise held back until a later token completes it. :meth:`finish` emits whatever is held.
Decoding a window of a few tokens keeps each step O(new tokens), not O(sequence).
"""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded before the output as context (vLLM uses 5)


class IncrementalDetokenizer:
    """``add(token_id) -> str`` appends the text that can no longer change (often ``""``);
    ``finish() -> str`` the held-back rest. ``text`` is everything emitted so far.

    ``tokenizer`` needs ``decode(ids, skip_special_tokens=...)`` (Hugging Face tokenizers and
    :class:`~llmlab.data.ByteTokenizer` have it)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - CONTEXT_TOKENS)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def _delta(self, final: bool) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or an incomplete UTF-8 character
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        return self._delta(final=False)

    def finish(self) -> str:
        """The text still held back (an incomplete character at the end stays U+FFFD, as
        ``decode`` writes it)."""
        return self._delta(final=True) if self.read_offset < len(self.ids) else ""
