"""Lab 15's exercise check fails, in plain words, on realistic wrong merges; the reference merge
gives peft's merged weight on a real LoRA layer."""

import pytest
import torch

from llmlab import check, exercises
from llmlab.check import ExerciseFailed


def _unscaled(w, a, b, alpha):
    return w + b @ a


def _scaled_by_alpha_times_rank(w, a, b, alpha):
    return w + alpha * a.shape[0] * (b @ a)


def _update_only(w, a, b, alpha):
    return alpha / a.shape[0] * (b @ a)


def _in_place(w, a, b, alpha):
    w += alpha / a.shape[0] * (b @ a)
    return w


def _transposed(w, a, b, alpha):
    return w + alpha / a.shape[0] * (a.t() @ b.t())


WRONG = [
    (_unscaled, "alpha / r"),
    (_scaled_by_alpha_times_rank, "alpha divided by the rank"),
    (_update_only, "add the update to the base weight"),
    (_in_place, "return a new tensor"),
    (_transposed, "B [out, r]"),
]


@pytest.mark.parametrize("wrong,words", WRONG, ids=[w.__name__ for w, _ in WRONG])
def test_wrong_merge_is_explained(wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        check.merge_lora(wrong)
    assert words in str(info.value) and "expected:" in str(info.value)


def test_reference_merge_equals_peft_merge_and_unload():
    import peft  # the dev extra installs it

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 12, bias=False))
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    layer = model.base_model.model[0]
    w, a, b = (
        t.detach().clone()
        for t in (layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    )
    merged = model.merge_and_unload()[0].weight
    assert torch.allclose(exercises.merge_lora(w, a, b, 8.0), merged, atol=1e-6)
