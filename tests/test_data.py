"""Bundled corpus, byte tokenizer and the layout-independent loader."""

import pytest
import torch

from llmlab.data import BatchLoader, ByteTokenizer, load_corpus


def test_corpus_is_bundled_ascii_shakespeare():
    text = load_corpus()
    assert 200_000 < len(text) < 400_000
    assert "ROMEO AND JULIET" in text and "MACBETH" in text.upper()
    assert text.isascii()


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    for s in ["ROMEO:", "naïve — ok", ""]:
        ids = tok.encode(s)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == s


def test_dp_slices_and_microbatches_reassemble_the_global_batch():
    loader = BatchLoader(global_batch_size=8, seq_len=16, seed=5)
    x, y = loader.global_batch(3)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # labels are inputs shifted by one
    parts = [mb for r in range(4) for mb in loader.microbatches(3, r, 4, num_microbatches=2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)
    assert torch.equal(torch.cat([p[1] for p in parts]), y)
    assert not torch.equal(loader.global_batch(4)[0], x)
    assert torch.equal(BatchLoader(global_batch_size=8, seq_len=16, seed=5).global_batch(3)[0], x)


def test_indivisible_batches_are_refused():
    loader = BatchLoader(global_batch_size=10, seq_len=8)
    with pytest.raises(ValueError, match="dp=4 must divide global batch size 10"):
        loader.local_batch(0, 0, 4)
    with pytest.raises(ValueError, match="num_microbatches=3 must divide the per-rank batch 5"):
        loader.microbatches(0, 0, 2, 3)


def test_loader_never_samples_the_heldout_tenth():
    from llmlab.data import corpus_tokens

    train, held, full = corpus_tokens("train"), corpus_tokens("heldout"), corpus_tokens("all")
    assert torch.equal(torch.cat([train, held]), full)
    assert held.numel() == full.numel() // 10
    loader = BatchLoader(global_batch_size=64, seq_len=256, seed=0)
    assert torch.equal(loader.tokens, train)
    with pytest.raises(ValueError, match="expected 'train', 'heldout' or 'all'"):
        corpus_tokens("test")
