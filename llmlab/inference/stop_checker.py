"""When a sequence stops, and the text it shows (vLLM's ``StopChecker``).

After every sampled token: the token is detokenised (:mod:`~llmlab.inference.detokenizer`), then,
in vLLM's order, nothing stops before ``min_tokens``; a stop string found in the new text ends the
sequence (the text cut before it, or after it with ``include_stop_str_in_output``); then a stop
token id or EOS (its text left out unless ``include_stop_str_in_output``); then ``max_tokens`` and
the context length (``"length"``). While a sequence runs, the tail of its text that could still
become a stop string is held back, so the text shown only ever grows.
"""
from __future__ import annotations

from llmlab.inference.detokenizer import IncrementalDetokenizer


class StopChecker:
    """``eos_token_ids``: the model's end-of-sequence ids; ``max_model_len``: the context."""

    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def start(self, seq) -> None:
        """Give a new sequence (or a forked sample) its detokenizer, before its first token."""
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids,
                                                     seq.params.skip_special_tokens)

    def check(self, seq) -> str | None:
        """After ``seq`` got a token: ``"stop"``, ``"length"`` or None (keep going)."""
        p = seq.params
        tok = seq.token_ids[-1]
        early = seq.num_output_tokens < p.min_tokens
        stop_tok = not early and (tok in p.stop_token_ids
                                  or (not p.ignore_eos and tok in self.eos_token_ids))
        det = seq.detokenizer
        if det is not None and not (stop_tok and not p.include_stop_str_in_output):
            before = len(det.text)
            det.add(tok)
            seq.text = det.text
            if p.stop and not early and len(det.text) > before:
                found = [(i, s) for s in p.stop
                         if (i := det.text.find(s, max(0, before - len(s) + 1))) >= 0]
                if found:
                    i, s = min(found)
                    seq.text = det.text[:i + len(s) if p.include_stop_str_in_output else i]
                    seq.detokenizer = None                  # the text is final
                    return "stop"
        if stop_tok:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq) -> None:
        """A finished sequence's text takes what the detokenizer still held (an incomplete
        character at the very end stays U+FFFD, as ``decode`` writes it)."""
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
            seq.text = seq.detokenizer.text
            seq.detokenizer = None

    def visible_text(self, seq) -> str | None:
        """The text to show: while running, without a tail that could still become a stop string."""
        if self.tokenizer is None:
            return None
        text = seq.text
        if seq.is_finished or not seq.params.stop:
            return text
        hold = 0
        for s in seq.params.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[:len(text) - hold]
