"""The tiny Llama config the CPU fast-path tests share: 2 layers, hidden 64, 4 query and 2 kv
heads (head_dim 16, GQA), vocabulary 97 (imported by those tests as a module, like cpu_levels)."""

from llmlab.model.config import ModelConfig

TINY = ModelConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
