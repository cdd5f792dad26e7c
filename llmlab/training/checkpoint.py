"""Fault-tolerant, reshardable training checkpoints.

Layout of ``--checkpoint-dir``::

    step_00000010/
        metadata.json          step, loss, layout, world size; per file: CRC32, size, and every
                               tensor it holds (dtype, shape, slice of the full tensor)
        rank00000.safetensors  this rank's tensors, each under its *full-model* name
        ...

* Safe to load: tensors are in ``safetensors`` files and everything else is JSON, so loading a
  checkpoint never unpickles (a pickle can run any code when loaded; a checkpoint passed around a
  workshop is untrusted input). A shard that is not what ``metadata.json`` says it is (not a
  safetensors file, other tensors, dtypes or shapes, a matching CRC32 notwithstanding) is refused
  by name, and so is a file of the older pickle format.

* Atomic: ranks write into ``step_XXXXXXXX.tmp``; when every file is written and checksummed,
  rank 0 writes ``metadata.json`` and renames the directory. A half-written checkpoint is never
  named like a finished one, so it is never the latest.
* Verified: loading recomputes every file's CRC32 (as the source articles' deployment practice
  does) and reads every shard's header; a corrupted, truncated or refused checkpoint is reported
  and the previous good one is used.
* Kept: the newest ``keep`` (3) finished checkpoints; older ones are deleted after a save.
* Reshardable: every tensor is stored under its name in the full model (``model.layers.3...``,
  whatever stage holds layer 3) with the slice this rank holds (``dim``, ``index``, ``parts`` for
  a tensor-parallel shard, none for a whole tensor). Loading assembles the full tensors and cuts
  the slices the *new* layout needs, so a checkpoint saved at dp2×tp2 resumes at tp4 or on one rank.
  Optimizer states (Adam ``exp_avg``, ``exp_avg_sq``, ``step``, and fp32 master weights under
  mixed precision) travel the same way. Across precisions too: a run resumes its weights from the
  fp32 masters when the checkpoint has them (a 16-bit run wrote it), else from the fp32 weights,
  so bf16 -> fp32 and fp32 -> bf16 start every layout from the same weights as one device.
* Extensible: a new kind of state is more named tensors in the shards (``<param>::<state>``) with
  its slice in ``metadata.json``; the loader assembles whatever names it finds.
* Resume is exact: the data of step ``s`` depends only on (seed, s), so continuing at the next step
  with the restored weights and optimizer state gives the losses of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import zlib
from pathlib import Path
from typing import Callable, Protocol

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from llmlab.parallel.protocols import TrainerOptimizer
from llmlab.runtime.mesh import Mesh
from llmlab.training.config import TrainConfig
from llmlab.training.precision import DynamicLossScaler

STEP_DIR = re.compile(r"^step_(\d{8})$")
SHARD = re.compile(r"^rank\d{5}\.safetensors$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be mapped onto this model."""


class Checkpointable(Protocol):
    """What a checkpoint reads of the trainer's engine (:class:`~llmlab.training.trainer.Engine`):
    the run's flags, the mesh, this rank's model, the full-model shape of every parameter (before
    sharding), the optimizer (whose ``param_state``/``load_param_state`` pair gives and takes
    whole tensors, whatever strategy shards them), the fp16 loss scaler and the last step's record."""

    @property
    def cfg(self) -> TrainConfig: ...

    @property
    def mesh(self) -> Mesh: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def full_shapes(self) -> dict[str, tuple[int, ...]]: ...

    @property
    def optimizer(self) -> TrainerOptimizer: ...

    @property
    def scaler(self) -> DynamicLossScaler | None: ...

    @property
    def last(self) -> dict: ...


# The flags that set the learning rate of every step (and so the optimizer's trajectory): a resumed
# run must use the checkpoint's values unless --override-opt-param-scheduler says otherwise.
SCHEDULE_FLAGS = ("lr_schedule", "lr", "min_lr", "warmup_steps", "steps")
# The flags that choose the data of every step (BatchLoader: step s reads a batch drawn from
# (seed, s) of global_batch_size sequences of seq_len tokens): a resumed run must keep them, or it
# trains on other data than the run it continues, unless --override-data-order says otherwise.
DATA_FLAGS = ("seed", "global_batch_size", "seq_len")


