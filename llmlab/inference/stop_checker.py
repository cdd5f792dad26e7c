"""When a sequence stops, and the text it shows (vLLM's ``StopChecker``).

After every sampled token: the token is detokenised (:mod:`~llmlab.inference.detokenizer`), then,
in vLLM's order, nothing stops before ``min_tokens``; a stop string found in the new text ends the
sequence (the text cut before it, or after it with ``include_stop_str_in_output``); then a stop
token id or EOS (its text left out unless ``include_stop_str_in_output``); then ``max_tokens`` and
the context length (``"length"``). While a sequence runs, the tail of its text that could still
become a stop string is held back, so the text shown only ever grows.

Stop strings are matched by one Knuth-Morris-Pratt automaton per string (Knuth, Morris & Pratt
1977) fed the characters each step adds: the work per step is linear in the new text (times the
number of stop strings, which ``EngineConfig.max_stop_strings`` bounds), never in the text so far
or in a stop string's length squared, and the automaton's state is also the tail to hold back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from llmlab.inference.detokenizer import IncrementalDetokenizer
from llmlab.inference.sampling import filled

if TYPE_CHECKING:
    from llmlab.inference.sequence import Sequence


def _failure(s: str) -> list[int]:
    """KMP's prefix function: ``f[i]`` = length of the longest proper prefix of ``s[:i + 1]``
    that is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


class StopMatcher:
    """The stop strings of one sequence over its growing text. ``state[j]``: the length of the
    longest prefix of ``stops[j]`` the text ends with."""

    def __init__(self, stops: Iterable[str]):
        self.stops = list(stops)
        self.fail = [_failure(x) for x in self.stops]
        self.state = [0] * len(self.stops)

    def feed(self, text: str, start: int, report: bool = True) -> tuple[int, str] | None:
        """Advance over ``text[start:]``; returns ``(index, stop)`` of the earliest stop string
        completed in it (None if none, or always None with ``report=False``)."""
        best: tuple[int, str] | None = None
        for j, stop in enumerate(self.stops):
            k, f = self.state[j], self.fail[j]
            for i in range(start, len(text)):
                c = text[i]
                while k and c != stop[k]:
                    k = f[k - 1]
                if c == stop[k]:
                    k += 1
                if k == len(stop):
                    if report:
                        hit = (i - len(stop) + 1, stop)
                        best = hit if best is None or hit < best else best
                        break
                    k = f[k - 1]
            self.state[j] = k
        return best

    @property
    def held(self) -> int:
        """Characters at the end of the text that could still become a stop string."""
        return max(self.state, default=0)


class StopChecker:
    """``eos_token_ids``: the model's end-of-sequence ids; ``max_model_len``: the context."""

    def __init__(self, tokenizer: Any, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def start(self, seq: Sequence) -> None:
        """Give a new sequence (or a forked sample) its detokenizer, before its first token."""
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.params.skip_special_tokens
            )
            seq.stop_matcher = StopMatcher(seq.params.stop) if seq.params.stop else None

    def check(self, seq: Sequence) -> str | None:
        """After ``seq`` got a token: ``"stop"``, ``"length"`` or None (keep going)."""
        p = seq.params
        tok = seq.token_ids[-1]
        early = seq.num_output_tokens < p.min_tokens
        stop_tok = not early and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids))
        det = seq.detokenizer
        if det is not None and not (stop_tok and not p.include_stop_str_in_output):
            before = len(det.text)
            det.add(tok)
            seq.text = det.text
            m = seq.stop_matcher
            if m is not None and len(det.text) > before:
                found = m.feed(det.text, before, report=not early)
                if found:
                    i, s = found
                    seq.text = det.text[: i + len(s) if p.include_stop_str_in_output else i]
                    seq.detokenizer = None  # the text is final
                    return "stop"
        if stop_tok:
            return "stop"
        if (
            seq.num_output_tokens >= filled(p.max_tokens, "max_tokens")
            or seq.num_tokens >= self.max_model_len
        ):
            return "length"
        return None

    def finish(self, seq: Sequence) -> None:
        """A finished sequence's text takes what the detokenizer still held (an incomplete
        character at the very end stays U+FFFD, as ``decode`` writes it)."""
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
            seq.text = seq.detokenizer.text
            seq.detokenizer = None

    def visible_text(self, seq: Sequence) -> str | None:
        """The text to show: while running, without a tail that could still become a stop string."""
        if self.tokenizer is None:
            return None
        text = seq.text
        m = getattr(seq, "stop_matcher", None)
        if seq.is_finished or m is None:
            return text
        return text[: len(text) - m.held]
