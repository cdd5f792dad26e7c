"""Pipeline parallelism: model chunks on ranks, micro-batches, and one runner for every schedule.

The model's decoder layers are cut into ``p*v`` equal *virtual stages* (``p`` = ``--pp``, ``v`` =
``--virtual-stages``, 1 except for the interleaved schedule). Rank ``r`` holds chunks
``c = 0..v-1``, i.e. virtual stages ``s = c*p + r``; stage 0 also holds the embedding, the last
stage the final norm, ``lm_head`` and the loss (Megatron-LM SC'21, Narayanan et al. 2021, §2.2).

:class:`PipelineRunner` executes the action list that
:func:`~llmlab.parallel.pipeline_schedules.build_schedule` produced for this rank (GPipe, 1F1B or
interleaved 1F1B): forwards, backwards, and activations / activation-gradients sent point to point
(:mod:`llmlab.runtime.comm`, bytes counted). Every message has the same shape, known in advance
(``[micro_batch, seq_len, hidden]``), so no shape handshake is needed; each carries a tag made of
(kind, receiving virtual stage, micro-batch), so a receive can only match its own send.
Consecutive p2p actions are posted as one ``batch_isend_irecv``; the schedule places them in
synchronous rounds, so :func:`~llmlab.parallel.pipeline_schedules.simulate` proves for each
schedule that no wait is circular even when sends block (NCCL, large messages).

Per step the runner records a timeline (forward, backward, send, recv per rank, in seconds from
the start of the flush; on a GPU each timestamp is taken after ``torch.cuda.synchronize``, so a
bar is the work, not its launch) and the measured bubble: ``1 - (forward+backward time) / flush time``,
where the flush time runs from a barrier of the pipeline group to the end of the slowest rank.

Each micro-batch's loss is divided by ``M`` (as in the trainer without pipelining), so the last
stage's returned loss, the sum over micro-batches, equals the one-rank loss of the global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from llmlab.metrics.timing import device_clock
from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM
from llmlab.parallel.configs import PipelineConfig
from llmlab.parallel.pipeline_schedules import (
    B,
    COMM,
    F,
    RECV_ACT,
    SEND_ACT,
    SEND_GRAD,
    Action,
    bubble_fraction_theory,
    build_schedule,
    check_schedule_args,
    message_key,
)
from llmlab.parallel.protocols import TrainedModule
from llmlab.runtime import comm
from llmlab.metrics.profiling import phase
from llmlab.runtime.mesh import Mesh
from llmlab.runtime.comm import Group
from typing import Any


def validate(config: PipelineConfig, mesh: Mesh, model_config: ModelConfig) -> None:
    """Refuse, before any rank starts, what the pipeline of ``mesh.pp`` stages cannot run.
    Raises ``ValueError``:

    * ``virtual_stages > 1`` without ``--pp > 1 --pp-schedule interleaved``;
    * layers not divisible by ``pp * virtual_stages``;
    * interleaved with ``num_microbatches`` not a multiple of ``pp``, or ``virtual_stages < 2``;
    * tied input/output embeddings across stages (``tie_word_embeddings``).
    """
    pp, v = mesh.pp, config.virtual_stages
    if pp == 1:
        if v != 1:
            raise ValueError(f"--virtual-stages {v} needs --pp > 1 and --pp-schedule interleaved")
        return
    check_schedule_args(config.schedule, pp, config.num_microbatches, v)
    L, S = model_config.num_hidden_layers, pp * config.num_chunks
    if L % S:
        what = f"pp*virtual_stages = {pp}*{v} = {S}" if S != pp else f"pp={pp}"
        raise ValueError(
            f"{what} must divide num_hidden_layers={L} (each pipeline stage gets the same number of layers)"
        )
    if model_config.tie_word_embeddings:
        raise ValueError(
            "tie_word_embeddings is not supported with --pp > 1 (the embedding is "
            "on the first stage and lm_head on the last; untie them)"
        )


class StageChunk(nn.Module):
    """One virtual stage: ``forward(x)`` with ``x`` the token ids ``[B,T]`` (stage 0) or the
    hidden state ``[B,T,h]``; returns the hidden state ``[B,T,h]`` or, on the last stage, the
    logits ``[B,T,vocab]``. Uses the (possibly tensor-parallel) model's ``embed``,
    ``run_layers`` and ``head`` without registering the rest of the model as a submodule."""

    def __init__(
        self, model: LlamaForCausalLM, stage: int, num_stages: int, layers: list[Any], seq_len: int | None
    ) -> None:
        super().__init__()
        self.stage, self.num_stages, self.seq_len = stage, num_stages, seq_len
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        if self.is_first:
            self.embed_tokens = model.model.embed_tokens
        self.layers = nn.ModuleList(layers)
        if self.is_last:
            self.norm, self.lm_head = model.model.norm, model.lm_head
        object.__setattr__(self, "_model", model)  # not a submodule: its params are not ours

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m: LlamaForCausalLM = self.__dict__["_model"]
        h = m.embed(x) if self.is_first else x
        h = m.run_layers(h, layers=self.layers, seq_len=self.seq_len)
        out: torch.Tensor = m.head(h) if self.is_last else h
        return out

    def aux_loss(self) -> Any:
        """Auxiliary (MoE load-balancing) losses of this chunk's layers from the last forward."""
        total = 0.0
        for layer in self.layers:
            a = getattr(layer.mlp, "aux_loss", None)
            if a is not None:
                total = total + a
        return total


