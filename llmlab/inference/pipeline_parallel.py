"""Pipeline-parallel inference: the layers split into ``pp`` stages, each stage tensor-parallel over
``tp`` ranks; activations passed stage to stage; up to ``pp`` steps in flight.

Ranks: ``pp * tp`` workers, rank ``r`` in stage ``r // tp`` at tensor-parallel rank ``r % tp``
(vLLM's layout: the ``tp`` ranks of a stage are neighbours, so they go on one node). Stage ``s``
holds layers ``[s * L/pp, (s+1) * L/pp)`` (:func:`split_layers`; ``pp`` must divide the layers)
and the KV cache of those layers only; the first stage also holds the embedding, the last the final
norm and the output head. Inside a stage the layers are training's tensor-parallel layers
(:func:`llmlab.inference.tensor_parallel.shard_model` over the stage's group).

The engine (scheduler, block manager, sampling) runs in the calling process, which is no rank: each
step it sends every worker the step's plan (:func:`step_message`: each scheduled sequence's new
token ids, position, block table, and the step's block copies and swaps); the first stage embeds
the tokens, each stage runs its layers and sends the hidden states ``[1, N, hidden]`` to the same
tensor-parallel rank of the next stage (``torch.distributed`` point to point: gloo on CPU, NCCL on
GPUs), and the last stage's rank 0 sends the logits of the sampled rows back. The channel between
the engine and the workers is an executor's: local processes with a pipe each
(:class:`ProcessWorkers`, ``distributed_executor_backend="mp"``) or Ray actors
(:mod:`llmlab.inference.executor_ray`).

Keeping the stages busy (vLLM's virtual engines, GPipe's micro-batches at inference): the engine
submits a step and, while it runs through the stages, schedules and submits the next one over the
sequences not in flight (:meth:`~llmlab.inference.scheduler.Scheduler.schedule` with
``in_flight``), up to ``pp`` steps; a step's tokens are sampled when its logits come back. Greedy
tokens equal the one-process engine's (the same maths, only the tensor-parallel sums' order differs).

Source: Huang et al. 2019 (GPipe) for the stage split; vLLM's ``pipeline_parallel_size`` and
virtual engines (``--pipeline-parallel-size``, ``PPMissingLayer``) for inference.
"""

from __future__ import annotations

import atexit
import collections
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from llmlab.inference.attention_context import AttentionBatch, PagedAttentionContext
from llmlab.inference.errors import EngineDeadError
from llmlab.inference.model_runner import ModelRunner
from llmlab.inference.scheduler import SchedulerOutput
from llmlab.model.context import forward_context
from llmlab.model.llama import LlamaForCausalLM
from llmlab.runtime import process


def split_layers(num_layers: int, pp: int) -> list[range]:
    """The layers of each of ``pp`` stages, ``num_layers / pp`` each, in order. Raises
    ``ValueError`` when ``pp`` is < 1 or does not divide ``num_layers``."""
    if pp < 1:
        raise ValueError(f"pipeline_parallel_size={pp} must be >= 1")
    if num_layers % pp:
        raise ValueError(
            f"pipeline_parallel_size={pp} must divide the model's num_hidden_layers="
            f"{num_layers} (each stage holds the same number of layers)"
        )
    n = num_layers // pp
    return [range(s * n, (s + 1) * n) for s in range(pp)]


def validate(config: Any, tp: int, pp: int, quantization: str | None = None) -> None:
    """Raise ``ValueError`` naming the constraint when ``tp`` x ``pp`` ranks cannot hold ``config``
    (``pp`` divides the layers; ``tp`` as :func:`llmlab.inference.tensor_parallel.validate`)."""
    from llmlab.inference import tensor_parallel

    split_layers(config.num_hidden_layers, pp)
    tensor_parallel.validate(config, tp, quantization)
    if quantization is not None:
        raise ValueError("quantization with pipeline_parallel_size > 1 or the ray backend is not supported")
    if config.num_experts:
        raise ValueError("pipeline-parallel inference of a mixture-of-experts model is not supported")


# --- the driver's side: the step as plain data ----------------------------------------------------
def step_message(out: SchedulerOutput, ops: dict[str, list[list[int]]]) -> dict[str, Any]:
    """The step every worker is sent: per scheduled sequence ``[seq_id, computed, n, num_tokens,
    new token ids, block table]``, and the block ``copies``, ``swap_out``, ``swap_in`` to apply first."""
    seqs = [
        [
            s.seq_id,
            s.num_computed_tokens,
            n,
            s.num_tokens,
            s.token_ids[s.num_computed_tokens : s.num_computed_tokens + n],
            list(s.block_table),
        ]
        for s, n in out.scheduled
    ]
    return {
        "seqs": seqs,
        "copies": ops.get("copies", []),
        "swap_out": ops.get("swap_out", []),
        "swap_in": ops.get("swap_in", []),
    }


