"""LoRA: low-rank adapters on a frozen model (Hu et al. 2021, "LoRA", §4.1), in PEFT's layout.

A target linear layer ``W [out, in]`` becomes ``y = x W^T + b + (alpha / r) * x A^T B^T`` with
``A [r, in]`` and ``B [out, r]``; only ``A`` and ``B`` train, so the base has no gradients and no
optimizer states. Initialisation as PEFT's default: ``A ~ U(-1/sqrt(in), 1/sqrt(in))`` (kaiming
uniform, a = sqrt(5)), ``B = 0``, so training starts exactly at the base model. The generator of
each ``A`` is seeded from ``(seed, parameter name)``, so every rank builds the same adapters.

Names follow PEFT's: the base keeps ``...q_proj.weight``, the adapter is ``...q_proj.lora_A.weight``
and ``...q_proj.lora_B.weight``; :func:`save_peft_adapter` writes them as
``base_model.model.<name>`` into ``adapter_model.safetensors`` beside an ``adapter_config.json``,
which ``peft.PeftModel.from_pretrained`` loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Linear):
    """``nn.Linear`` (the base's own ``weight``/``bias`` Parameters, frozen) plus ``lora_A``
    ``[r, in]`` and ``lora_B`` ``[out, r]``. ``forward(x [..., in]) -> [..., out]``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(x)) * self.scaling
        return out


def parse_targets(spec: str) -> list[str]:
    """``"q_proj,v_proj"`` -> ``["q_proj", "v_proj"]``; ``ValueError`` naming an unknown module."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise ValueError(f"--lora-target {spec!r}: expected a comma-separated list of {', '.join(TARGETS)}")
    return names


def check_rank(config: Any, rank: int, targets: list[str]) -> None:
    """``ValueError`` for a rank below 1 or above a target layer's smaller side."""
    if rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {rank}")
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    sides = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, f),
        "up_proj": (h, f),
        "down_proj": (f, h),
    }
    for t in targets:
        if rank > min(sides[t]):
            raise ValueError(
                f"--lora-rank {rank} is larger than {t} ({sides[t][1]} x {sides[t][0]}): "
                f"at most {min(sides[t])}"
            )


def is_target(name: str, targets: list[str]) -> bool:
    """Whether module ``name`` (a full-model name) is a LoRA target: a decoder layer's
    ``*.<target>``."""
    return name.rsplit(".", 1)[-1] in targets and ".layers." in f".{name}"


def init_lora_A(name: str, in_features: int, rank: int, seed: int) -> torch.Tensor:
    """The initial ``A [rank, in_features]`` of module ``name``: kaiming uniform (PEFT's default,
    ``U(-1/sqrt(in), 1/sqrt(in))``) from a generator seeded by ``(seed, name)``, the same on every
    rank and every layout (a tensor-parallel rank cuts its slice of it)."""
    import zlib

    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1))
    bound = 1 / math.sqrt(in_features)
    return torch.rand((rank, in_features), generator=g) * 2 * bound - bound


def adapter_shapes(model: nn.Module, names: list[str], rank: int) -> dict[str, tuple[int, int]]:
    """The full (unsharded) shapes of the adapters of modules ``names``: ``lora_A [rank, in]``,
    ``lora_B [out, rank]`` from each module's ``in_features``/``out_features`` (the full sizes,
    also for a tensor-parallel layer)."""
    shapes = {}
    for n in names:
        m = model.get_submodule(n)
        shapes[f"{n}.lora_A.weight"] = (rank, int(getattr(m, "in_features")))
        shapes[f"{n}.lora_B.weight"] = (int(getattr(m, "out_features")), rank)
    return shapes


@torch.no_grad()
def apply_lora(model: nn.Module, targets: list[str], rank: int, alpha: float, seed: int = 0) -> list[str]:
    """Replace every ``nn.Linear`` named ``*.<target>`` in ``model`` by a :class:`LoRALinear`,
    freeze every other parameter, and return the adapted modules' names. (Under tensor
    parallelism: :func:`llmlab.parallel.tp_lora.apply_lora`.)"""
    for p in model.parameters():
        p.requires_grad_(False)
    done = []
    for name, module in list(model.named_modules()):
        if not is_target(name, targets) or not isinstance(module, nn.Linear):
            continue
        leaf = name.rsplit(".", 1)[-1]
        lora = LoRALinear(module, rank, alpha)
        lora.lora_A.weight.copy_(init_lora_A(name, module.in_features, rank, seed))
        lora.lora_B.weight.zero_()
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        setattr(parent, leaf, lora)
        done.append(name)
    if not done:
        raise ValueError(f"--lora-target {','.join(targets)}: no such linear layer in the model")
    return done


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors ``{name: tensor}`` of ``model`` (names ending ``lora_A/B.weight``)."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def save_peft_adapter(
    tensors: dict[str, torch.Tensor],
    path: str | Path,
    *,
    base: str,
    rank: int,
    alpha: float,
    targets: list[str],
) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (PEFT's LoRA format) from
    llmlab adapter tensors ``{model.layers.0.self_attn.q_proj.lora_A.weight: ...}``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {f"base_model.model.{n}": t.detach().float().cpu().contiguous() for n, t in tensors.items()}
    save_file(state, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def load_peft_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(adapter_config, {llmlab name: tensor})`` of a PEFT LoRA adapter folder. Raises
    ``ValueError`` naming what is missing or not LoRA."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, weights = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(
            f"{path}: not a PEFT adapter (needs adapter_config.json and adapter_model.safetensors)"
        )
    config = json.loads(cfg_file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    state = {}
    for n, t in load_file(str(weights)).items():
        n = n.removeprefix("base_model.model.")
        state[n if n.endswith(".weight") else n + ".weight"] = t
    return config, state
