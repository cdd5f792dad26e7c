"""SmoothQuant's per-channel smoothing (llmlab.inference.smooth_quant) before W8A8."""

import copy

import pytest
import torch

from llmlab.inference import smooth_quant as S
from llmlab.model.llama import LlamaForCausalLM
from tiny_llama import TINY

CFG = TINY


def test_smoothing_leaves_the_float_model_unchanged_on_the_shipped_model():
    from llmlab.inference import loader

    model, tok, _, _ = loader.load("shakespeare")
    ids = S.calibration_ids(tok, model.config.vocab_size, n=2, seq_len=64)
    assert tok.decode(ids[0, :16].tolist()) == "ROMEO AND JULIET"  # the corpus' start
    x = torch.tensor([tok.encode("JULIET:\nO Romeo, Romeo! wherefore art thou")])
    with torch.no_grad():
        ref = model(x)
    before = [layer.input_layernorm.weight.clone() for layer in model.model.layers]
    assert S.smooth(model, ids, 0.5) == 3 * model.config.num_hidden_layers
    ratio = torch.stack(
        [b / layer.input_layernorm.weight.detach() for b, layer in zip(before, model.model.layers)]
    )
    assert ratio.max() / ratio.min() > 2  # real factors, not all equal (measured 2.4)
    with torch.no_grad():
        out = model(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def _outlier_model() -> LlamaForCausalLM:
    """CFG with a few input channels 40x larger in every quantised linear's input: q/k/v and
    gate/up through the norms' weights, down_proj through up_proj's rows."""
    m = LlamaForCausalLM(CFG, seed=0)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.input_layernorm.weight[[3, 40]] *= 40
            layer.post_attention_layernorm.weight[[7, 50]] *= 40
            layer.mlp.up_proj.weight[[5, 100]] *= 40
    return m


def _logits(alpha: float, ids: torch.Tensor, quantization: str | None = "w8a8") -> torch.Tensor:
    from llmlab.inference import LLM

    llm = LLM(
        copy.deepcopy(_outlier_model()),
        device="cpu",
        num_gpu_blocks=8,
        quantization=quantization,
        smoothquant_alpha=alpha,
    )
    with torch.no_grad():
        return llm.engine.runner.model(ids)


def test_smoothing_reduces_w8a8_error_with_channel_outliers():
    ids = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = _logits(0.0, ids, None)
    err = {a: (_logits(a, ids) - ref).pow(2).mean().sqrt().item() for a in (0.0, 0.5)}
    assert err[0.5] < 0.5 * err[0.0], err  # measured 0.0066 against 0.0195 (rms over logits)


def test_smoothing_factors_and_bad_alpha():
    act = torch.tensor([8.0, 0.5, 0.0])
    w = torch.tensor([[0.5, 2.0, 1.0], [-2.0, 0.5, 1.0]])  # column max 2, 2, 1
    s = S.smoothing_factors(act, [w], 0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0]))  # sqrt(8/2), sqrt(0.5/2); unseen: 1
    with pytest.raises(ValueError, match="alpha"):
        S.smooth(LlamaForCausalLM(CFG), torch.zeros(1, 4, dtype=torch.long), 0.0)
    from llmlab.inference.engine_config import EngineConfig

    assert EngineConfig().smoothquant_alpha == S.ALPHA  # the engine's default is the module's
    with pytest.raises(ValueError, match="smoothquant_alpha"):
        EngineConfig(smoothquant_alpha=1.5)
    ids = S.calibration_ids(None, 97, n=2, seq_len=8)  # no tokenizer: seeded ids, same every time
    assert ids.shape == (2, 8) and ids.max() < 97 and torch.equal(ids, S.calibration_ids(None, 97, 2, 8))