class _Tokens:
    """A sequence's token ids known from position ``start`` on (``ids[c:c+n]`` works for ``c >= start``)."""

    def __init__(self, start: int, ids: list[int]) -> None:
        self.start, self.ids = start, ids

    def __getitem__(self, s: slice) -> list[int]:
        return self.ids[s.start - self.start : s.stop - self.start]


@dataclass
class _SeqView:
    """What the model runner reads of a scheduled sequence, rebuilt on a worker."""

    seq_id: int
    num_computed_tokens: int
    num_tokens: int
    token_ids: _Tokens
    block_table: list[int]


def scheduled_of(msg: dict[str, Any]) -> SchedulerOutput:
    """The worker's :class:`SchedulerOutput` of a :func:`step_message` (views, not sequences)."""
    scheduled: list[Any] = [
        (_SeqView(i, c, t, _Tokens(c, ids), table), n) for i, c, n, t, ids, table in msg["seqs"]
    ]
    return SchedulerOutput(scheduled=scheduled)


# --- a worker: one stage's shard ------------------------------------------------------------------
class StageRunner(ModelRunner):
    """One rank's :class:`ModelRunner` over its stage's layers (re-indexed from 0 in its KV cache)
    and, with ``tp > 1``, its tensor-parallel shard. ``forward`` receives the previous stage's
    hidden states (unless first) and sends its own to the next stage (unless last, which returns
    the sampled rows' logits ``[K, vocab]``)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        rank: int,
        tp: int,
        pp: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        num_host_blocks: int = 0,
        padding_buckets: bool = True,
        paged_attention: str = "auto",
        cpu_fused: bool = False,
    ) -> None:
        self.rank, self.tp, self.pp = rank, tp, pp
        self.stage, tp_rank = divmod(rank, tp)
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.prev = rank - tp if not self.first else None
        self.next = rank + tp if not self.last else None
        self.sends: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)] if tp > 1 else []
        layers = split_layers(model.config.num_hidden_layers, pp)[self.stage]
        model.model.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        for local, layer in enumerate(model.model.layers):
            attention: Any = layer.self_attn
            attention.layer_idx = local  # this stage's KV cache holds only its layers
        if tp > 1:
            from llmlab.inference.tensor_parallel import shard_model

            shard_model(model, groups[self.stage])
        self.model = model.to(device=device, dtype=dtype).eval()
        if tp == 1:
            self.model.fuse_projections()
        self.config = model.config
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.padding_buckets = padding_buckets
        self.paged_attention, self.cpu_fused = paged_attention, cpu_fused  # the engine's kernel choices
        kv_heads = int(getattr(model.model.layers[0].self_attn, "num_kv_heads"))  # this rank's
        shape = (len(layers), 2, num_blocks, block_size, kv_heads, self.config.head_dim)
        self.kv_cache = torch.zeros(shape, device=device, dtype=dtype)
        host_shape = shape[:2] + (num_host_blocks,) + shape[3:]
        self.host_cache = torch.zeros(host_shape, dtype=dtype) if num_host_blocks else None
        self.is_driver_output = self.last and tp_rank == 0

    @torch.no_grad()
    def forward(self, batches: list[AttentionBatch], sample_rows: list[int]) -> torch.Tensor | None:  # type: ignore[override]  # None: not the last stage
        ids = torch.cat([b.input_ids for b in batches])
        positions = torch.cat([b.positions for b in batches])
        if self.first:
            h = self.model.embed(ids[None])
        else:
            h = torch.empty(1, ids.numel(), self.config.hidden_size, device=self.device, dtype=self.dtype)
            dist.recv(h, src=self.prev)
        with forward_context(
            PagedAttentionContext(self.kv_cache, batches, self.paged_attention, self.cpu_fused)
        ):
            h = self.model.run_layers(h, positions=positions)
        if not self.last:
            while len(self.sends) > self.pp:  # bound what is still being sent
                self.sends.popleft()[0].wait()
            self.sends.append((dist.isend(h.contiguous(), dst=self.next), h))
            return None
        rows = torch.tensor(sample_rows, device=self.device, dtype=torch.long)
        return self.model.head(h.flatten(0, -2)[rows])

    def execute_message(self, msg: dict[str, Any]) -> tuple[list[int], torch.Tensor] | None:
        """Apply the step's swaps and copies, run this stage's part of it; the last stage's rank 0
        returns ``(seq_ids, logits [K, vocab] fp32 CPU)``, the others None."""
        self.swap_out([tuple(x) for x in msg["swap_out"]])
        self.swap_in([tuple(x) for x in msg["swap_in"]])
        self.copy_blocks([tuple(x) for x in msg["copies"]])
        if not msg["seqs"]:
            return None
        batches, rows, seq_ids = self.prepare(scheduled_of(msg))
        logits = self.forward(batches, rows)
        if not self.is_driver_output or logits is None:
            return None
        return seq_ids, logits.float().cpu()

    def close(self) -> None:
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


def build_stage(
    rank: int, tp: int, pp: int, weights: Any, config: Any, runner_args: dict[str, Any], device: torch.device
) -> StageRunner:
    """Load the model (``weights``: a path or preset name, else a state dict of ``config``'s
    model) and keep rank ``rank``'s stage and shard of it."""
    if isinstance(weights, str):
        from llmlab.inference import loader

        model, _, _, _ = loader.load(weights)
    else:
        model = LlamaForCausalLM(config, seed=None)
        model.load_state_dict(weights)
    return StageRunner(model, rank, tp, pp, device=device, **runner_args)


