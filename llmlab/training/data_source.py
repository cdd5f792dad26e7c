"""What ``llmlab train`` trains on: the loader for a :class:`~llmlab.training.config.TrainConfig`.

* no ``--init-from``, no ``--data``: the bundled corpus as bytes (:class:`llmlab.data.BatchLoader`);
* ``--init-from DIR`` without ``--data``: the same corpus split, as the checkpoint's tokens;
* ``--data FILE|DIR``: your examples, one padded example per row, tokenized with the
  ``--init-from`` checkpoint's tokenizer (bytes for a preset) (:mod:`llmlab.data.jsonl`).

Every loader offers ``microbatches(step, dp_rank, dp_size, num_microbatches) -> [(x, y)]`` whose
global batch is a function of ``(seed, step)`` only, so every layout sees the same tokens and a
resume at step ``s`` continues exactly.
"""

from __future__ import annotations

from typing import Any

from llmlab.data import BatchLoader, ByteTokenizer


def data_tokenizer(cfg: Any) -> Any:
    """The tokenizer of ``cfg``'s text: the ``--init-from`` checkpoint's, else bytes (a preset
    with a 256-symbol vocabulary); ``ValueError`` naming the flags otherwise."""
    if cfg.init_from:
        from llmlab.training.hf_init import load_tokenizer

        return load_tokenizer(cfg.init_from)
    from llmlab.model.config import get_preset

    if get_preset(cfg.model).vocab_size != 256:
        raise ValueError(
            f"--data with --model {cfg.model}: the preset has no tokenizer; use "
            f"--init-from a checkpoint, or a byte-level preset (vocabulary 256)"
        )
    return ByteTokenizer()


def pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if v is not None:
            return int(v)
    return 0


def example_split(cfg: Any) -> tuple[list[Any], list[Any]]:
    """``(train, held_out)`` examples of ``--data`` (``ValueError`` naming file:line)."""
    from llmlab.data.jsonl import read_examples, split_examples

    ex = read_examples(cfg.data, data_tokenizer(cfg), cfg.seq_len, cfg.loss_tokens == "all")
    return split_examples(ex, cfg.eval_fraction, cfg.seed)


def check_data(cfg: Any) -> None:
    """The ``--data``/``--eval-*`` checks, in the caller before any rank starts."""
    if not cfg.data:
        raise ValueError("--eval-every needs --data (the held-out examples)")
    if not 0 <= cfg.eval_fraction < 1:
        raise ValueError(f"--eval-fraction must be in [0, 1), got {cfg.eval_fraction}")
    if cfg.eval_every < 0:
        raise ValueError(f"--eval-every must be >= 0, got {cfg.eval_every}")
    if cfg.eval_every and cfg.eval_fraction == 0:
        raise ValueError("--eval-every needs held-out examples: --eval-fraction > 0")
    if cfg.eval_every and cfg.pp > 1:
        raise ValueError(
            "--eval-every with --pp > 1 is not supported (the pipeline schedule runs "
            "forward and backward together); evaluate the --save-model output"
        )
    example_split(cfg)


def make_loader(cfg: Any) -> BatchLoader:
    """The training loader of ``cfg`` (see the module docstring)."""
    if cfg.data:
        from llmlab.data.jsonl import ExampleLoader

        train, held_out = example_split(cfg)
        return ExampleLoader(
            train,
            held_out,
            global_batch_size=cfg.global_batch_size,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
            pad_id=pad_id(data_tokenizer(cfg)),
        )
    if cfg.init_from:
        from llmlab.training.hf_init import corpus_token_ids

        return BatchLoader(
            corpus_token_ids(cfg.init_from),
            global_batch_size=cfg.global_batch_size,
            seq_len=cfg.seq_len,
            seed=cfg.seed,
        )
    return BatchLoader(global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
