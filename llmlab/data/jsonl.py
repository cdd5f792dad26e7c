"""``llmlab train --data FILE|DIR``: your own examples, one JSON object a line.

Each line is ``{"text": "..."}`` (plain text: every token is trained) or
``{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}, ...]}`` (a
conversation, rendered with the tokenizer's chat template; only the assistant tokens are trained
unless ``loss_tokens="all"``). A directory means every ``*.jsonl`` file in it, in name order.

**Padding, one example per row.** Each example is one row of ``seq_len + 1`` tokens: its tokens,
then the pad token, whose labels are ``-100`` (not trained). Attention is causal, so the padding
after an example never changes what its tokens see, and no example attends to another: the
result equals training each example alone. Packing several short examples into one row would
waste less compute but needs a block-diagonal attention mask; llmlab keeps the simpler padding.
The step's loss is the mean over the global batch's trained tokens (the trainer weights each
micro-batch by its token count), so padding changes nothing but the cost.

**Held-out split and order.** The examples are shuffled once with ``seed``; the last
``eval_fraction`` of them (at least one) are held out for the evaluation loss. The training rows of
step ``s`` are examples ``(s-1)*B .. s*B-1`` of an endless sequence of epochs, each epoch its own
permutation seeded by ``(seed, epoch)``: the data order is a function of seed and step only, so
every layout sees the same rows and a resume continues exactly.

Bad input raises ``ValueError`` naming the file and line: not JSON, not an object, neither
``text`` nor ``messages``, a wrong type, an empty example, an example longer than ``seq_len + 1``
tokens, an empty file; checked by :func:`read_examples` in the caller before any rank starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmlab.data import BatchLoader


@dataclass(frozen=True)
class Example:
    """One tokenized example: ``ids`` (int list, at most ``seq_len + 1``) and ``trained``
    (bool list of the same length: the token is a label the loss counts)."""

    ids: tuple[int, ...]
    trained: tuple[bool, ...]


def data_files(path: str | Path) -> list[Path]:
    """``path`` itself, or the ``*.jsonl`` files of a directory in name order; ``ValueError``
    naming ``--data`` when there is nothing to read."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(p.glob("*.jsonl"))
        if not files:
            raise ValueError(f"--data {path}: the folder holds no *.jsonl file")
        return files
    if not p.is_file():
        raise ValueError(f"--data {path}: no such file or folder")
    return [p]


def _chat_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns: the text each
    assistant message adds to the prompt that asks for it (``add_generation_prompt``)."""

    def render(msgs: list[dict[str, str]], prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=prompt))

    text, spans = render(messages, False), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(end) and end.startswith(start)):
            raise ValueError(
                "the chat template does not render conversations incrementally, so "
                "the assistant tokens cannot be found (use --loss-tokens all)"
            )
        spans.append((len(start), len(end)))
    return text, spans


def _encode_chat(tokenizer: Any, messages: list[dict[str, str]], all_tokens: bool) -> Example:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "a chat example needs a tokenizer with a chat template, and this one "
            "(a preset's bytes, or the checkpoint's) has none; write {\"text\"} lines"
        )
    text, spans = _chat_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    trained = [all_tokens or any(a <= s < b for a, b in spans) for s, _ in enc["offset_mapping"]]
    return Example(tuple(ids), tuple(trained))


def _encode_text(tokenizer: Any, text: str) -> Example:
    ids = list(tokenizer.encode(text))
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)  # the model learns where a text ends
    return Example(tuple(ids), (True,) * len(ids))


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f'every message needs a string "role" and "content", got {m!r:.80}')
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError('the conversation has no "assistant" message (nothing to train)')


def encode_line(line: str, tokenizer: Any, all_tokens: bool = False) -> Example:
    """One JSONL line as an :class:`Example`; ``ValueError`` saying what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f'expected an object with "text" or "messages", got {type(obj).__name__}')
    if "messages" in obj:
        _check_messages(obj["messages"])
        return _encode_chat(tokenizer, obj["messages"], all_tokens)
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"].strip():
            raise ValueError('"text" must be a non-empty string')
        return _encode_text(tokenizer, obj["text"])
    raise ValueError(f'missing field: expected "text" or "messages", got keys {sorted(obj)}')