# --- the driver's runner ---------------------------------------------------------------------------
class PipelineExecutor:
    """The engine's runner over ``pp * tp`` workers (``workers``: :class:`ProcessWorkers` or the Ray
    executor's, with ``submit(msg) -> handle``, ``result(handle) -> value``, ``close()``).

    The block operations (``copy_blocks``, ``swap_out``, ``swap_in``) are queued and travel with
    the next step; :meth:`submit` sends a step and returns at once, :meth:`collect` waits for its
    logits; :meth:`execute` does both. A worker that fails or dies raises
    :class:`~llmlab.inference.errors.EngineDeadError` naming it."""

    def __init__(self, workers: Any, tp: int, pp: int) -> None:
        self.workers, self.tp, self.pp = workers, tp, pp
        self._ops: dict[str, list[list[int]]] = {"copies": [], "swap_out": [], "swap_in": []}
        self._stopped = False
        atexit.register(self.shutdown)  # a notebook kernel that exits stops its workers too

    @property
    def depth(self) -> int:
        """Steps kept in flight: one per stage."""
        return self.pp

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._ops["copies"] += [list(p) for p in pairs]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._ops["swap_out"] += [list(p) for p in pairs]

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._ops["swap_in"] += [list(p) for p in pairs]

    def submit(self, out: SchedulerOutput) -> Any:
        msg = step_message(out, self._ops)
        self._ops = {"copies": [], "swap_out": [], "swap_in": []}
        return self.workers.submit(msg)

    def collect(self, handle: Any) -> dict[int, torch.Tensor]:
        """``{seq_id: logits [vocab]}`` of the submitted step's sequences that sample."""
        res = self.workers.result(handle)
        if res is None:
            return {}
        seq_ids, logits = res
        return dict(zip(seq_ids, logits))

    def execute(self, out: SchedulerOutput) -> dict[int, torch.Tensor]:
        return self.collect(self.submit(out))

    def shutdown(self) -> None:
        """Stop the workers (Ray: kill the actors, remove the placement group); idempotent."""
        if not self._stopped:
            self._stopped = True
            atexit.unregister(self.shutdown)
            self.workers.close()


def launch(
    model: LlamaForCausalLM,
    spec: Any,
    tp: int,
    pp: int,
    device: torch.device,
    runner_args: dict[str, Any],
    backend: str = "mp",
) -> PipelineExecutor:
    """Start ``tp * pp`` workers with ``backend`` (``"mp"``: local processes; ``"ray"``: Ray
    actors, :mod:`llmlab.inference.executor_ray`) and return the engine's runner over them. Each
    loads ``spec`` itself when it is a path or preset name, else ``model``'s weights."""
    validate(model.config, tp, pp)
    weights = spec if isinstance(spec, str) else model.state_dict()
    workers: Any
    if backend == "ray":
        from llmlab.inference import executor_ray

        workers = executor_ray.RayWorkers.start(
            build_stage, weights, model.config, tp, pp, runner_args, device
        )
    elif backend == "mp":
        workers = ProcessWorkers.start(weights, model.config, tp, pp, runner_args, device)
    else:
        raise ValueError(f"distributed_executor_backend={backend!r}: expected 'mp' or 'ray'")
    return PipelineExecutor(workers, tp, pp)


