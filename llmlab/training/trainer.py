"""The training loop that composes the mesh, the model and the parallel strategies.

:func:`train` validates a :class:`~llmlab.training.config.TrainConfig` in the caller, launches
``dp*cp*tp*pp`` ranks (or joins torchrun's), and each rank runs :func:`rank_main`:

1. build the :class:`~llmlab.runtime.mesh.Mesh`;
2. build each strategy's config once (:func:`~llmlab.training.config.strategy_configs`) and the
   *full* model from the seed (identical on every rank, whatever the layout), then apply the
   strategies in one fixed order, each through its ``apply(model, mesh, config)``
   (:class:`~llmlab.parallel.protocols.Strategy`): tensor (+ sequence) parallelism
   (``tp_plan``), context parallelism, expert parallelism, pipeline stages;
3. wrap what remains for ZeRO or data parallelism, and build the pipeline's runner with that
   wrapper;
4. each step: the global batch of that step (same for every layout), this rank's rows,
   ``num_microbatches`` forward/backward passes (loss divided by M so gradients are the mean over
   the global batch), gradient sync, optimizer step.

The loss reported for a step is the mean next-token loss over the whole global batch, so every
layout reports the same number as one rank (CONTRACT: relative difference < 1e-4, fp32).

Strategy modules plug in through the small contracts of :mod:`llmlab.parallel.protocols`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from llmlab.metrics.memory import (
    SavedActivations,
    cuda_memory,
    optimizer_state_bytes,
    param_bytes,
    reset_cuda_peak,
    tensor_bytes,
)
from llmlab.metrics.profiling import StepProfiler, phase
from llmlab.metrics.schema import strict_json
from llmlab.metrics.throughput import mfu, peak_flops, training_flops_per_token
from llmlab.model.llama import LlamaForCausalLM
from llmlab.parallel.protocols import (
    ParamStateLookup,
    TrainedModule,
    TrainerOptimizer,
    load_replica_param_state,
    replica_grads,
    replica_param_state,
)
from llmlab.parallel import context_parallel, data_parallel, expert_parallel, pipeline_parallel, tp_plan, zero
from llmlab.parallel.records import model_record
from llmlab.runtime import comm
from llmlab.runtime.launch import launch, report
from llmlab.runtime.mesh import Mesh
from llmlab.runtime.process import resolve_backend
from llmlab.runtime.shared_fs import check_shared_directory
from llmlab.training.checkpoint_clock import CheckpointClock
from llmlab.training.precision import DynamicLossScaler
from llmlab.training.config import TrainConfig, model_config, resolve_device, strategy_configs, validate
from llmlab.training.data_source import make_loader
from llmlab.training.export import save_model


class LocalModule(torch.nn.Module):
    """:class:`~llmlab.parallel.protocols.TrainedModule` for one replica: no communication at all.

    Every wrapper (DDP, ZeRO) offers the same: ``forward``, ``module``, ``no_sync()`` (skip
    gradient communication for all but the last micro-batch), ``finish_grad_sync()`` (wait
    until every gradient is reduced; called once per step before the optimizer), ``grad_of(p)``
    and ``grad_tensors()`` (the gradients this rank holds).
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def no_sync(self):
        return contextlib.nullcontext()

    def finish_grad_sync(self):
        pass

    def grad_of(self, p):
        return p.grad

    def grad_tensors(self):
        return replica_grads(self.module)


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019), betas (0.9, 0.95), no weight decay."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)


