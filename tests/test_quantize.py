"""Weight-only int8: bytes, error bound per weight, perplexity change on the corpus."""

import torch

from llmlab.data import ByteTokenizer, load_corpus
from llmlab.model.config import get_preset
from llmlab.model.llama import LlamaForCausalLM
from llmlab.model.quantize import Int8Linear, linear_weight_bytes, perplexity, quantize_int8


def test_int8_linear_error_is_at_most_half_a_step_per_weight():
    lin = torch.nn.Linear(32, 16)
    q = Int8Linear.from_linear(lin)
    err = (q.dequantized_weight() - lin.weight).abs()
    step = lin.weight.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all(err <= step / 2 + 1e-7)
    x = torch.randn(4, 32)
    assert torch.allclose(q(x), lin(x), atol=0.05)


def test_quantized_model_weight_bytes_and_perplexity():
    torch.manual_seed(0)
    model = LlamaForCausalLM(get_preset("tiny"), seed=0).eval()
    tokens = torch.tensor(ByteTokenizer().encode(load_corpus()[:20000]))
    ppl = perplexity(model, tokens, seq_len=64, max_windows=8)
    before = linear_weight_bytes(model)
    quantize_int8(model)
    after = linear_weight_bytes(model)
    cfg = get_preset("tiny")
    head = cfg.vocab_size * cfg.hidden_size * 4  # lm_head stays fp32
    rows = sum(m.out_features for m in model.modules() if isinstance(m, Int8Linear))
    assert after == (before - head) // 4 + 4 * rows + head
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 7 * cfg.num_hidden_layers
    ppl_q = perplexity(model, tokens, seq_len=64, max_windows=8)
    assert abs(ppl_q - ppl) / ppl < 0.01  # an untrained model barely notices