# --- the mp executor: local processes, a pipe each -------------------------------------------------
class ProcessWorkers:
    """``tp * pp`` local worker processes (:mod:`llmlab.runtime.process`), rendezvousing on a
    loopback store this process hosts; each has a pipe: steps in, one reply per step out (read by
    a thread per worker, so a large reply never blocks a worker while this process sends)."""

    def __init__(self, procs: list[Any], conns: list[Any], store: Any, output_rank: int) -> None:
        self.procs, self.conns, self._store = procs, conns, store
        self.output_rank = output_rank  # the last stage's rank 0: the logits
        self.replies: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in conns]
        for r, c in enumerate(conns):
            threading.Thread(
                target=_read_replies, args=(c, self.replies[r]), daemon=True, name=f"llmlab-pp-reader{r}"
            ).start()
        self._closed = False

    @classmethod
    def start(
        cls, weights: Any, config: Any, tp: int, pp: int, runner_args: dict[str, Any], device: torch.device
    ) -> ProcessWorkers:
        world = tp * pp
        backend = process.resolve_backend("auto", world, device=device.type)
        store = process.loopback_store()
        env = process.local_env(backend)
        threads = process.child_threads(world, backend)  # the seat's usable cores, shared
        procs, conns = [], []
        try:
            for r in range(world):
                mine, theirs = process.context().Pipe()
                procs.append(
                    process.start(
                        _mp_worker,
                        (
                            r,
                            tp,
                            pp,
                            store.port,
                            backend,
                            weights,
                            config,
                            runner_args,
                            str(device),
                            threads,
                            env,
                            theirs,
                        ),
                        name=f"llmlab-pp-rank{r}",
                    )
                )
                theirs.close()
                conns.append(mine)
            workers = cls(procs, conns, store, (pp - 1) * tp)
            workers.wait_ready()
        except BaseException:
            process.stop(procs)
            raise
        return workers

    def wait_ready(self) -> None:
        for r in range(len(self.procs)):
            self._reply(r)

    def _reply(self, r: int) -> Any:
        """Worker ``r``'s next reply; raises :class:`EngineDeadError` when it failed or died."""
        while True:
            try:
                kind, value = self.replies[r].get(timeout=1.0)
                break
            except queue.Empty:
                if self.procs[r].exitcode is not None and self.replies[r].empty():
                    kind, value = "dead", None
                    break
        if kind == "error":
            raise EngineDeadError(f"pipeline-parallel rank {r} failed; the engine cannot step:\n{value}")
        if kind == "dead":
            self.procs[r].join(5)
            raise EngineDeadError(
                f"pipeline-parallel rank {r} exited with code {self.procs[r].exitcode}"
                " (its traceback, if any, is on stderr); the engine cannot step"
            )
        return value

    def submit(self, msg: dict[str, Any]) -> None:
        for r, c in enumerate(self.conns):
            try:
                c.send(("step", msg))
            except OSError:
                self._reply(r)  # raises naming the dead rank
                raise

    def result(self, handle: Any) -> Any:
        """The step's replies, in order; the last stage's rank 0 gives the logits."""
        out = None
        for r in range(len(self.procs)):
            v = self._reply(r)
            if r == self.output_rank:
                out = v
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for c in self.conns:
            try:
                c.send(("stop", None))
            except OSError:
                pass
        end = time.monotonic() + 10  # all together: a rank stuck in a recv is stopped
        for p in self.procs:
            p.join(max(0.0, end - time.monotonic()))
        process.stop(self.procs)
        for c in self.conns:
            c.close()
        self._store = None


def _read_replies(conn: Any, q: queue.SimpleQueue[Any]) -> None:
    while True:
        try:
            q.put(conn.recv())
        except (EOFError, OSError):
            q.put(("dead", None))
            return


def serve_messages(runner: StageRunner, recv: Any, send: Any) -> None:
    """A worker's loop: ``recv()`` a ``(kind, msg)`` until ``"stop"``, ``send(("ok", result))``
    after each step."""
    while True:
        kind, msg = recv()
        if kind == "stop":
            runner.close()
            return
        send(("ok", runner.execute_message(msg)))


def _mp_worker(
    rank: int,
    tp: int,
    pp: int,
    port: int,
    backend: str,
    weights: Any,
    config: Any,
    runner_args: dict[str, Any],
    device: str,
    threads: int,
    env: dict[str, str],
    conn: Any,
) -> None:
    """A local worker: dies with its parent, joins the store, builds its stage, serves steps; a
    failure is sent back with its traceback (and printed) and the process exits 1."""
    try:
        process.setup_child(env, threads, backend, rank)  # the same first lines as launch's ranks
        dev = torch.device(device)
        if backend == "nccl":
            dev = torch.device("cuda", rank % torch.cuda.device_count())
        process.init_process_group(backend, process.join_store("127.0.0.1", port), rank, tp * pp)
        runner = build_stage(rank, tp, pp, weights, config, runner_args, dev)
        conn.send(("ok", None))
        serve_messages(runner, conn.recv, conn.send)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the engine must hear of it
        tb = traceback.format_exc()
        print(f"llmlab pipeline-parallel rank {rank} failed:\n{tb}", file=sys.stderr, flush=True)
        try:
            conn.send(("error", tb))
        except OSError:
            pass
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