def check_resume_flags(cfg: TrainConfig, meta: dict, path) -> None:
    """Refuse to resume with schedule/optimizer flags (:data:`SCHEDULE_FLAGS`) or data flags
    (:data:`DATA_FLAGS`) other than those the checkpoint at ``path`` was made with:
    ``ValueError`` naming the flag and both values. ``cfg.override_opt_param_scheduler`` takes
    this run's schedule values instead (as Megatron's ``--override-opt_param-scheduler``),
    ``cfg.override_data_order`` this run's data flags. ``--steps`` counts only for a decaying
    schedule (linear, cosine: the decay ends at the last step); extending a constant-rate run is
    allowed. A checkpoint of an older llmlab without a record is not checked for it (its
    ``seed`` is)."""
    data = meta.get("data_flags") or ({"seed": meta["seed"]} if "seed" in meta else {})
    if not cfg.override_data_order:
        for k in DATA_FLAGS:
            if k in data and data[k] != getattr(cfg, k):
                flag = "--" + k.replace("_", "-")
                raise ValueError(
                    f"--resume: {flag} is {getattr(cfg, k)!r} but the checkpoint {path} "
                    f"was made with {flag} {data[k]!r} (the data of every step "
                    f"depends on it); resume with the same value, or pass "
                    f"--override-data-order to take the new one"
                )
    saved = meta.get("schedule_flags")
    if not saved or cfg.override_opt_param_scheduler:
        return
    for k in SCHEDULE_FLAGS:
        if k == "steps" and cfg.lr_schedule == saved.get("lr_schedule") == "constant":
            continue
        if k in saved and saved[k] != getattr(cfg, k):
            flag = "--" + k.replace("_", "-")
            raise ValueError(
                f"--resume: {flag} is {getattr(cfg, k)!r} but the checkpoint {path} was "
                f"made with {flag} {saved[k]!r}; resume with the same value, or pass "
                f"--override-opt-param-scheduler to take the new one"
            )