def read_examples(path: str | Path, tokenizer: Any, seq_len: int, all_tokens: bool = False) -> list[Example]:
    """Every example of ``--data path`` (see the module docstring). Raises ``ValueError`` naming
    ``file:line`` and the problem."""
    out: list[Example] = []
    for f in data_files(path):
        count = 0
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                ex = encode_line(line, tokenizer, all_tokens)
            except ValueError as e:
                raise ValueError(f"--data {f}:{n}: {e}") from None
            if len(ex.ids) > seq_len + 1:
                raise ValueError(
                    f"--data {f}:{n}: the example is {len(ex.ids)} tokens, longer than "
                    f"--seq-len {seq_len} + 1; shorten it or raise --seq-len"
                )
            if not any(ex.trained[1:]):
                raise ValueError(f"--data {f}:{n}: no token of the example is trained")
            out.append(ex)
            count += 1
        if count == 0:
            raise ValueError(f"--data {f}: the file holds no example (empty)")
    return out


def split_examples(
    examples: list[Example], eval_fraction: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """``(train, held_out)``: a seeded shuffle, the last ``eval_fraction`` (at least one example
    when the fraction is > 0) held out. ``ValueError`` when nothing is left to train on."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 7)
    order = torch.randperm(len(examples), generator=g).tolist()
    n_eval = max(1, round(len(examples) * eval_fraction)) if eval_fraction > 0 else 0
    if n_eval >= len(examples):
        raise ValueError(
            f"--data has {len(examples)} examples: too few to hold out "
            f"--eval-fraction {eval_fraction} and train on the rest"
        )
    cut = len(examples) - n_eval
    return [examples[i] for i in order[:cut]], [examples[i] for i in order[cut:]]


def rows(examples: list[Example], seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded rows: ``inputs [N, seq_len]`` and ``labels [N, seq_len]`` (``-100`` where the next
    token is padding or not trained)."""
    x = torch.full((len(examples), seq_len + 1), pad_id, dtype=torch.long)
    keep = torch.zeros((len(examples), seq_len + 1), dtype=torch.bool)
    for i, ex in enumerate(examples):
        x[i, : len(ex.ids)] = torch.tensor(ex.ids, dtype=torch.long)
        keep[i, : len(ex.ids)] = torch.tensor(ex.trained, dtype=torch.bool)
    y = torch.where(keep[:, 1:], x[:, 1:], torch.full_like(x[:, 1:], -100))
    return x[:, :-1].contiguous(), y.contiguous()


class ExampleLoader(BatchLoader):
    """:class:`~llmlab.data.BatchLoader`'s interface over padded examples: the global batch of
    step ``s`` is a function of ``(seed, s)`` (module docstring); ``eval_batch(multiple)`` is
    every held-out example, padded with untrained rows to a multiple of ``multiple`` rows."""

    def __init__(
        self,
        train: list[Example],
        held_out: list[Example],
        *,
        global_batch_size: int,
        seq_len: int,
        seed: int,
        pad_id: int,
    ):
        self.train, self.held_out = train, held_out
        self.B, self.L, self.seed, self.pad_id = global_batch_size, seq_len, seed, pad_id
        self._orders: dict[int, list[int]] = {}

    def order(self, epoch: int) -> list[int]:
        """The permutation of the training examples in ``epoch`` (seeded by seed and epoch)."""
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(len(self.train), generator=g).tolist()}
        return self._orders[epoch]

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        picked = []
        for i in range((step - 1) * self.B, step * self.B):
            epoch, j = divmod(i, len(self.train))
            picked.append(self.train[self.order(epoch)[j]])
        return rows(picked, self.L, self.pad_id)

    def eval_batch(self, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = rows(self.held_out, self.L, self.pad_id)
        extra = -len(self.held_out) % multiple
        if extra:
            x = torch.cat([x, torch.full((extra, self.L), self.pad_id, dtype=torch.long)])
            y = torch.cat([y, torch.full((extra, self.L), -100, dtype=torch.long)])
        return x, y
