"""``TrainConfig``: every ``llmlab train`` flag, and the checks run before any rank starts.

Each parallel strategy's own ``validate`` holds its layout rules (:func:`validate` calls them); a bad layout raises
``ValueError`` naming the constraint (e.g. ``tp=3 must divide num_attention_heads=4``) in the
caller, before processes are launched.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmlab.formulas._checks import check_count
from llmlab.model.config import PRESETS, ModelConfig, get_preset
from llmlab.parallel.configs import (
    ContextParallelConfig,
    DataParallelConfig,
    ExpertParallelConfig,
    PipelineConfig,
    TensorParallelConfig,
    ZeroConfig,
)

# Every rank seeds torch with --seed and the data order with --seed * 1_000_003 + step (both < 2**64).
SEED_LIMIT = 2**32

if TYPE_CHECKING:  # torch-free at import: `llmlab train` checks its flags before importing torch
    from llmlab.parallel.protocols import Strategy
    from llmlab.runtime.mesh import Mesh


def option(default, help: str, choices=None):
    """A :class:`TrainConfig` field: its default, the ``--help`` text and, optionally, the allowed
    values. The ``llmlab train`` flag, its type, default, help and choices, the config-file key and
    the check in :func:`validate` all come from here."""
    meta = {"help": help} | ({"choices": tuple(choices)} if choices is not None else {})
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    """One training run: every ``llmlab train`` flag, config-file key and Python keyword.

    ``llmlab train --seq-len 128`` == ``{"seq-len": 128}`` in a ``--config`` file ==
    ``TrainConfig(seq_len=128)``. The command line is generated from these fields
    (:func:`llmlab.cli.add_train_arguments`): a field ``grad_clip`` becomes ``--grad-clip``, its type
    (``int``, ``float``, ``str``, ``bool``, or ``X | None``) the flag's type; a ``bool`` field off by
    default is a ``--flag`` switch, one on by default a ``--flag/--no-flag`` pair.

    To add an option, add ONE field here and nothing in ``cli.py``::

        grad_clip: float | None = option(None, "clip the global gradient norm to this value")
        lr_schedule: str = option("constant", "learning-rate schedule", choices=("constant", "cosine"))

    then read ``cfg.grad_clip`` where it acts, add any check beyond ``choices`` (which
    :func:`validate` enforces) to :func:`validate` or, for a layout rule, to the strategy's
    ``validate(config, mesh, model_config)`` (a strategy reads its own config,
    :mod:`llmlab.parallel.configs`, which :func:`strategy_configs` fills from this one), and list
    the flag in docs/CONTRACT.md if labs or tests rely on it. The help text says what the option
    does and its unit; ``tests/test_train.py`` fails for a field without one. A new value the
    run reports (a per-step ``grad_norm``, a mesh coordinate) goes into
    ``llmlab/metrics/train_metrics.schema.json`` too.
    """

    model: str = option("tiny", "model preset (llmlab.model.config.PRESETS)", choices=sorted(PRESETS))
    init_from: str | None = option(
        None,
        "start from this Hugging Face Llama/Qwen2 checkpoint folder "
        "(config.json + safetensors + tokenizer) instead of --model; "
        "llmlab.training.hf_init",
    )
    dp: int = option(1, "data-parallel degree (model replicas)")
    tp: int = option(1, "tensor-parallel degree (ranks that split each layer's matrices)")
    pp: int = option(1, "pipeline-parallel degree (ranks that split the layers into stages)")
    ep: int = option(1, "expert-parallel degree (ranks that split the experts; divides dp*tp)")
    cp: int = option(
        1, "context-parallel degree (ranks that split each sequence; llmlab.parallel.context_parallel)"
    )
    cp_mode: str = option(
        "ring",
        "context parallelism: ring attention (K/V blocks passed around a "
        "ring) or ulysses (all-to-all to head shards)",
        choices=("ring", "ulysses"),
    )
    zero: int = option(
        0, "ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also weights", choices=(0, 1, 2, 3)
    )
    pp_schedule: str = option("1f1b", "pipeline schedule", choices=("gpipe", "1f1b", "interleaved"))
    num_microbatches: int = option(1, "micro-batches per step (pipeline and gradient accumulation)")
    virtual_stages: int = option(1, "model chunks per pipeline rank (interleaved schedule)")
    sequence_parallel: bool = option(
        False, "with --tp > 1, split the activations between tensor-parallel regions along the sequence"
    )
    num_experts: int | None = option(None, "experts per MoE layer (default: the preset's)")
    top_k: int | None = option(None, "experts each token is routed to (default: the preset's)")
    capacity_factor: float | None = option(
        None, "expert capacity as a multiple of the even share of tokens (default: the preset's)"
    )
    data: str | None = option(
        None,
        'train on this JSONL file (or folder of *.jsonl): {"text"} or chat '
        '{"messages"} lines, one padded example per row '
        "(llmlab.data.jsonl)",
    )
    loss_tokens: str = option(
        "assistant",
        "with --data chat examples: the loss counts the assistant tokens only, or all tokens",
        choices=("assistant", "all"),
    )
    eval_fraction: float = option(
        0.1, "with --data: the fraction of examples held out for the evaluation loss"
    )
    eval_every: int = option(0, "with --data: the held-out loss every N steps (and after the last); 0 never")
    lora_rank: int | None = option(
        None,
        "train LoRA adapters of this rank on the frozen --init-from "
        "model (llmlab.model.lora); --save-model then writes a PEFT "
        "adapter",
    )
    lora_alpha: float = option(
        16.0, "LoRA scale numerator: the adapter's output is multiplied by alpha / rank"
    )
    lora_target: str = option(
        "q_proj,v_proj",
        "comma-separated linear layers that get adapters "
        "(q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj)",
    )
    steps: int = option(100, "optimizer steps")
    global_batch_size: int = option(16, "sequences per step, over all data-parallel ranks")
    seq_len: int = option(64, "tokens per sequence")
    lr: float = option(3e-3, "AdamW learning rate (the peak, with a schedule)")
    lr_schedule: str = option(
        "constant",
        "learning-rate decay after warm-up, reaching --min-lr at the last step (nanoGPT/Megatron shapes)",
        choices=("constant", "linear", "cosine"),
    )
    warmup_steps: int = option(0, "linear warm-up from 0 to --lr over this many steps")
    min_lr: float = option(0.0, "learning rate at the last step (linear/cosine schedules)")
    grad_clip: float | None = option(
        None, "clip the global gradient norm (all ranks, replicated parameters counted once) to this value"
    )
    max_consecutive_skips: int = option(
        10,
        "stop with an error after this many steps in a row "
        "whose gradient was non-finite (each one skipped, not "
        "applied; fp16 counts them once its loss scale is at "
        "the minimum); 0 never stops",
    )
    seed: int = option(0, "seed for weights and data order (same seed, same run), in [0, 2**32)")
    dtype: str = option(
        "fp32",
        "compute dtype; bf16/fp16 keep fp32 master weights (fp16 adds loss scaling)",
        choices=("fp32", "bf16", "fp16"),
    )
    activation_checkpointing: bool = option(
        False, "recompute each layer's activations in the backward pass instead of keeping them"
    )
    cpu_offload: bool = option(
        False, "with --zero, keep fp32 master weights and Adam moments in CPU memory (ZeRO-Offload)"
    )
    checkpoint_dir: str | None = option(None, "folder for training checkpoints")
    checkpoint_every: int = option(
        0,
        "with --checkpoint-dir, also save every N steps (a checkpoint is always written after the last step)",
    )
    checkpoint_every_minutes: float = option(
        0.0,
        "with --checkpoint-dir, also save when this many "
        "minutes of training have passed since the last "
        "save (rank 0's clock decides; 0: never by time)",
    )
    resume: bool = option(False, "continue from the latest checkpoint in --checkpoint-dir")
    override_opt_param_scheduler: bool = option(
        False,
        "with --resume, take this run's --lr, --lr-schedule, --min-lr, --warmup-steps and "
        "--steps instead of refusing values that differ from the checkpoint's (Megatron's "
        "--override-opt_param-scheduler)",
    )
    override_data_order: bool = option(
        False,
        "with --resume, take this run's --seed, --global-batch-size and --seq-len instead "
        "of refusing values that differ from the checkpoint's (the steps left then train on "
        "other data than the run it continues would have)",
    )
    device: str = option(
        "auto",
        "where ranks run (auto: one GPU per rank if enough, else CPU)",
        choices=("auto", "cpu", "cuda"),
    )
    metrics_json: str | None = option(None, "write the run's metrics (docs/CONTRACT.md) to this file")
    save_model: str | None = option(
        None, "after training, write the model here as config.json + model.safetensors"
    )
    dp_mode: str = option(
        "ddp",
        "data-parallel gradient sync: naive per-tensor all-reduce, bucketed overlapped ddp, or our own ring",
        choices=("naive", "ddp", "ring"),
    )
    bucket_mb: float = option(25.0, "DDP gradient bucket size in MiB")
    profile_steps: str | None = option(
        None, "with --profile-dir, record steps A:B (1-based, inclusive) with the PyTorch profiler"
    )
    profile_dir: str | None = option(
        None, "write one Chrome trace per rank here (rank{R}.pt.trace.json.gz; Perfetto, TensorBoard, HTA)"
    )
    tensorboard: str | None = option(
        None, "write TensorBoard scalars (loss, grad norm, lr, tokens/s, MFU, memory per rank) to this folder"
    )

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"world_size": self.world_size}

    def require_checkpoint_dir(self) -> str:
        """``checkpoint_dir``, which resuming and saving checkpoints need; ``ValueError`` naming the
        flag when it is unset (:func:`check_inputs` refuses such a configuration first)."""
        if not self.checkpoint_dir:
            raise ValueError("--resume and --checkpoint-every need --checkpoint-dir")
        return self.checkpoint_dir

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "TrainConfig":
        """Read flags from a JSON (or, with PyYAML installed, YAML) file; keys are flag names
        with ``-`` or ``_``. Raises ``ValueError`` on unknown keys."""
        import typing

        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml  # optional

            try:
                data = yaml.safe_load(text) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a mapping of TrainConfig keys, not a {type(data).__name__}")
        data = {str(k).replace("-", "_"): v for k, v in data.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown keys in {path}: {', '.join(unknown)}")
        hints = typing.get_type_hints(cls)
        for k, v in list(data.items()):
            kinds = typing.get_args(hints[k]) or (hints[k],)  # X | None -> (X, NoneType)
            if float in kinds and isinstance(v, str):  # PyYAML reads 3e-3 (no dot) as a string
                try:
                    data[k] = v = float(v)
                except ValueError:
                    pass
            ok = any(
                v is None
                if t is type(None)
                else isinstance(v, (int, float)) and not isinstance(v, bool)
                if t is float
                else isinstance(v, t) and (t is bool or not isinstance(v, bool))
                for t in kinds
            )
            if not ok:
                want = " or ".join("null" if t is type(None) else t.__name__ for t in kinds)
                raise ValueError(f"{path}: {k} must be {want}, got {v!r}")
        return cls(**(data | overrides))


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The model preset with the MoE flags applied (or the ``--init-from`` checkpoint's)."""
    if cfg.init_from:
        from llmlab.training.hf_init import hf_model_config

        return hf_model_config(cfg.init_from)  # --seq-len beyond its positions is refused
    overrides: dict[str, int | float] = {
        "max_position_embeddings": max(cfg.seq_len, get_preset(cfg.model).max_position_embeddings)
    }
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


