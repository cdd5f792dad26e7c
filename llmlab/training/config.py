"""``TrainConfig``: every ``llmlab train`` flag, and the checks run before any rank starts.

Each parallel strategy adds its own layout checks in :func:`validate`; a bad layout raises
``ValueError`` naming the constraint (e.g. ``tp=3 must divide num_attention_heads=4``) in the
caller, before processes are launched.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from llmlab.model.config import ModelConfig, get_preset
from llmlab.runtime.mesh import check_degrees


@dataclass
class TrainConfig:
    model: str = "tiny"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    pp_schedule: str = "1f1b"
    num_microbatches: int = 1
    virtual_stages: int = 1
    sequence_parallel: bool = False
    num_experts: int | None = None
    top_k: int | None = None
    capacity_factor: float | None = None
    steps: int = 100
    global_batch_size: int = 16
    seq_len: int = 64
    lr: float = 3e-3
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    grad_clip: float | None = None
    seed: int = 0
    dtype: str = "fp32"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    device: str = "auto"
    metrics_json: str | None = None
    save_model: str | None = None
    dp_mode: str = "ddp"
    bucket_mb: float = 25.0

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"world_size": self.world_size}

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "TrainConfig":
        """Read flags from a JSON (or, with PyYAML installed, YAML) file; keys are flag names
        with ``-`` or ``_``. Raises ``ValueError`` on unknown keys."""
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml  # optional
            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
        data = {k.replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown keys in {path}: {', '.join(unknown)}")
        return cls(**(data | overrides))


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The model preset with the MoE flags applied."""
    overrides = {"max_position_embeddings": max(cfg.seq_len, get_preset(cfg.model).max_position_embeddings)}
    if cfg.num_experts is not None:
        overrides["num_experts"] = cfg.num_experts
    if cfg.top_k is not None:
        overrides["num_experts_per_tok"] = cfg.top_k
    if cfg.capacity_factor is not None:
        overrides["capacity_factor"] = cfg.capacity_factor
    mc = get_preset(cfg.model, **overrides)
    if mc.num_experts and not mc.moe_intermediate_size:
        mc = mc.replace(moe_intermediate_size=mc.intermediate_size)
    return mc


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def resolve_device(cfg: TrainConfig) -> str:
    """``cpu`` or ``cuda``; raises ``ValueError`` if CUDA is asked for but absent or too small."""
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {cfg.device!r}: expected auto, cpu or cuda")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cfg.device == "cuda":
        if n == 0:
            raise ValueError("--device cuda, but no CUDA GPU is available")
        from llmlab.runtime.launch import under_torchrun
        if not under_torchrun() and cfg.world_size > n:
            raise ValueError(f"{cfg.world_size} ranks need {cfg.world_size} GPUs, but only {n} "
                             f"are visible (one GPU per rank)")
        return "cuda"
    if cfg.device == "cpu":
        return "cpu"
    from llmlab.runtime.launch import under_torchrun
    return "cuda" if n > 0 and (cfg.world_size <= n or under_torchrun()) else "cpu"


