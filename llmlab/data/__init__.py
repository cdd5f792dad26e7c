"""Bundled corpus, byte-level tokenizer and a layout-independent batch loader.

The loader is what makes every parallel layout see the same data: the *global* batch of step
``s`` depends only on ``(seed, s)``; a data-parallel rank takes rows ``[r*B/dp, (r+1)*B/dp)`` of it
and splits them into micro-batches. So dp=1 and dp=4 train on exactly the same tokens.

The corpus is split once, by position: the last tenth of its bytes is held out
(:func:`corpus_tokens` ``("heldout")``) and the loader draws training windows only from the first
nine tenths, so a model trained with ``llmlab train`` can be evaluated on text it never saw.
"""

from __future__ import annotations

from importlib import resources

import torch

CORPUS_FILE = "shakespeare.txt"


def load_corpus() -> str:
    """The bundled public-domain corpus (Romeo and Juliet + Macbeth; see PROVENANCE.md)."""
    return resources.files(__package__).joinpath(CORPUS_FILE).read_text(encoding="ascii")


HELDOUT_FRACTION = 0.1  # the last tenth of the corpus is never trained on


def corpus_tokens(split: str = "train") -> torch.Tensor:
    """The bundled corpus as byte tokens ``[N]`` (int64).

    ``split``: ``"train"`` (the first nine tenths, what :class:`BatchLoader` samples by default),
    ``"heldout"`` (the last tenth, for evaluation only) or ``"all"``. Raises ``ValueError`` for
    another name.
    """
    ids = torch.tensor(ByteTokenizer().encode(load_corpus()), dtype=torch.long)
    cut = ids.numel() - int(ids.numel() * HELDOUT_FRACTION)
    if split == "train":
        return ids[:cut]
    if split == "heldout":
        return ids[cut:]
    if split == "all":
        return ids
    raise ValueError(f"split {split!r}: expected 'train', 'heldout' or 'all'")


class ByteTokenizer:
    """Bytes as tokens: vocabulary 256, no training, any text round-trips exactly."""

    vocab_size = 256
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """``skip_special_tokens`` is accepted for the Hugging Face signature (no special tokens)."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class BatchLoader:
    """Seeded random windows of ``seq_len + 1`` tokens from a token stream.

    ``tokens`` defaults to the training split of the bundled corpus (:func:`corpus_tokens`); the
    held-out tenth is never sampled. ``global_batch(step) -> (inputs [B, L], labels [B, L])``
    (int64); ``local_batch(step,
    dp_rank, dp_size)`` its rows for one data-parallel rank; ``microbatches(...)`` those rows
    split into ``num_microbatches`` equal chunks.

    Raises ``ValueError`` when ``dp_size`` does not divide the global batch, or micro-batches do
    not divide the local batch, or the corpus is shorter than one window.
    """

    def __init__(
        self,
        tokens: torch.Tensor | None = None,
        *,
        global_batch_size: int = 16,
        seq_len: int = 64,
        seed: int = 0,
    ):
        if tokens is None:
            tokens = corpus_tokens("train")
        if tokens.numel() <= seq_len + 1:
            raise ValueError(f"corpus of {tokens.numel()} tokens is shorter than seq_len+1={seq_len + 1}")
        self.tokens, self.B, self.L, self.seed = tokens, global_batch_size, seq_len, seed

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.L - 1, (self.B,), generator=g)
        win = torch.stack([self.tokens[s : s + self.L + 1] for s in starts.tolist()])
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()

    def local_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1):
        if self.B % dp_size:
            raise ValueError(f"dp={dp_size} must divide global batch size {self.B}")
        n = self.B // dp_size
        x, y = self.global_batch(step)
        return x[dp_rank * n : (dp_rank + 1) * n], y[dp_rank * n : (dp_rank + 1) * n]

    def microbatches(self, step: int, dp_rank: int = 0, dp_size: int = 1, num_microbatches: int = 1):
        x, y = self.local_batch(step, dp_rank, dp_size)
        if x.shape[0] % num_microbatches:
            raise ValueError(
                f"num_microbatches={num_microbatches} must divide the per-rank batch "
                f"{x.shape[0]} (global batch {self.B} / dp {dp_size})"
            )
        return list(zip(x.chunk(num_microbatches), y.chunk(num_microbatches)))