def resolve_device(cfg: TrainConfig) -> str:
    """``cpu`` or ``cuda`` for ``cfg.world_size`` ranks (:func:`llmlab.runtime.hardware.
    resolve_device`); raises ``ValueError`` if CUDA is asked for but absent or too small."""
    from llmlab.runtime.hardware import resolve_device as resolve_hw_device
    from llmlab.runtime.process import under_torchrun

    return resolve_hw_device(cfg.device, cfg.world_size, flag="--device", torchrun=under_torchrun())


# Whole-number flags and their least value; real-valued flags and whether 0 is allowed. None (an
# optional flag not given) is allowed; anything else out of range is refused, never defaulted.
COUNT_FLAGS = {
    "dp": 1,
    "tp": 1,
    "pp": 1,
    "ep": 1,
    "cp": 1,
    "num_microbatches": 1,
    "virtual_stages": 1,
    "steps": 1,
    "global_batch_size": 1,
    "seq_len": 1,
    "num_experts": 1,
    "top_k": 1,
    "warmup_steps": 0,
    "max_consecutive_skips": 0,
    "checkpoint_every": 0,
    "eval_every": 0,
    "lora_rank": 1,
}
REAL_FLAGS = {
    "lr": False,
    "min_lr": True,
    "grad_clip": False,
    "capacity_factor": False,
    "bucket_mb": False,
    "checkpoint_every_minutes": True,
    "eval_fraction": True,
    "lora_alpha": False,
}


