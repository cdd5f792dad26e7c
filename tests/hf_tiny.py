"""A tiny random Hugging Face checkpoint (Llama or Qwen2) with a small BPE tokenizer and a chat
template, written with transformers' own ``save_pretrained``: the tests' stand-in for a real
checkpoint (9 attention heads, 3 kv heads, MLP width and vocabulary multiples of 12, so that tensor
parallelism of degree 3 divides them)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on the bundled corpus, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from llmlab.data import load_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([load_corpus()], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def tiny_checkpoint(path: str | Path, family: str = "llama", seed: int = 0, **overrides) -> Path:
    """Write a random ``family`` (``llama``/``qwen2``) checkpoint with 9 heads (3 kv heads),
    hidden 36, 2 layers, and the tiny tokenizer, into ``path``; returns it."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    path = Path(path)
    tok = tiny_tokenizer()
    kw = (
        dict(
            vocab_size=-(-len(tok) // 12) * 12,
            hidden_size=36,
            intermediate_size=72,
            num_hidden_layers=2,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        | overrides
    )
    cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[
        family
    ]
    torch.manual_seed(seed)
    model = model_cls(cls(**kw)).float()
    with torch.no_grad():  # non-trivial norms and biases, so that loading them is tested
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path