class PipelineModule(nn.Module):
    """What a rank holds: ``chunks[c]`` is virtual stage ``c*p + r``. Not called directly."""

    def __init__(self, chunks: list[StageChunk]) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)


def split_model(
    model: LlamaForCausalLM, p: int, r: int, v: int = 1, seq_len: int | None = None
) -> "PipelineModule":
    """Cut ``model`` into ``p*v`` stages and return this rank's chunks (a :class:`PipelineModule`).

    The model is stripped of what other ranks hold (their layers, and the embedding / norm /
    lm_head where this rank does not need them) so only this rank's parameters stay in memory.
    """
    L, S = model.config.num_hidden_layers, p * v
    if L % S:
        raise ValueError(f"pp*virtual_stages = {S} must divide num_hidden_layers={L}")
    per = L // S
    layers = list(model.model.layers)
    chunks = [
        StageChunk(model, c * p + r, S, layers[(c * p + r) * per : (c * p + r + 1) * per], seq_len)
        for c in range(v)
    ]
    held = [l for ch in chunks for l in ch.layers]
    model.model.layers = nn.ModuleList(held)
    if not any(ch.is_first for ch in chunks):
        model.model.embed_tokens = None  # type: ignore[assignment]
    if not any(ch.is_last for ch in chunks):
        model.model.norm, model.lm_head = None, None  # type: ignore[assignment]
    return PipelineModule(chunks)


@dataclasses.dataclass
class _Flush:
    """What one flush keeps between its actions: tensors by ``(chunk, micro-batch)`` (inputs
    received, outputs kept for backward, gradients received or to send, activations to send), the
    sends not yet waited for, the timeline events and the running losses."""

    microbatches: list[Any]
    weights: list[Any]
    loss_scale: float
    last_b: int  # index of the flush's last backward action
    dtype: torch.dtype
    inputs: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    outputs: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    grads: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    to_send: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    pending_sends: list[Any] = dataclasses.field(default_factory=list)
    events: list[Any] = dataclasses.field(default_factory=list)
    loss_total: float = 0.0
    aux_total: float = 0.0
    inflight: int = 0
    t_start: float = 0.0

    def __post_init__(self) -> None:
        self.m = len(self.microbatches)
        self.device = self.microbatches[0][0].device
        self.now = device_clock(self.device)  # on a GPU: after the queued work is done, not when queued