def validate(cfg: TrainConfig) -> ModelConfig:
    """Check a configuration before launching. Returns the resolved model config.

    Raises ``ValueError`` naming the first violated constraint, or ``NotImplementedError`` for a
    feature this version does not have yet.
    """
    for name in ("steps", "global_batch_size", "seq_len", "num_microbatches", "virtual_stages"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if cfg.lr <= 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    from llmlab.training.lr_schedule import check_schedule
    check_schedule(cfg.lr_schedule, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
    if cfg.grad_clip is not None and cfg.grad_clip <= 0:
        raise ValueError(f"--grad-clip must be > 0, got {cfg.grad_clip}")
    check_degrees(cfg.world_size, cfg.dp, cfg.tp, cfg.pp, cfg.ep)
    if cfg.zero not in (0, 1, 2, 3):
        raise ValueError(f"--zero {cfg.zero}: expected 0, 1, 2 or 3")
    if cfg.dtype not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"--dtype {cfg.dtype!r}: expected fp32, bf16 or fp16")
    if cfg.pp_schedule not in ("gpipe", "1f1b", "interleaved"):
        raise ValueError(f"--pp-schedule {cfg.pp_schedule!r}: expected gpipe, 1f1b or interleaved")
    if cfg.dp_mode not in ("naive", "ddp", "ring"):
        raise ValueError(f"--dp-mode {cfg.dp_mode!r}: expected naive, ddp or ring")
    mc = model_config(cfg)
    if cfg.seq_len > mc.max_position_embeddings:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds max_position_embeddings "
                         f"{mc.max_position_embeddings}")
    if cfg.global_batch_size % cfg.dp:
        raise ValueError(f"dp={cfg.dp} must divide --global-batch-size {cfg.global_batch_size}")
    local = cfg.global_batch_size // cfg.dp
    if local % cfg.num_microbatches:
        raise ValueError(f"--num-microbatches {cfg.num_microbatches} must divide the per-rank batch "
                         f"{local} (global batch {cfg.global_batch_size} / dp {cfg.dp})")
    if (cfg.num_experts or cfg.top_k or cfg.capacity_factor) and not mc.num_experts:
        raise ValueError("--num-experts/--top-k/--capacity-factor need a MoE model "
                         "(--model tiny-moe or --num-experts E > 0)")
    if mc.num_experts and mc.num_experts % cfg.ep:
        raise ValueError(f"ep={cfg.ep} must divide num_experts={mc.num_experts}")
    if cfg.ep > 1 and not mc.num_experts:
        raise ValueError(f"ep={cfg.ep} needs a mixture-of-experts model (--model tiny-moe)")
    if cfg.checkpoint_every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if cfg.save_model and (cfg.tp > 1 or cfg.pp > 1 or cfg.ep > 1):
        raise NotImplementedError("--save-model with tp/pp/ep > 1 is not supported yet "
                                  "(the model would have to be gathered from its shards)")
    resolve_device(cfg)
    _check_features(cfg, mc)
    for module in STRATEGY_VALIDATORS:
        if _have(module):
            check = getattr(importlib.import_module(module), "validate_layout", None)
            if check is not None:
                check(cfg, mc)
    return mc


# Modules that may define ``validate_layout(cfg, model_config)`` (raise ValueError).
STRATEGY_VALIDATORS = (
    "llmlab.parallel.data_parallel",
    "llmlab.parallel.tensor_parallel",
    "llmlab.parallel.pipeline_parallel",
    "llmlab.parallel.expert_parallel",
    "llmlab.parallel.zero",
)


def _check_features(cfg: TrainConfig, mc: ModelConfig) -> None:
    """Refuse, with a clear message, flags whose implementation has not landed."""
    needs = [
        (cfg.dp > 1 and cfg.zero == 0, "--dp > 1", "llmlab.parallel.data_parallel"),
        (cfg.tp > 1, "--tp > 1", "llmlab.parallel.tensor_parallel"),
        (cfg.pp > 1, "--pp > 1", "llmlab.parallel.pipeline_parallel"),
        (bool(mc.num_experts), "mixture-of-experts models", "llmlab.model.moe"),
        (cfg.ep > 1, "--ep > 1", "llmlab.parallel.expert_parallel"),
        (cfg.zero > 0, "--zero > 0", "llmlab.parallel.zero"),
        (cfg.dtype != "fp32", f"--dtype {cfg.dtype}", "llmlab.training.precision"),
        (cfg.activation_checkpointing, "--activation-checkpointing", "llmlab.training.recompute"),
        (cfg.cpu_offload, "--cpu-offload", "llmlab.parallel.zero"),
        (bool(cfg.checkpoint_dir), "--checkpoint-dir", "llmlab.training.checkpoint"),
    ]
    for used, flag, module in needs:
        if used and not _have(module):
            raise NotImplementedError(f"{flag} is not supported yet (needs {module})")
