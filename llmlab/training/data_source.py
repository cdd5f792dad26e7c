"""What ``llmlab train`` trains on: the loader for a :class:`~llmlab.training.config.TrainConfig`.

* no ``--init-from``, no ``--data``: the bundled corpus as bytes (:class:`llmlab.data.BatchLoader`);
* ``--init-from DIR`` without ``--data``: the same corpus split, as the checkpoint's tokens.

Every loader offers ``microbatches(step, dp_rank, dp_size, num_microbatches) -> [(x, y)]`` whose
global batch is a function of ``(seed, step)`` only, so every layout sees the same tokens and a
resume at step ``s`` continues exactly.
"""
from __future__ import annotations

from llmlab.data import BatchLoader


def make_loader(cfg) -> BatchLoader:
    """The training loader of ``cfg`` (see the module docstring)."""
    if cfg.init_from:
        from llmlab.training.hf_init import corpus_token_ids
        return BatchLoader(corpus_token_ids(cfg.init_from), global_batch_size=cfg.global_batch_size,
                           seq_len=cfg.seq_len, seed=cfg.seed)
    return BatchLoader(global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