def check_numbers(cfg: TrainConfig) -> None:
    """Each numeric flag on its own: an integer (not a bool) at least its :data:`COUNT_FLAGS`
    value, a finite number > 0 (>= 0 where :data:`REAL_FLAGS` allows 0), ``--seed`` in
    ``[0, 2**32)``. Raises ``ValueError`` naming the flag (``--lr must be a finite number, got
    nan``)."""
    for name, least in COUNT_FLAGS.items():
        v, flag = getattr(cfg, name), "--" + name.replace("_", "-")
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{flag} must be an integer, got {v!r}")
        if v < least:
            raise ValueError(f"{flag} must be >= {least}, got {v}")
    for name, zero_ok in REAL_FLAGS.items():
        if getattr(cfg, name) is not None:
            check_count("--" + name.replace("_", "-"), getattr(cfg, name), allow_zero=zero_ok)
    if isinstance(cfg.seed, bool) or not isinstance(cfg.seed, int) or not 0 <= cfg.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be an integer in [0, 2**32), got {cfg.seed!r}")


def check_inputs(cfg: TrainConfig) -> ModelConfig:
    """The checks that need no torch (so ``llmlab train`` refuses bad flags at once): every flag
    alone (:func:`check_numbers`, choices) and together (batch and degrees, schedule, model
    shape, paths). Returns the resolved model config; raises as :func:`validate`."""
    check_numbers(cfg)
    if cfg.dp % cfg.ep:
        raise ValueError(
            f"ep={cfg.ep} must divide dp={cfg.dp} (--ep divides --dp: expert-parallel "
            f"groups are carved out of the data-parallel ranks)"
        )
    for f in dataclasses.fields(cfg):
        choices, value = f.metadata.get("choices"), getattr(cfg, f.name)
        if choices is not None and value not in choices:
            *rest, last = map(str, choices)
            raise ValueError(f"--{f.name.replace('_', '-')} {value!r}: expected {', '.join(rest)} or {last}")
    from llmlab.training.lr_schedule import check_schedule

    check_schedule(cfg.lr_schedule, cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
    experts = get_preset(cfg.model).num_experts if cfg.num_experts is None else cfg.num_experts
    if cfg.top_k is not None and experts and cfg.top_k > experts:
        raise ValueError(
            f"--top-k {cfg.top_k} must be <= the number of experts {experts} "
            f"(--num-experts, else the preset's)"
        )
    if cfg.init_from and (cfg.num_experts or cfg.top_k or cfg.capacity_factor):
        raise ValueError(
            "--num-experts/--top-k/--capacity-factor do not apply to --init-from "
            "(llama/qwen2 checkpoints are dense)"
        )
    mc = model_config(cfg)
    if cfg.seq_len > mc.max_position_embeddings:
        raise ValueError(
            f"--seq-len {cfg.seq_len} exceeds max_position_embeddings {mc.max_position_embeddings}"
        )
    if (cfg.num_experts or cfg.top_k or cfg.capacity_factor) and not mc.num_experts:
        raise ValueError(
            "--num-experts/--top-k/--capacity-factor need a MoE model "
            "(--model tiny-moe or --num-experts E > 0)"
        )
    if cfg.data or cfg.eval_every:
        from llmlab.training.data_source import check_data

        check_data(cfg)  # reads and tokenizes every example: errors name file and line
    if cfg.lora_rank is not None:
        check_lora(cfg, mc)
    if cfg.resume and not cfg.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if cfg.checkpoint_every_minutes < 0:
        raise ValueError(f"--checkpoint-every-minutes must be >= 0, got {cfg.checkpoint_every_minutes}")
    for flag in ("checkpoint_every", "checkpoint_every_minutes"):
        if getattr(cfg, flag) and not cfg.checkpoint_dir:
            raise ValueError(f"--{flag.replace('_', '-')} needs --checkpoint-dir")
    for flag, path in (("--checkpoint-dir", cfg.checkpoint_dir), ("--save-model", cfg.save_model)):
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"{flag} {path!r} is a file; it must be a folder (or not exist yet)")
    _check_observability(cfg)
    if cfg.metrics_json and Path(cfg.metrics_json).is_dir():
        raise ValueError(f"--metrics-json {cfg.metrics_json!r} is a folder; it must be a file path")
    if cfg.save_model and mc.num_experts:
        raise NotImplementedError(
            f"--save-model writes a Llama checkpoint (config.json + "
            f"model.safetensors), which has no mixture-of-experts layers: "
            f"--model {cfg.model} cannot be saved (use --checkpoint-dir)"
        )
    return mc