class FP32Optimizer:
    """fp32 training without ZeRO: the torch ``optimizer`` itself, with the interface the trainer
    calls on every optimizer (:class:`~llmlab.parallel.protocols.TrainerOptimizer`): the gradients
    are the parameters' own (nothing to unscale) and ``apply`` is ``optimizer.step``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def unscale(self) -> None:
        pass

    def grad_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(p.grad, p) for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def apply(self) -> None:
        self.optimizer.step()

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd)

    def _pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        return [(p, p) for g in self.optimizer.param_groups for p in g["params"]]

    def param_state(self) -> dict[torch.nn.Parameter, dict[str, torch.Tensor]]:
        """Each parameter's weights and Adam state, whole, on the CPU (the checkpoint's pair)."""
        return replica_param_state(self._pairs(), self.optimizer)

    def load_param_state(self, lookup: ParamStateLookup) -> None:
        load_replica_param_state(self._pairs(), self.optimizer, lookup)


class Engine:
    """One rank's model, optimizer and step: the strategies (:class:`~llmlab.parallel.protocols.
    Strategy`) applied to the model in the one order of :meth:`_shard` and :meth:`_wrap`, each
    with its config built once here (:func:`~llmlab.training.config.strategy_configs`);
    :func:`rank_main` builds one per rank."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.model_config = model_config(cfg)
        self.strategies = strategy_configs(cfg)
        if cfg.init_from:  # a Hugging Face checkpoint's weights, sharded below like any model
            from llmlab.training.hf_init import load_pretrained

            model = load_pretrained(cfg.init_from)
        else:
            model = LlamaForCausalLM(self.model_config, seed=cfg.seed)
        # Full-model shapes, before any sharding: checkpoints store slices of these.
        self.full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        model_record(model)  # strategies append to its grad_finalizers, run after gradient sync
        self.model, local = self._shard(model)
        local.to(device)
        self.scaler: DynamicLossScaler | None = None
        if cfg.dtype == "fp16":
            self.scaler = DynamicLossScaler()
        if cfg.dtype != "fp32" and cfg.zero == 0:  # ZeRO casts its own flat buffers
            from llmlab.training.precision import cast_model

            cast_model(local, cfg.dtype)
        elif cfg.dtype != "fp32" and cfg.lora_rank is not None:  # ZeRO casts the adapters only
            from llmlab.training.precision import DTYPES

            for p in local.parameters():
                if not p.requires_grad:  # the frozen base computes in the run's dtype too
                    p.data = p.data.to(DTYPES[cfg.dtype])
        self.wrapper: TrainedModule
        self.optimizer: TrainerOptimizer
        self.wrapper, self.optimizer = self._wrap(local)
        self.pipeline = None
        if cfg.pp > 1:  # runs this rank's stages, with the wrapper's no_sync() for accumulation
            assert isinstance(local, pipeline_parallel.PipelineModule)
            self.pipeline = pipeline_parallel.build_runner(
                self.model, local, mesh, self.strategies.pp, self.wrapper
            )
        self.local = local
        self.force_overflow_at = _force_overflow(mesh.rank)
        self.consecutive_skips = 0
        self.last: dict = {}
        self.grad_bytes = 0
        self.activation_peak = 0

    def _shard(self, model: LlamaForCausalLM) -> tuple[LlamaForCausalLM, torch.nn.Module]:
        """Strategies 1-4, each ``apply(model, mesh, config)`` (unchanged at degree 1): tensor
        (+ sequence) parallelism keeps this rank's slices; context parallelism its tokens'
        positions and ring/Ulysses attention; expert parallelism its experts (recorded for the
        ``edp`` reduction); the pipeline its stages. Returns the model and what this rank runs."""
        mesh, sc = self.mesh, self.strategies
        model = tp_plan.apply(model, mesh, sc.tp)
        model = context_parallel.apply(model, mesh, sc.cp)
        model = expert_parallel.apply(model, mesh, sc.ep)
        if self.cfg.lora_rank is not None:  # adapters on the frozen base (llmlab.model.lora)
            self._add_lora(model)
        if self.cfg.activation_checkpointing:
            from llmlab.training.recompute import apply_activation_checkpointing

            apply_activation_checkpointing(model)
        local = pipeline_parallel.apply(model, mesh, sc.pp) if mesh.pp > 1 else model
        return model, local

    def _add_lora(self, model: torch.nn.Module) -> None:
        """LoRA adapters on the (tensor-parallel) model, their full shapes recorded for the
        checkpoint: :func:`llmlab.model.lora.apply_lora`, under TP
        :func:`llmlab.parallel.tp_lora.apply_lora` (each adapter split like its base layer)."""
        from llmlab.model.lora import adapter_shapes, apply_lora, parse_targets
        from llmlab.parallel import tp_lora

        cfg, targets = self.cfg, parse_targets(self.cfg.lora_target)
        assert cfg.lora_rank is not None
        if self.mesh.tp > 1:
            names = tp_lora.apply_lora(
                model, targets, cfg.lora_rank, cfg.lora_alpha, cfg.seed, self.mesh.groups["tp"]
            )
        else:
            names = apply_lora(model, targets, cfg.lora_rank, cfg.lora_alpha, cfg.seed)
        self.full_shapes |= adapter_shapes(model, names, cfg.lora_rank)

    def _wrap(self, local: torch.nn.Module) -> tuple[TrainedModule, TrainerOptimizer]:
        """Strategy 5, over the data x context-parallel ranks (:meth:`~llmlab.runtime.mesh.Mesh.
        data_parallel_view`): ZeRO (wrapper and the optimizer of its shards), else data
        parallelism (one replica: :class:`LocalModule`) with the fp32 or mixed-precision
        optimizer."""
        cfg, sc = self.cfg, self.strategies
        dp_mesh = self.mesh.data_parallel_view()
        opt_factory = functools.partial(make_optimizer, cfg=cfg)
        if sc.zero.stage > 0:
            return cast(
                tuple[TrainedModule, TrainerOptimizer],
                zero.apply(local, dp_mesh, sc.zero, opt_factory, self.scaler),
            )
        wrapper = cast(
            TrainedModule,
            data_parallel.apply(local, dp_mesh, sc.dp) if dp_mesh.dp > 1 else LocalModule(local),
        )
        trainable = [p for p in local.parameters() if p.requires_grad]  # LoRA: adapters only
        if cfg.dtype != "fp32":
            # 16-bit compute, fp32 master weights (+ loss scaling for fp16).
            from llmlab.training.precision import MixedPrecisionOptimizer

            opt: TrainerOptimizer = MixedPrecisionOptimizer(trainable, opt_factory, self.scaler)
        else:
            opt = FP32Optimizer(opt_factory(trainable))
        return wrapper, opt

    def parameters(self):
        return list(self.local.parameters())

    def loss_weights(self, micro) -> list[float]:
        """Weight of each micro-batch's mean cross-entropy so that the step's loss is the mean over
        the *global* number of labelled tokens (labels ``!= -100``), not a mean of per-micro-batch
        means: ``w_i = n_i * dp / N`` (gradient sync then averages over ``dp``; ``dp*cp`` with context
        parallelism). ``1/M`` when no label is ignored. ``N`` is summed over the data-parallel
        (and context-parallel) ranks with one small all-reduce."""
        counts = [int((y != -100).sum()) for _, y in micro]
        total = sum(counts)
        dp_mesh = self.mesh.data_parallel_view()  # dp x cp ranks: different tokens
        group = dp_mesh.groups.get("dp")
        if dp_mesh.dp > 1 and group is not None:
            t = torch.tensor([total], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, group=group)  # bookkeeping-sized: one number
            total = int(t.item())
        return [c * dp_mesh.dp / max(total, 1) for c in counts]

    def forward_backward(self, micro) -> float | None:
        """Run every micro-batch forward and backward; return this rank's share of the loss.

        The objective of micro-batch ``i`` is ``w_i * cross_entropy + aux / M``
        (:meth:`loss_weights`; MoE balancing losses are per-sequence means, weighted ``1/M``),
        multiplied by the fp16 loss scale for backward.
        """
        weights = self.loss_weights(micro)
        if self.pipeline is not None:
            return self.pipeline.run(micro, loss_weights=weights, loss_scale=self.loss_scale())
        M, total = len(micro), 0.0
        for i, (x, y) in enumerate(micro):
            ctx = self.wrapper.no_sync() if i < M - 1 else contextlib.nullcontext()
            with ctx:
                with phase("forward", mb=i):
                    loss = self.wrapper(x, y)
                    aux = self.model.aux_loss()
                    loss = (loss - aux) * weights[i] + aux / M
                with phase("backward", mb=i):
                    (loss * self.loss_scale()).backward()
            total += loss.item()
        return total

    @torch.no_grad()
    def eval_loss(self, micro) -> float:
        """This rank's share of the mean loss over the trained labels of ``micro`` (forward only;
        weighted as :meth:`loss_weights`); :func:`global_loss` makes it the job's. Not with
        pipeline parallelism (its schedule runs forward and backward together)."""
        weights = self.loss_weights(micro)
        return sum(
            float((self.wrapper(x, y) - self.model.aux_loss()) * w) for (x, y), w in zip(micro, weights)
        )

    def loss_scale(self) -> float:
        """The fp16 loss scale (1 for fp32/bf16); pipeline runners multiply their loss by it too."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def grad_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(gradient the optimizer will use, fp32 and unscaled; model parameter)`` pairs held by
        this rank, after the optimizer's ``unscale()``."""
        return self.optimizer.grad_pieces()

    def _count_skip(self, skipped: bool) -> None:
        """Book a step whose gradient was non-finite somewhere in the job (skipped, not applied).

        fp16: the loss scaler lowers its scale (the normal way fp16 finds its range); such a skip
        counts towards the limit only once the scale is already at its minimum. bf16/fp32: every
        skip counts. After ``--max-consecutive-skips`` skips in a row the run stops with a
        ``FloatingPointError`` (on every rank: the decision is the job's), as Megatron's NaN
        check and DeepSpeed's overflow limits do, instead of training on without updates.
        """
        counts = skipped
        if self.scaler is not None:
            counts = skipped and self.scaler.scale <= self.scaler.min_scale
            self.scaler.update(skipped)
        self.consecutive_skips = self.consecutive_skips + 1 if counts else 0
        limit = self.cfg.max_consecutive_skips
        if limit and self.consecutive_skips >= limit:
            raise FloatingPointError(
                f"{self.consecutive_skips} consecutive steps had a non-finite (inf/nan) gradient and "
                f"were skipped (--max-consecutive-skips {limit}); the run is diverging: lower --lr, "
                f"set --grad-clip, or use --dtype bf16/fp32"
            )

    def train_step(self, micro, step: int | None = None) -> float | None:
        """One optimizer step over the micro-batches ``micro``; ``step`` (1-based) sets the learning
        rate from the schedule. Sets ``self.last``: ``grad_norm`` (global, before clipping, loss
        scale removed; ``None`` on a skipped step), ``lr``, ``skipped`` (a non-finite gradient
        element on any rank, in any dtype: the update is not applied, :meth:`_count_skip`)."""
        from llmlab.training.grad_norm import clip_, global_grad_norm, owns
        from llmlab.training.lr_schedule import lr_at

        cfg = self.cfg
        with SavedActivations(self.parameters()) as act:
            local_loss = self.forward_backward(micro)
        self.activation_peak = max(self.activation_peak, act.peak)
        with phase("grad sync"):
            self.wrapper.finish_grad_sync()
        for f in model_record(self.model).grad_finalizers:
            f(self.wrapper.grad_of)  # ZeRO: the part of p in this rank's shard
        self.grad_bytes = max(self.grad_bytes, tensor_bytes(self.wrapper.grad_tensors()))
        self.optimizer.unscale()
        pieces = self.grad_pieces()
        if step is not None and step == self.force_overflow_at and pieces:
            pieces[0][0].view(-1)[0] = float("inf")  # LLMLAB_FORCE_OVERFLOW: a test's fault
        sharded = cfg.zero > 0
        norm, finite = global_grad_norm([(g, owns(p, self.mesh, sharded)) for g, p in pieces], self.device)
        skipped = not finite  # decided once for the job, in every dtype
        self._count_skip(skipped)
        lr = lr_at(step or 1, cfg.lr, cfg.steps, cfg.lr_schedule, cfg.warmup_steps, cfg.min_lr)
        if not skipped:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            with phase("optimizer"):
                if cfg.grad_clip:
                    clip_([g for g, _ in pieces], cfg.grad_clip, norm)
                self.optimizer.apply()
        self.optimizer.zero_grad(set_to_none=True)
        self.last = {"grad_norm": None if skipped else norm, "lr": lr, "skipped": skipped}
        return local_loss


def global_loss(local_loss: float | None, mesh: Mesh, device) -> float:
    """The global-batch loss, from the ranks that hold it (last stage, tp rank 0), on all ranks.

    Bookkeeping for the report only: it goes straight to ``torch.distributed`` so it is not
    counted in the strategies' communication bytes.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if local_loss is None:
            raise ValueError("global_loss: a single rank holds the loss, but it is None")
        return float(local_loss)
    holds = mesh.is_last_stage and mesh.coords["tp"] == 0
    t = torch.tensor(
        [float(local_loss) if holds and local_loss is not None else 0.0], dtype=torch.float64, device=device
    )
    dist.all_reduce(t)
    return t.item() / (mesh.dp * mesh.cp)  # cp ranks: equal token counts, so the mean of means


def _fault_injection(rank: int) -> int | None:
    """``LLMLAB_KILL_RANK_AT_STEP="R:S"`` kills rank R (SIGKILL) when it reaches step S: the
    fault-tolerance lab and tests use it to show a crashed rank stopping the job, named, and
    ``--resume`` continuing from the last good checkpoint."""
    spec = os.environ.get("LLMLAB_KILL_RANK_AT_STEP")
    if not spec:
        return None
    r, s = (int(v) for v in spec.split(":"))
    return s if r == rank else None


def _force_overflow(rank: int) -> int | None:
    """``LLMLAB_FORCE_OVERFLOW="R:S"`` writes an inf into one gradient element on rank R at step S
    (after gradient sync): the tests use it to show that every rank skips that step (any dtype)."""
    spec = os.environ.get("LLMLAB_FORCE_OVERFLOW")
    if not spec:
        return None
    r, s = (int(v) for v in spec.split(":"))
    return s if r == rank else None


def _evaluate(engine: Engine, loader, cfg: TrainConfig, step: int) -> dict:
    """``{"eval_loss": held-out loss}`` on ``--eval-every`` steps and the last, else ``{}``."""
    if not cfg.eval_every or (step % cfg.eval_every and step != cfg.steps):
        return {}
    micro = _eval_micro(loader, cfg, engine.mesh, engine.device)
    return {"eval_loss": global_loss(engine.eval_loss(micro), engine.mesh, engine.device)}


def _eval_micro(loader, cfg: TrainConfig, mesh: Mesh, device) -> list:
    """This rank's micro-batches of the held-out examples (``--data``), as a training step's."""
    x, y = loader.eval_batch(mesh.dp * cfg.num_microbatches)
    n = x.shape[0] // mesh.dp
    r = mesh.coords["dp"]
    x, y = x[r * n : (r + 1) * n].to(device), y[r * n : (r + 1) * n].to(device)
    micro = list(zip(x.chunk(cfg.num_microbatches), y.chunk(cfg.num_microbatches)))
    if cfg.cp > 1:
        from llmlab.parallel.context_parallel import shard_microbatches

        micro = shard_microbatches(micro, mesh, cfg.cp_mode)
    return micro


def _profile_range(cfg: TrainConfig) -> tuple[int, int] | None:
    """``--profile-steps A:B`` as ``(A, B)``; ``None`` when not profiling."""
    if not cfg.profile_steps:
        return None
    from llmlab.metrics.profiling import parse_steps

    return parse_steps(cfg.profile_steps, 1, cfg.steps)


def _microbatches(loader: Any, step: int, mesh: Mesh, cfg: TrainConfig, device: torch.device) -> list:
    """This rank's ``[(x, y), ...]`` micro-batches of ``step`` on ``device`` (its data-parallel
    share; under context parallelism its tokens of the same sequences)."""
    micro = [
        (x.to(device), y.to(device))
        for x, y in loader.microbatches(step, mesh.coords["dp"], mesh.dp, cfg.num_microbatches)
    ]
    if cfg.cp > 1:
        from llmlab.parallel.context_parallel import shard_microbatches

        micro = shard_microbatches(micro, mesh, cfg.cp_mode)
    return micro


def _rank_result(engine: Engine, mesh: Mesh, steps: list, device: torch.device) -> dict:
    """The rank's part of the metrics JSON: coordinates, memory by kind (bytes), bytes moved by
    each collective, the step records (rank 0), the pipeline's schedule statistics."""
    out: dict[str, Any] = {
        "rank": mesh.rank,
        "coords": dict(mesh.coords),
        "memory_bytes": {
            "params": param_bytes(engine.parameters()),
            "grads": engine.grad_bytes,
            "optimizer_states": optimizer_state_bytes(engine.optimizer),
            "activations_peak": engine.activation_peak,
        },
        "comm_bytes": comm.COUNTER.snapshot(),
        "steps": steps if mesh.rank == 0 else None,
    }
    if device.type == "cuda":  # the caching allocator's view, beside the exact tensor accounting
        out["memory_bytes"]["cuda"] = cuda_memory(device)
    if engine.pipeline is not None:
        out["pipeline"] = engine.pipeline.stats()
    return out


def rank_main(cfg: TrainConfig) -> dict:
    """One rank of ``llmlab train``; returns its part of the metrics JSON."""
    device_type = resolve_device(cfg)
    device = (
        torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    )
    torch.manual_seed(cfg.seed)
    mesh = Mesh.build(dp=cfg.dp, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, cp=cfg.cp)
    engine = Engine(cfg, mesh, device)
    loader = make_loader(cfg)
    mc = engine.model_config
    fpt = training_flops_per_token(mc.num_parameters(), mc.num_hidden_layers, mc.hidden_size, cfg.seq_len)
    peak = peak_flops(device, cfg.dtype) if device.type == "cuda" else None  # the run's dtype
    reset_cuda_peak(device)  # peaks of an earlier run in this process must not leak into ours
    first, meta = 1, None
    if cfg.checkpoint_dir:  # every rank writes into it: it must be one directory for all nodes
        check_shared_directory(cfg.checkpoint_dir)
    if cfg.resume:
        from llmlab.training.checkpoint import load_checkpoint

        meta = load_checkpoint(engine, cfg.require_checkpoint_dir())
        if meta is not None:
            first = meta["next_data_step"]
    clock = CheckpointClock(
        cfg.checkpoint_dir, cfg.checkpoint_every, cfg.checkpoint_every_minutes, cfg.steps, meta, device
    )  # when to save: steps, minutes, the last
    comm.COUNTER.reset()
    steps = []
    kill_at = _fault_injection(mesh.rank)
    prof = StepProfiler(cfg.profile_dir, mesh.rank, _profile_range(cfg), first)
    for step in range(first, cfg.steps + 1):
        if step == kill_at:  # a simulated hardware fault: this rank dies without a word
            os.kill(os.getpid(), signal.SIGKILL)
        micro = _microbatches(loader, step, mesh, cfg, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with phase("step", step=step):
            local_loss = engine.train_step(micro, step)
            if device.type == "cuda":
                torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        prof.step()
        loss = global_loss(local_loss, mesh, device)
        tps = cfg.global_batch_size * cfg.seq_len / dt
        rec = {"step": step, "loss": loss, "step_time_s": dt, "tokens_per_s": tps} | engine.last
        if mc.num_experts:  # routing statistics of this step, summed over dp and pp (collective)
            from llmlab.model.moe import collect_moe_stats

            dp_group, pp_group = mesh.groups.get("dp"), mesh.groups.get("pp")
            rec.update(collect_moe_stats(engine.model, dp_group, pp_group, num_layers=mc.num_hidden_layers))
        u = mfu(tps / max(1, dist.get_world_size() if dist.is_initialized() else 1), fpt, peak)
        if u is not None:
            rec["mfu"] = u
        rec |= _evaluate(engine, loader, cfg, step)
        steps.append(rec)
        if mesh.rank == 0:
            report(rec)
        if clock.due(step):
            from llmlab.training.checkpoint import save_checkpoint

            save_checkpoint(engine, step, loss, cfg.require_checkpoint_dir(), extra=clock.record(rec))
    prof.close()
    out = _rank_result(engine, mesh, steps, device)
    if cfg.save_model:  # collective: gathered from every layout's shards (training/export.py)
        save_model(engine, cfg.save_model)
    return out


def train(cfg: TrainConfig, progress: bool = True, on_step=None) -> dict:
    """Validate, launch the ranks, train, and return the CONTRACT metrics dict.

    ``on_step(record)`` is called in the caller for every step as it finishes (live plots).
    Writes ``cfg.metrics_json`` and the TensorBoard scalars of ``cfg.tensorboard`` when set, and
    one profiler trace per rank into ``cfg.profile_dir`` (steps ``cfg.profile_steps``). Raises ``ValueError``/``NotImplementedError`` before
    any rank starts for a bad configuration, and :class:`~llmlab.runtime.launch.RankError` if a
    rank fails.
    """
    validate(cfg)
    if cfg.resume:  # schedule flags against the checkpoint's, before any rank starts
        from llmlab.training.checkpoint import check_resume_flags, latest_checkpoint

        found = latest_checkpoint(cfg.require_checkpoint_dir(), log=lambda m: None)
        if found is not None:
            check_resume_flags(cfg, found[1], found[0])
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, desc=f"train {cfg.model} x{cfg.world_size}", unit="step")

    def on_metric(rank, rec):
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        if on_step is not None:
            on_step(rec)

    try:
        results = launch(
            rank_main,
            cfg.world_size,
            cfg,
            on_metric=on_metric,
            backend=resolve_backend("auto", None, device=resolve_device(cfg)),
        )
    finally:
        if bar is not None:
            bar.close()
    metrics = assemble_metrics(cfg, results)
    if cfg.metrics_json and os.environ.get("RANK", "0") == "0":  # under torchrun: rank 0 writes
        write_metrics(metrics, cfg.metrics_json)
    if cfg.tensorboard and os.environ.get("RANK", "0") == "0":
        from llmlab.metrics.tensorboard import write_train_metrics

        write_train_metrics(metrics, cfg.tensorboard)
    return metrics


def write_metrics(metrics: dict, path: str | Path) -> None:
    """Write the metrics as strict JSON (format: llmlab/metrics/train_metrics.schema.json; no
    bare ``NaN``/``Infinity``: :func:`assemble_metrics` has made them ``null``). Raises
    ``ValueError`` for a non-finite float left in ``metrics``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(metrics, indent=1, allow_nan=False))


def assemble_metrics(cfg: TrainConfig, results: list[dict]) -> dict:
    """The CONTRACT metrics dict from the ranks' results; non-finite numbers become ``null`` with
    a ``nonfinite`` flag beside them (:func:`llmlab.metrics.schema.strict_json`)."""
    metrics = {
        "config": cfg.to_dict(),
        "steps": results[0]["steps"],
        "ranks": [{k: r[k] for k in ("rank", "coords", "memory_bytes", "comm_bytes")} for r in results],
    }
    pipes = [r["pipeline"] for r in results if r.get("pipeline")]
    if pipes:
        metrics["pipeline"] = {
            "schedule": cfg.pp_schedule,
            "bubble_fraction_measured": sum(p["bubble_fraction_measured"] for p in pipes) / len(pipes),
            "bubble_fraction_theory": pipes[0]["bubble_fraction_theory"],
        } | {
            k: v
            for k, v in pipes[0].items()
            if k not in ("bubble_fraction_measured", "bubble_fraction_theory")
        }
        metrics["pipeline"]["per_rank"] = pipes
    return strict_json(metrics)