class PipelineRunner:
    """Runs one pipeline flush per step on this rank (see the module docstring).

    ``module``: this rank's :class:`PipelineModule`; ``run(microbatches)`` takes the list of
    ``(input_ids [b,T], labels [b,T])`` of the step (every rank passes the same list; only the
    first stage reads the ids and the last the labels) and returns the loss (sum over
    micro-batches of loss/M, a float) on the last stage, ``None`` elsewhere. ``stats()`` returns
    the CONTRACT ``pipeline`` fields of this rank plus the per-step timelines.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        module: PipelineModule,
        stage_ranks: list[int],
        rank: int,
        group: Group,
        schedule: str,
        hidden_shape_fn: Any,
        wrapper: TrainedModule | None = None,
    ) -> None:
        self.model, self.module = model, module
        self.stage_ranks, self.group = stage_ranks, group
        self.p, self.r = len(stage_ranks), stage_ranks.index(rank)
        self.v = len(module.chunks)
        self.schedule_name = schedule
        self.hidden_shape_fn = hidden_shape_fn
        # the data-parallel wrapper of ``module``: its no_sync() for every backward but the last
        self.wrapper = wrapper
        self.has_aux = bool(getattr(model.config, "num_experts", 0))
        self._schedules: dict[int, list[Action]] = {}
        self.timelines: list[dict[str, Any]] = []
        self.bubbles: list[float] = []
        self.peak_inflight = 0
        self.num_microbatches: int | None = None

    def actions(self, m: int) -> list[Action]:
        if m not in self._schedules:
            self._schedules[m] = build_schedule(self.schedule_name, self.p, m, self.v)[self.r]
        return self._schedules[m]

    def _tag(self, a: Action, m: int) -> int:
        kind, s, mb = message_key(a, self.r, self.p)
        return ((0 if kind == "act" else 1) * self.p * self.v + s) * m + mb

    # --- one flush: its phases are the action kinds of the schedule ------------------------------
    def run(
        self,
        microbatches: list[tuple[torch.Tensor, torch.Tensor]],
        loss_weights: list[float] | None = None,
        loss_scale: float = 1.0,
    ) -> float | None:
        """One flush. ``loss_weights[i]`` multiplies micro-batch ``i``'s cross-entropy (default
        ``1/M``; the trainer passes its labelled-token weights); the scalars that start backward
        (loss on the last stage, MoE auxiliary losses everywhere) are multiplied by ``loss_scale``
        (the fp16 loss scale), so every stage's gradients carry it, as without pipelining.

        The schedule's actions run in order: a run of consecutive p2p actions as one
        communication batch (:meth:`_communicate`), then each :meth:`_forward` or
        :meth:`_backward`; the warm-up, steady state and cool-down of 1F1B are simply where the
        schedule puts them. :meth:`_finish` waits for the last sends and records the timeline."""
        m = len(microbatches)
        acts = self.actions(m)
        self.num_microbatches = m
        f = _Flush(
            microbatches,
            loss_weights or [1.0 / m] * m,
            loss_scale,
            last_b=max(i for i, a in enumerate(acts) if a.op == B),
            dtype=next(self.module.parameters()).dtype,
        )
        dist.barrier(group=self.group)  # bookkeeping: a common start for the flush
        f.t_start = f.now()
        i = 0
        while i < len(acts):
            a = acts[i]
            if a.op in COMM:  # post consecutive p2p actions as one batch
                j = i
                while j < len(acts) and acts[j].op in COMM:
                    j += 1
                with phase("pp p2p", actions=",".join(map(str, acts[i:j]))):
                    self._communicate(f, acts[i:j])
                i = j
                continue
            t0 = f.now()
            with phase("forward" if a.op == F else "backward", action=a, chunk=a.chunk, mb=a.mb):
                if a.op == F:
                    self._forward(f, a)
                else:
                    self._backward(f, a, is_last_backward=i == f.last_b)
            f.events.append([a.op, a.chunk, a.mb, t0 - f.t_start, f.now() - f.t_start])
            i += 1
        return self._finish(f)

    def _communicate(self, f: "_Flush", batch: list[Action]) -> None:
        """Post ``batch`` (consecutive sends/receives) as one ``batch_isend_irecv``; wait for it
        when it receives (the received tensors are read next), else let the sends run on."""
        t0 = f.now()
        ops, recvs = [], []
        for b in batch:
            assert b.peer is not None  # a p2p action names its peer
            peer = self.stage_ranks[b.peer]
            tag = self._tag(b, f.m)
            if b.op == SEND_ACT:
                t = f.to_send.pop((b.chunk, b.mb)).contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer, self.group, tag))
            elif b.op == SEND_GRAD:
                t = f.grads.pop((b.chunk, b.mb)).contiguous()
                ops.append(dist.P2POp(dist.isend, t, peer, self.group, tag))
            else:
                t = torch.empty(self.hidden_shape_fn(f.microbatches[b.mb][0]), dtype=f.dtype, device=f.device)
                ops.append(dist.P2POp(dist.irecv, t, peer, self.group, tag))
                recvs.append((b, t))
        works = comm.batch_isend_irecv(ops)
        t1 = f.now()
        sends = [b for b in batch if b.op in (SEND_ACT, SEND_GRAD)]
        if sends:  # "send": posting the batch
            f.events.append(["send", sends[0].chunk, sends[0].mb, t0 - f.t_start, t1 - f.t_start])
        if recvs:  # NCCL returns ONE handle for the whole batch (gloo one per op):
            for w in works:  # wait on all of them before any received tensor is read
                w.wait()
            f.events.append(
                ["recv", recvs[0][0].chunk, recvs[0][0].mb, t1 - f.t_start, f.now() - f.t_start]
            )  # "recv": waiting for the batch
        else:  # sends only: go on computing; the tensors live until the end-of-flush wait
            f.pending_sends.append((works, [op.tensor for op in ops]))
        for b, t in recvs:
            if b.op == RECV_ACT:
                f.inputs[(b.chunk, b.mb)] = t.requires_grad_()
            else:
                f.grads[(b.chunk, b.mb)] = t

    def _forward(self, f: "_Flush", a: Action) -> None:
        """Chunk ``a.chunk`` on micro-batch ``a.mb``; the last stage adds its weighted loss."""
        chunk: StageChunk = self.module.chunks[a.chunk]  # type: ignore[assignment]
        key = (a.chunk, a.mb)
        x = f.microbatches[a.mb][0] if chunk.is_first else f.inputs[key]
        out = chunk(x)
        aux = chunk.aux_loss() if self.has_aux else 0.0
        if chunk.is_last:
            loss = self.model.compute_loss(out, f.microbatches[a.mb][1]) * f.weights[a.mb]
            f.loss_total += loss.item()
            out = loss * f.loss_scale
        else:
            f.to_send[key] = out.detach()
        if torch.is_tensor(aux):
            f.aux_total += float(aux.detach()) / f.m
            out = (out, aux * (f.loss_scale / f.m))
        f.outputs[key] = out
        f.inflight += 1
        self.peak_inflight = max(self.peak_inflight, f.inflight)

    def _backward(self, f: "_Flush", a: Action, is_last_backward: bool) -> None:
        """Backward of chunk ``a.chunk`` on micro-batch ``a.mb`` from the received output gradient;
        the data-parallel gradient sync runs on the flush's last backward only."""
        chunk, key = self.module.chunks[a.chunk], (a.chunk, a.mb)
        out = f.outputs.pop(key)
        tensors, grad_tensors = (list(out), None) if isinstance(out, tuple) else ([out], None)
        if not chunk.is_last:
            grad_tensors = [f.grads.pop(key)] + [None] * (len(tensors) - 1)
        ctx = (
            self.wrapper.no_sync()
            if self.wrapper is not None and not is_last_backward
            else contextlib.nullcontext()
        )
        with ctx:
            torch.autograd.backward(tensors, grad_tensors)
        if not chunk.is_first:
            f.grads[key] = f.inputs.pop(key).grad
        f.inflight -= 1

    def _finish(self, f: "_Flush") -> float | None:
        """Wait for the sends still in flight, record the timeline and bubble, add every stage's
        auxiliary loss; the loss on the last rank, ``None`` elsewhere."""
        t0 = f.now()
        with phase("pp wait sends"):
            for works, _ in f.pending_sends:
                for w in works:
                    w.wait()
        if f.pending_sends:
            f.events.append(["send", 0, -1, t0 - f.t_start, f.now() - f.t_start])
        self._record(f.events, f.now() - f.t_start, f.device)
        if self.has_aux:  # bookkeeping: every stage's aux loss into the reported loss
            t = torch.tensor([f.aux_total], dtype=torch.float64, device=f.device)
            dist.all_reduce(t, group=self.group)
            f.loss_total += t.item()
        if self.r == self.p - 1:  # the last virtual stage is on the last rank
            return f.loss_total
        return None

    def _record(self, events: list[Any], local_end: float, device: Any) -> None:
        """Flush time = slowest rank's end (an all-reduce MAX on the pipeline group)."""
        t = torch.tensor([local_end], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)  # bookkeeping, not counted
        span = t.item()
        busy = sum(e[4] - e[3] for e in events if e[0] in (F, B))
        self.timelines.append({"span_s": span, "events": events})
        self.bubbles.append(1.0 - busy / span if span > 0 else 0.0)

    def stats(self) -> dict[str, Any]:
        """This rank's CONTRACT ``pipeline`` fields plus details: ``bubble_fraction_measured``
        (mean over steps after the first, which includes connection set-up), per-step values,
        ``timeline`` (per step: ``span_s`` and events ``[op, chunk, mb, t0_s, t1_s]``, op in
        F, B, send, recv), ``peak_inflight_microbatches`` (chunk-forwards held at once)."""
        steady = self.bubbles[1:] or self.bubbles
        m = self.num_microbatches or 1
        return {
            "schedule": self.schedule_name,
            "stage": self.r,
            "num_stages": self.p,
            "virtual_stages": self.v,
            "num_microbatches": m,
            "bubble_fraction_measured": sum(steady) / len(steady) if steady else 0.0,
            "bubble_fraction_theory": bubble_fraction_theory(self.schedule_name, self.p, m, self.v),
            "bubble_fraction_per_step": list(self.bubbles),
            "peak_inflight_microbatches": self.peak_inflight,
            "timeline": self.timelines,
        }