# --------------------------------------------------------------------------------------------
# Names and slices
# --------------------------------------------------------------------------------------------
def full_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> name in the full model``, whatever slice of the model this rank holds.

    Decoder layers keep their global index in ``layer_idx``; a pipeline stage holding layers 2-3
    as ``model.layers.0-1`` still names them ``model.layers.2-3``.
    """
    from llmlab.model.llama import DecoderLayer

    names = {}
    for mname, module in model.named_modules():
        if isinstance(module, DecoderLayer):
            prefix = re.sub(r"layers\.\d+$", f"layers.{module.layer_idx}", mname)
            for pname, p in module.named_parameters():
                names[id(p)] = f"{prefix}.{pname}"
    for pname, p in model.named_parameters():
        names.setdefault(id(p), pname)
    return names


def slice_spec(local_shape, full_shape, tp_index: int, tp: int):
    """``None`` for a whole tensor, else ``(dim, index, parts)``: this rank holds part ``index`` of
    ``parts`` equal chunks along ``dim``. Usually ``parts == tp``; fewer key/value heads than tp
    ranks gives ``parts < tp`` (each head copied to ``tp/parts`` consecutive ranks)."""
    local_shape, full_shape = tuple(local_shape), tuple(full_shape)
    if local_shape == full_shape:
        return None
    diff = [d for d, (a, b) in enumerate(zip(local_shape, full_shape)) if a != b]
    if len(local_shape) == len(full_shape) and len(diff) == 1:
        d = diff[0]
        if full_shape[d] % local_shape[d] == 0 and tp % (full_shape[d] // local_shape[d]) == 0:
            parts = full_shape[d] // local_shape[d]
            return (d, tp_index // (tp // parts), parts)
    raise CheckpointError(
        f"cannot express a local tensor of shape {local_shape} as a slice of the "
        f"full shape {full_shape} with tp={tp}"
    )


def _cut(full: torch.Tensor, spec) -> torch.Tensor:
    if spec is None:
        return full
    dim, index, parts = spec
    return full.chunk(parts, dim=dim)[index]


def _collect(engine: Checkpointable) -> tuple[dict, dict]:
    """This rank's tensors under their full-model names, and the slice of each: the weights, the
    fp32 masters (``<name>::master``) and the optimizer states (``<name>::exp_avg``, ...), whole
    tensors from the optimizer's ``param_state()`` (under ZeRO gathered from the shards, so the
    format is the same). Collective under ZeRO: every rank calls it."""
    names = full_names(engine.model)
    tensors, slices = {}, {}
    tp_i, tp = engine.mesh.coords["tp"], engine.mesh.tp
    for p, state in engine.optimizer.param_state().items():
        n = names[id(p)]
        spec = slice_spec(p.shape, engine.full_shapes[n], tp_i, tp)
        for key, t in state.items():
            name = n if key == "param" else f"{n}::{key}"
            tensors[name] = t
            slices[name] = spec if t.dim() else None
    return tensors, slices


def _weights(full: dict, name: str) -> torch.Tensor:
    """The weights to resume ``name`` from: the fp32 master when the checkpoint has one (it was
    written by a 16-bit run), else the tensor itself (an fp32 run: it is the master). Whatever
    the new run's dtype, its masters get these fp32 values and its 16-bit weights their rounding,
    so a 16-bit checkpoint resumed in fp32 (or the reverse) starts from the same weights on every
    layout as on one device."""
    return full.get(f"{name}::master", full[name])


def _lookup(engine: Checkpointable, full: dict, path) -> Callable[[torch.nn.Parameter], dict]:
    """What the optimizer's ``load_param_state`` asks for each parameter: this rank's slice of
    its weights (:func:`_weights`) and optimizer state. Raises ``CheckpointError`` for a
    parameter the checkpoint lacks."""
    names = full_names(engine.model)
    tp_i, tp = engine.mesh.coords["tp"], engine.mesh.tp

    def lookup(p: torch.nn.Parameter) -> dict:
        n = names[id(p)]
        if n not in full:
            raise CheckpointError(f"{path} has no tensor {n!r} (different model?)")
        spec = slice_spec(p.shape, engine.full_shapes[n], tp_i, tp)
        out = {"param": _cut(_weights(full, n), spec)}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            t = full.get(f"{n}::{key}")
            if t is not None:
                out[key] = t if t.dim() == 0 else _cut(t, spec)
        return out

    return lookup


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------
def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _barrier():
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(
    engine: Checkpointable,
    step: int,
    loss: float,
    directory: str | Path,
    keep: int = 3,
    extra: dict | None = None,
) -> Path | None:
    """Collectively save this step. Ranks holding a distinct part of the model write a file
    (data-parallel replicas do not repeat it). ``extra`` (JSON) joins ``metadata.json`` (the
    trainer's wall-clock time, elapsed time, hardware: :mod:`llmlab.training.checkpoint_clock`).
    Returns the finished directory (on rank 0)."""
    directory = Path(directory)
    mesh = engine.mesh
    final = directory / f"step_{step:08d}"
    tmp = directory / f"step_{step:08d}.tmp"
    rank = mesh.rank
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier()
    tensors, slices = _collect(engine)  # every rank: under ZeRO gathering the shards is collective
    # one copy per distinct shard (experts differ across ep; context-parallel ranks are replicas)
    if mesh.coords["dp"] < mesh.ep and mesh.coords.get("cp", 0) == 0:
        # The slices ride in the shard's (JSON) header; rank 0 copies them into metadata.json.
        header = {
            "rank": rank,
            "coords": dict(mesh.coords),
            "slices": {n: None if s is None else list(s) for n, s in slices.items()},
        }
        save_file(
            {n: t.contiguous() for n, t in tensors.items()},
            str(tmp / f"rank{rank:05d}.safetensors"),
            metadata={"format": "pt", "llmlab": json.dumps(header)},
        )
    _barrier()
    if rank == 0:
        files = {
            f.name: {"crc32": _crc32(f), "bytes": f.stat().st_size, **_header(f)}
            for f in sorted(tmp.glob("rank*.safetensors"))
        }
        cfg = engine.cfg
        meta = {
            "step": step,
            "loss": loss,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "layout": {k: getattr(cfg, k) for k in ("dp", "tp", "pp", "ep", "cp", "zero", "dtype")},
            "model": cfg.model,
            "seed": cfg.seed,
            "next_data_step": step + 1,
            "files": files,
            # the schedule's position (its rate is a function of the step) and the fp16 scaler
            "lr_schedule": {"step": step, "lr": engine.last.get("lr")},
            # the flags the schedule and optimizer were made with (checked on resume)
            "schedule_flags": {k: getattr(cfg, k) for k in SCHEDULE_FLAGS},
            "data_flags": {k: getattr(cfg, k) for k in DATA_FLAGS},
            "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        }
        meta.update(extra or {})
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(d for d in directory.iterdir() if STEP_DIR.match(d.name))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final if rank == 0 else None


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------
def _header(f: Path) -> dict:
    """What a shard's safetensors header says it holds: ``{"rank", "coords", "tensors": {name:
    {"dtype", "shape", "slice"}}}``. Reads the header only (JSON, parsed by safetensors); raises
    ``CheckpointError`` for anything that is not a safetensors file written by llmlab."""
    try:
        with safe_open(str(f), framework="pt") as st:
            info = json.loads((st.metadata() or {}).get("llmlab", "null"))
            tensors = {
                n: {"dtype": st.get_slice(n).get_dtype(), "shape": list(st.get_slice(n).get_shape())}
                for n in st.keys()
            }
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{f}: refused, not a safetensors file ({e}); llmlab checkpoints hold "
            f"tensors only and are never unpickled"
        ) from None
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("slices"), dict)
        or set(info["slices"]) != set(tensors)
    ):
        raise CheckpointError(f"{f}: refused, its header does not describe its tensors")
    for n, t in tensors.items():
        t["slice"] = info["slices"][n]
    return {"rank": info.get("rank"), "coords": info.get("coords"), "tensors": tensors}


def verify(path: Path) -> dict:
    """Metadata of a finished checkpoint; raises ``CheckpointError`` naming what is wrong: no or
    corrupted ``metadata.json``, a missing, truncated or corrupted (CRC32) file, a file that is not
    a safetensors shard, or a shard holding other tensors than ``metadata.json`` claims."""
    meta_file = path / "metadata.json"
    if not meta_file.exists():
        raise CheckpointError(f"{path}: no metadata.json (unfinished checkpoint)")
    try:
        meta = json.loads(meta_file.read_text())
        files = meta["files"]
        claims = {
            name: (int(info["bytes"]), int(info["crc32"]), info["tensors"]) for name, info in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path}/metadata.json is corrupted: {type(e).__name__}: {e}") from None
    if not claims:
        raise CheckpointError(f"{path}/metadata.json lists no files")
    for name, (size, crc, tensors) in claims.items():
        f = path / name
        if not SHARD.match(name):
            raise CheckpointError(
                f"{f}: refused, not a rank<NNNNN>.safetensors shard (a checkpoint of "
                f"an older llmlab, in pickle format, is not loaded: saving it again "
                f"needs the code that wrote it)"
            )
        if not f.exists():
            raise CheckpointError(f"{f}: missing")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f}: truncated ({f.stat().st_size} of {size} bytes)")
        if _crc32(f) != crc:
            raise CheckpointError(f"{f}: CRC32 mismatch (corrupted)")
        if _header(f)["tensors"] != tensors:
            raise CheckpointError(f"{f}: refused, it does not hold the tensors metadata.json lists")
    return meta


def latest_checkpoint(directory: str | Path, log=None) -> tuple[Path, dict] | None:
    """Newest checkpoint that verifies; bad ones are reported through ``log`` (default stderr)."""
    directory = Path(directory)
    if not directory.exists():
        return None
    for d in sorted((d for d in directory.iterdir() if STEP_DIR.match(d.name)), reverse=True):
        try:
            return d, verify(d)
        except CheckpointError as e:
            (log or (lambda m: print(m, file=sys.stderr)))(f"skipping checkpoint: {e}")
    return None


def _spec(f: Path, n: str, spec):
    """A slice from JSON: ``None`` or ``(dim, index, parts)`` with ``0 <= index < parts``."""
    if spec is None:
        return None
    if (
        isinstance(spec, list)
        and len(spec) == 3
        and all(type(v) is int for v in spec)
        and spec[0] >= 0
        and 0 <= spec[1] < spec[2]
    ):
        return tuple(spec)
    raise CheckpointError(f"{f}: tensor {n!r} has an invalid slice {spec!r}")


def _assemble(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    """Full tensors, by name, from the slices every shard holds (files already verified)."""
    pieces: dict[str, dict] = {}
    for name, info in meta["files"].items():
        f = path / name
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for n, t in info["tensors"].items():
                pieces.setdefault(n, {})[_spec(f, n, t["slice"])] = st.get_tensor(n)
    full = {}
    for n, parts in pieces.items():
        if None in parts:
            full[n] = parts[None]
            continue
        dim, _, count = next(iter(parts))
        want = [(dim, i, count) for i in range(count)]
        if any(k not in parts for k in want):
            raise CheckpointError(f"{path}: tensor {n!r} lacks slices: has {sorted(parts)}, needs {want}")
        full[n] = torch.cat([parts[k] for k in want], dim=dim)
    return full


@torch.no_grad()
def load_checkpoint(engine: Checkpointable, directory: str | Path, log=None) -> dict | None:
    """Load the newest good checkpoint into ``engine`` (any layout). Returns its metadata, or
    ``None`` when there is none. Raises ``CheckpointError`` if the model does not match."""
    found = latest_checkpoint(directory, log)
    if found is None:
        return None
    path, meta = found
    full = _assemble(path, meta)
    if engine.scaler is not None and meta.get("loss_scaler"):
        engine.scaler.load_state_dict(meta["loss_scaler"])
    engine.optimizer.load_param_state(_lookup(engine, full, path))
    return meta | {"path": str(path)}