def validate(cfg: TrainConfig) -> ModelConfig:
    """Check a configuration before launching. Returns the resolved model config.

    :func:`check_inputs`, then the mesh's degrees, the device and each strategy's own checks.
    Raises ``ValueError`` naming the first violated constraint, or ``NotImplementedError`` for a
    feature this version does not have yet.
    """
    mc = check_inputs(cfg)
    mesh = layout_mesh(cfg)
    resolve_device(cfg)
    # Every layout rule lives in its strategy: each checks its own config against the mesh's
    # degrees and the model (ValueError naming the constraint). The batch split and the experts
    # first, then the model's sharding: the first error reported is the most general one.
    from llmlab.parallel import (
        context_parallel,
        data_parallel,
        expert_parallel,
        pipeline_parallel,
        tp_plan,
        zero,
    )

    sc = strategy_configs(cfg)
    checks: list[tuple[Strategy, object]] = [
        (data_parallel, sc.dp),
        (expert_parallel, sc.ep),
        (tp_plan, sc.tp),
        (pipeline_parallel, sc.pp),
        (zero, sc.zero),
        (context_parallel, sc.cp),
    ]
    for strategy, c in checks:
        strategy.validate(c, mesh, mc)
    return mc


def check_lora(cfg: TrainConfig, mc: ModelConfig) -> None:
    """The ``--lora-*`` checks (``ValueError`` naming the flag)."""
    from llmlab.model.lora import check_rank, parse_targets

    if cfg.lora_rank is None:
        return  # no adapters: nothing to check
    if not cfg.init_from:
        raise ValueError("--lora-rank needs --init-from (adapters are trained on a pretrained base)")
    check_rank(mc, cfg.lora_rank, parse_targets(cfg.lora_target))


