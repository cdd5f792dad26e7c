"""Tensor-parallel inference: the model sharded over ``tp`` ranks, rank 0 scheduling.

The layers are training's Megatron layers (:mod:`llmlab.parallel.tensor_parallel`; Shoeybi et al.
2019 §3): q/k/v and gate/up column-parallel, o and down row-parallel (one all-reduce each), the
embedding vocab-parallel (one all-reduce) and ``lm_head`` column-parallel with its logits gathered.
Each rank keeps its query heads and their key/value heads, so each holds its heads' slice of the
paged KV cache, ``[layers, 2, blocks, block_size, kv_heads/tp, D]``: the same block ids on every
rank, 1/tp of the bytes (with fewer kv heads than ranks a kv head is replicated on the ranks whose
query heads use it, as in training).

Rank 0 runs the whole engine (scheduler, block manager, sampling); each step it builds the step's
attention batches (token ids, positions, slot mapping, block tables) and broadcasts them, block
copies and swaps too, to the other ranks, which run the same forward on their shard
(:func:`run_worker`); vLLM's driver worker broadcasts its step inputs the same way. Greedy tokens
equal single-device ones (the same maths; only the order of the row-parallel sums changes).

The layers are placed by training's plan (:data:`llmlab.parallel.tp_plan.TP_PLAN`, applied by
:func:`~llmlab.parallel.tp_plan.apply_plan`); inference only gathers the head's logits for sampling.

Ranks: :meth:`TensorParallelRunner.launch` starts ``tp - 1`` worker processes with
:mod:`llmlab.runtime.process` (the fork server, a loopback store hosted by this process for the
rendezvous, ``LLMLAB_PG_TIMEOUT``) and makes the calling process rank 0 (gloo on CPU, NCCL on
GPUs, rank ``r`` on ``cuda:r``), or, when
``torch.distributed`` is already initialised (``torchrun``, several nodes), uses the ranks it
finds: there every rank other than 0 calls :func:`run_worker` instead of building an engine.
One tensor-parallel engine per process (it owns the default process group).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import traceback
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from llmlab.inference.attention_context import AttentionBatch
from llmlab.inference.errors import EngineDeadError
from llmlab.inference.model_runner import ModelRunner
from llmlab.model.layers import MLP
from llmlab.model.config import ModelConfig
from llmlab.model.llama import LlamaForCausalLM
from llmlab.parallel.tensor_parallel import check_shardable
from llmlab.parallel.tp_plan import TP_PLAN, apply_plan
from llmlab.runtime import process
from llmlab.runtime.comm import Group
from llmlab.runtime.hardware import resolve_device
from llmlab.runtime.messages import broadcast_message


def validate(config: ModelConfig, tp: int, quantization: str | None = None) -> None:
    """Raise ``ValueError`` naming the constraint when ``tp`` ranks cannot shard ``config``."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size={tp} must be >= 1")
    if tp == 1:
        return
    if config.num_experts:
        raise ValueError("tensor-parallel inference of a mixture-of-experts model is not supported")
    check_shardable(config, tp, name="tensor_parallel_size")  # heads, kv heads, FFN, vocabulary
    if quantization is not None:
        raise ValueError("quantization with tensor_parallel_size > 1 is not supported")


@torch.no_grad()
def shard_model(model: LlamaForCausalLM, group: Group) -> LlamaForCausalLM:
    """Replace ``model``'s layers by this rank's tensor-parallel shards, in place, with training's
    plan (:data:`~llmlab.parallel.tp_plan.TP_PLAN`; see the module docstring); ``lm_head`` gathers
    its logits (``[*, V]`` on every rank, for sampling) and is tied to the embedding when the
    model ties them. Raises ``ValueError`` when ``tp`` cannot shard the model."""
    validate(model.config, dist.get_world_size(group))
    if any(type(layer.mlp) is not MLP for layer in model.model.layers):
        raise ValueError("tensor-parallel inference needs dense MLPs")
    apply_plan(model, TP_PLAN, group, sequence_parallel=False)
    head: Any = model.lm_head  # now the plan's ColumnParallelLinear
    head.gather_output = True
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _as_dict(b: AttentionBatch) -> dict[str, Any]:
    return {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}


def _from_dict(d: dict[str, Any], device: torch.device) -> AttentionBatch:
    return AttentionBatch(**{k: (v if k == "is_prefill" else v.to(device)) for k, v in d.items()})