def apply(model: LlamaForCausalLM, mesh: Mesh, config: PipelineConfig) -> PipelineModule:
    """Keep this rank's stages of ``model`` (the full seeded
    :class:`~llmlab.model.llama.LlamaForCausalLM`, possibly tensor-parallel already): the
    :class:`PipelineModule` of its ``config.num_chunks`` chunks, which data parallelism then
    wraps; :func:`build_runner` runs them. Raises ``ValueError`` if the layout is invalid
    (:func:`validate`)."""
    validate(config, mesh, model.config)
    sp = config.sequence_parallel and mesh.tp > 1
    return split_model(
        model, mesh.pp, mesh.coords["pp"], config.num_chunks, seq_len=config.seq_len if sp else None
    )


def build_runner(
    model: LlamaForCausalLM,
    stages: PipelineModule,
    mesh: Mesh,
    config: PipelineConfig,
    wrapper: TrainedModule | None = None,
) -> PipelineRunner:
    """The runner of this rank's ``stages`` (from :func:`apply`) over ``mesh.groups["pp"]``;
    ``wrapper``: the data-parallel wrapper of ``stages`` (``None``: one replica), whose
    ``no_sync()`` it uses for every backward but the flush's last."""
    sp = config.sequence_parallel and mesh.tp > 1
    tp, h = mesh.tp, model.config.hidden_size

    def hidden_shape(ids: torch.Tensor) -> tuple[int, int, int]:
        b, T = ids.shape
        return (b, T // tp if sp else T, h)

    return PipelineRunner(
        model, stages, mesh.ranks["pp"], mesh.rank, mesh.groups["pp"], config.schedule, hidden_shape, wrapper
    )


def build_pipeline(
    model: LlamaForCausalLM, mesh: Mesh, config: PipelineConfig, wrapper: TrainedModule | None = None
) -> PipelineRunner:
    """:func:`apply` then :func:`build_runner`: the runner of this rank's stages of ``model``
    (``mesh.pp > 1``; ``config.seq_len``: this rank's tokens per sequence). Its ``module`` is
    the stages. Raises ``ValueError`` if the layout is invalid (:func:`validate`)."""
    return build_runner(model, apply(model, mesh, config), mesh, config, wrapper)