def _check_observability(cfg: TrainConfig) -> None:
    """``--profile-steps``/``--profile-dir`` (both or neither, a range inside the run, a writable
    folder) and ``--tensorboard`` (a writable folder); ``ValueError`` naming the flag."""
    from llmlab.metrics.profiling import check_dir, parse_steps

    if bool(cfg.profile_steps) != bool(cfg.profile_dir):
        raise ValueError(
            "--profile-steps and --profile-dir go together (which steps to record, and where the traces go)"
        )
    if cfg.profile_steps and cfg.profile_dir:
        parse_steps(cfg.profile_steps, 1, cfg.steps)
        check_dir(cfg.profile_dir, "--profile-dir")
    if cfg.tensorboard:
        check_dir(cfg.tensorboard, "--tensorboard")
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "--tensorboard needs the tensorboard package: pip install tensorboard (or llmlab[observe])"
            )


@dataclass(frozen=True)
class StrategyConfigs:
    """Every strategy's config (:mod:`llmlab.parallel.configs`) for one ``TrainConfig``."""

    dp: DataParallelConfig
    tp: TensorParallelConfig
    pp: PipelineConfig
    ep: ExpertParallelConfig
    zero: ZeroConfig
    cp: ContextParallelConfig


def strategy_configs(cfg: TrainConfig) -> StrategyConfigs:
    """What each strategy is told of ``cfg`` (the strategies never read ``TrainConfig``); the
    degrees are the mesh's (:func:`layout_mesh` before launch). The pipeline's ``seq_len`` is
    this rank's: under context parallelism its stages exchange ``seq_len / cp`` tokens."""
    return StrategyConfigs(
        dp=DataParallelConfig(cfg.dp_mode, cfg.bucket_mb, cfg.global_batch_size, cfg.num_microbatches),
        tp=TensorParallelConfig(cfg.sequence_parallel, cfg.seq_len),
        pp=PipelineConfig(
            cfg.pp_schedule,
            cfg.virtual_stages,
            cfg.num_microbatches,
            cfg.seq_len // cfg.cp,
            cfg.sequence_parallel,
        ),
        ep=ExpertParallelConfig(),
        zero=ZeroConfig(cfg.zero, cfg.dtype, cfg.bucket_mb, cfg.cpu_offload, bool(cfg.save_model)),
        cp=ContextParallelConfig(cfg.cp_mode, cfg.seq_len, cfg.sequence_parallel),
    )


def layout_mesh(cfg: TrainConfig) -> Mesh:
    """The mesh's shape before any rank starts: ``cfg``'s degrees, no process groups (what the
    strategies' ``validate`` reads). Raises ``ValueError`` when the degrees cannot form a mesh."""
    from llmlab.runtime.mesh import Mesh, check_degrees

    check_degrees(cfg.world_size, cfg.dp, cfg.tp, cfg.pp, cfg.ep, cfg.cp)
    return Mesh(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp)