def _comm_device(group: Group, device: torch.device) -> torch.device:
    """Where broadcast tensors live: the rank's GPU under NCCL, the CPU under gloo."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


class TensorParallelRunner(ModelRunner):
    """A :class:`ModelRunner` over this rank's shard and KV slice. On rank 0 every operation is
    first broadcast to the other ranks (which run :meth:`serve`); ``shutdown`` stops them."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        num_host_blocks: int = 0,
        padding_buckets: bool = True,
        group: Group = None,
        paged_attention: str = "auto",
        cpu_fused: bool = False,
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.paged_attention, self.cpu_fused = paged_attention, cpu_fused  # (no packing: TP layers)
        self.rank, self.tp = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.model = model.to(device=device, dtype=dtype).eval()
        self.config = model.config
        self.device, self.dtype, self.block_size = device, dtype, block_size
        self.padding_buckets = padding_buckets
        c = self.config
        attn: Any = model.model.layers[0].self_attn  # this rank's
        shape = (c.num_hidden_layers, 2, num_blocks, block_size, attn.num_kv_heads, c.head_dim)
        self.kv_cache = torch.zeros(shape, device=device, dtype=dtype)
        host_shape = shape[:2] + (num_host_blocks,) + shape[3:]
        pin = device.type == "cuda"
        self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin) if num_host_blocks else None
        self.procs: list[Any] = []
        self._owns_group = False
        self._store: dist.TCPStore | None = None
        self._stopped = False

    # --- rank 0: broadcast, then do -----------------------------------------------------------
    def _send(self, msg: tuple[Any, ...]) -> None:
        if self.rank == 0 and self.tp > 1:
            try:
                broadcast_message(msg, src=0, group=self.group, device=_comm_device(self.group, self.device))
            except Exception as e:
                raise self._rank_error(e) from e

    def _rank_error(self, err: Exception) -> Exception:
        """A collective or rank 0's part of a step failed: name the worker rank that died, if
        one did. Either way the ranks are out of step, so the engine cannot go on
        (:class:`EngineDeadError`; a one-device engine fails only the step's requests)."""
        for r, p in enumerate(self.procs, start=1):
            code = p.exitcode
            if code is not None:
                return EngineDeadError(
                    f"tensor-parallel rank {r} exited with code {code} (its "
                    f"traceback, if any, is on stderr); the engine cannot step"
                )
        return EngineDeadError(
            f"tensor-parallel step failed on rank 0 ({type(err).__name__}: "
            f"{err}); the ranks are out of step, the engine cannot go on"
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._send(("copy", pairs))
        super().copy_blocks(pairs)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._send(("swap_out", pairs))
        super().swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._send(("swap_in", pairs))
        super().swap_in(pairs)

    def enable_lora(self, max_loras: int, max_lora_rank: int) -> None:
        """Every rank: adapter slots on its layers, split like the layers (inference/lora.py)."""
        super().enable_lora(max_loras, max_lora_rank)  # a bad bound is refused on rank 0 only
        self._send(("lora", "enable_lora", (max_loras, max_lora_rank)))

    def load_lora(self, name: str, path: str) -> None:
        """Every rank loads its slices of the adapter (``path`` readable by every rank)."""
        super().load_lora(name, path)  # checked against the base here first: workers then agree
        self._send(("lora", "load_lora", (name, path)))

    def unload_lora(self, name: str) -> None:
        super().unload_lora(name)
        self._send(("lora", "unload_lora", (name,)))

    @torch.no_grad()
    def forward(
        self, batches: list[AttentionBatch], sample_rows: list[int], **extra: torch.Tensor
    ) -> torch.Tensor:
        """Rank 0: send the step (and each token's adapter slot) to the other ranks, then run
        this rank's shard of it. ``extra`` (a vision-language model's inputs) is refused: tensor
        parallelism serves text models."""
        if extra:
            raise ValueError("tensor-parallel inference takes no multimodal inputs")
        slots = None if self.lora is None or self.lora.token_slots is None else self.lora.token_slots.tolist()
        self._send(("step", [_as_dict(b) for b in batches], sample_rows, slots))
        try:
            return super().forward(batches, sample_rows)
        except Exception as e:
            raise self._rank_error(e) from e

    # --- ranks > 0 ----------------------------------------------------------------------------
    @torch.no_grad()
    def serve(self) -> None:
        """Run rank 0's operations until it says stop (ranks other than 0)."""
        while True:
            op, *args = broadcast_message(
                None, src=0, group=self.group, device=_comm_device(self.group, self.device)
            )
            if op == "step":
                if args[2] is not None:
                    self.lora.set_slots(args[2], self.device)
                ModelRunner.forward(self, [_from_dict(b, self.device) for b in args[0]], args[1])
            elif op == "lora":
                getattr(ModelRunner, args[0])(self, *args[1])
            elif op == "copy":
                ModelRunner.copy_blocks(self, args[0])
            elif op == "swap_out":
                ModelRunner.swap_out(self, args[0])
            elif op == "swap_in":
                ModelRunner.swap_in(self, args[0])
            elif op == "stop":
                return

    # --- lifecycle ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Rank 0: stop the other ranks, join the processes it started, free the process group."""
        if self._stopped or self.rank != 0:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        try:
            self._send(("stop",))
        except Exception:  # a rank is gone already: nothing to stop there
            pass
        for p in self.procs:
            p.join(30)
        process.stop(self.procs)
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

    @classmethod
    def launch(
        cls, model: LlamaForCausalLM, spec: Any, tp: int, device: torch.device, runner_args: dict[str, Any]
    ) -> "TensorParallelRunner":
        """Rank 0's runner over ``tp`` ranks: spawn ``tp - 1`` workers (each loads ``spec``, the
        engine's ``model`` argument, itself when it is a path or preset name) unless
        ``torch.distributed`` is initialised already with ``tp`` ranks (``torchrun``)."""
        validate(model.config, tp)
        procs: list[Any] = []
        store: dist.TCPStore | None = None
        owns = False
        if dist.is_initialized():
            if dist.get_world_size() != tp or dist.get_rank() != 0:
                raise ValueError(
                    f"tensor_parallel_size={tp} under an initialised process group of "
                    f"{dist.get_world_size()} ranks: build the engine on rank 0 and "
                    "call run_worker on the others, with as many ranks as tp"
                )
            broadcast_message(
                runner_args,
                src=0,  # the cache sizes rank 0 chose
                device=_comm_device(None, _rank_device(device, 0)),
            )
        else:
            procs, store = _start_workers(model, spec, tp, device, runner_args)
            owns = True
        runner = cls(shard_model(model, dist.group.WORLD), device=_rank_device(device, 0), **runner_args)
        runner.procs, runner._owns_group = procs, owns
        runner._store = store  # the rendezvous store lives as long as the process group
        atexit.register(runner.shutdown)
        return runner


def _start_workers(
    model: LlamaForCausalLM, spec: Any, tp: int, device: torch.device, runner_args: dict[str, Any]
) -> tuple[list[Any], dist.TCPStore]:
    """Start ranks 1..tp-1 (:mod:`llmlab.runtime.process`), each loading ``spec`` itself when it is
    a path or preset name, else ``model``'s weights; join them in this process's default group as
    rank 0. Returns ``(processes, the rendezvous store)``; on a failed rendezvous they are stopped and the error raised."""
    backend = process.resolve_backend("auto", tp, device=device.type)
    store = process.loopback_store()  # bound before any worker starts: no port race
    weights = spec if isinstance(spec, str) else model.state_dict()
    payload = cloudpickle.dumps((weights, model.config, runner_args))
    threads = process.child_threads(tp, backend)  # the seat's usable cores, shared
    env = process.local_env(backend)
    procs = []
    try:
        for r in range(1, tp):
            procs.append(
                process.start(
                    _worker_entry,
                    (r, tp, store.port, backend, payload, str(device), threads, env),
                    name=f"llmlab-tp-rank{r}",
                )
            )
        process.init_process_group(backend, store, 0, tp)
    except BaseException:
        process.stop(procs)
        raise
    return procs, store


def join_torchrun(tp: int) -> int:
    """Under ``torchrun`` with ``tp > 1``: initialise the process group from the environment
    (``WORLD_SIZE`` must equal ``tp``; :func:`llmlab.runtime.process.join_torchrun`) and return
    this rank; otherwise 0 (rank 0 spawns its own workers). Raises ``ValueError`` for a world
    size other than ``tp``."""
    if tp == 1 or not process.under_torchrun():
        return 0
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise ValueError(f"--tensor-parallel-size {tp} but torchrun started {world} ranks")
    process.join_torchrun("auto")
    return dist.get_rank()


def run_worker(spec: Any, device: str = "auto") -> None:
    """A rank other than 0 of an initialised process group (``torchrun``): load ``spec`` (path or
    preset), shard it, and serve rank 0's steps until it stops; rank 0 builds the engine with
    ``tensor_parallel_size`` = the world size (and sends its cache sizes first)."""
    from llmlab.inference import loader

    dev = torch.device(resolve_device(device))
    runner_args = broadcast_message(
        None, src=0, device=_comm_device(None, _rank_device(dev, dist.get_rank()))
    )
    model, _, _, _ = loader.load(spec)
    runner = TensorParallelRunner(
        shard_model(model, dist.group.WORLD), device=_rank_device(dev, dist.get_rank()), **runner_args
    )
    runner.serve()


def _rank_device(device: torch.device, rank: int) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", rank % torch.cuda.device_count())
    return device


def _worker_entry(
    rank: int,
    tp: int,
    port: int,
    backend: str,
    payload: bytes,
    device: str,
    threads: int,
    env: dict[str, str],
) -> None:
    """A started rank > 0: it dies with its parent, joins rank 0's store, loads the model and
    serves rank 0's steps; a failure prints its traceback to stderr and exits 1."""
    try:
        process.setup_child(env, threads, backend, rank)  # the same first lines as launch's ranks
        process.init_process_group(backend, process.join_store("127.0.0.1", port), rank, tp)
        weights, config, runner_args = cloudpickle.loads(payload)
        if isinstance(weights, str):
            from llmlab.inference import loader

            model, _, _, _ = loader.load(weights)
        else:
            model = LlamaForCausalLM(config, seed=None)
            model.load_state_dict(weights)
        runner = TensorParallelRunner(
            shard_model(model, dist.group.WORLD),
            device=_rank_device(torch.device(device), rank),
            **runner_args,
        )
        runner.serve()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - rank 0 must hear of it
        print(
            f"llmlab tensor-parallel rank {rank} failed:\n{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown racing the process group's threads
