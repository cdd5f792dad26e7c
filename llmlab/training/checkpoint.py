"""Fault-tolerant, reshardable training checkpoints.

Layout of ``--checkpoint-dir``::

    step_00000010/
        metadata.json      step, loss, layout, world size, files with their CRC32 and size
        rank00000.pt       this rank's tensors, each under its *full-model* name with its slice
        ...

* Atomic: ranks write into ``step_XXXXXXXX.tmp``; when every file is written and checksummed,
  rank 0 writes ``metadata.json`` and renames the directory. A half-written checkpoint is never
  named like a finished one, so it is never the latest.
* Verified: loading recomputes every file's CRC32 (as the seed document's deployment practice
  does); a corrupted or truncated checkpoint is reported and the previous good one is used.
* Kept: the newest ``keep`` (3) finished checkpoints; older ones are deleted after a save.
* Reshardable: every tensor is stored under its name in the full model (``model.layers.3...``,
  whatever stage holds layer 3) with the slice this rank holds (``dim``, ``index``, ``parts`` for
  a tensor-parallel shard, none for a whole tensor). Loading assembles the full tensors and cuts
  the slices the *new* layout needs, so a checkpoint saved at dp2×tp2 resumes at tp4 or on one rank.
  Optimizer states (Adam ``exp_avg``, ``exp_avg_sq``, ``step``, and fp32 master weights under
  mixed precision) travel the same way.
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

import torch
import torch.distributed as dist

STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be mapped onto this model."""


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
    raise CheckpointError(f"cannot express a local tensor of shape {local_shape} as a slice of the "
                          f"full shape {full_shape} with tp={tp}")


def _cut(full: torch.Tensor, spec) -> torch.Tensor:
    if spec is None:
        return full
    dim, index, parts = spec
    return full.chunk(parts, dim=dim)[index]


def _optimizer_views(engine):
    """``[(param, state_dict_of_param)]`` over the model parameters of this rank, and how to
    install state (mixed precision keeps the state on fp32 masters)."""
    opt = engine.optimizer
    masters = getattr(opt, "master", None)
    inner = getattr(opt, "optimizer", opt)
    params = getattr(opt, "params", None) or [p for g in inner.param_groups for p in g["params"]]
    targets = masters if masters is not None else params
    return list(zip(params, targets)), inner


def _collect(engine) -> tuple[dict, dict]:
    names = full_names(engine.model)
    tensors, slices = {}, {}
    tp_i, tp = engine.mesh.coords["tp"], engine.mesh.tp
    pairs, inner = _optimizer_views(engine)
    for p, target in pairs:
        n = names[id(p)]
        spec = slice_spec(p.shape, engine.full_shapes[n], tp_i, tp)
        tensors[n] = p.detach().to("cpu").clone()
        slices[n] = spec
        if target is not p:
            tensors[f"{n}::master"] = target.detach().to("cpu").clone()
            slices[f"{n}::master"] = spec
        for k, v in inner.state.get(target, {}).items():
            if isinstance(v, torch.Tensor):
                tensors[f"{n}::{k}"] = v.detach().to("cpu").clone()
                slices[f"{n}::{k}"] = spec if v.dim() else None
    return tensors, slices


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


def save_checkpoint(engine, step: int, loss: float, directory: str | Path, keep: int = 3) -> Path | None:
    """Collectively save this step. Ranks holding a distinct part of the model write a file
    (data-parallel replicas do not repeat it). Returns the finished directory (on rank 0)."""
    if getattr(engine.cfg, "zero", 0):
        raise NotImplementedError("checkpoints of ZeRO-sharded optimizers are not supported yet")
    directory = Path(directory)
    mesh = engine.mesh
    final = directory / f"step_{step:08d}"
    tmp = directory / f"step_{step:08d}.tmp"
    rank = mesh.rank
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier()
    writer = mesh.coords["dp"] < mesh.ep  # one copy per distinct shard (experts differ across ep)
    if writer:
        tensors, slices = _collect(engine)
        torch.save({"rank": rank, "coords": dict(mesh.coords), "tensors": tensors, "slices": slices,
                    "rng": torch.get_rng_state()}, tmp / f"rank{rank:05d}.pt")
    _barrier()
    if rank == 0:
        files = {f.name: {"crc32": _crc32(f), "bytes": f.stat().st_size} for f in sorted(tmp.glob("rank*.pt"))}
        cfg = engine.cfg
        meta = {"step": step, "loss": loss, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "layout": {k: getattr(cfg, k) for k in ("dp", "tp", "pp", "ep", "zero", "dtype")},
                "model": cfg.model, "seed": cfg.seed, "next_data_step": step + 1, "files": files}
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
def verify(path: Path) -> dict:
    """Metadata of a finished checkpoint; raises ``CheckpointError`` naming what is wrong."""
    meta_file = path / "metadata.json"
    if not meta_file.exists():
        raise CheckpointError(f"{path}: no metadata.json (unfinished checkpoint)")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}/metadata.json is corrupted: {e}") from None
    for name, info in meta["files"].items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{f}: missing")
        if f.stat().st_size != info["bytes"]:
            raise CheckpointError(f"{f}: truncated ({f.stat().st_size} of {info['bytes']} bytes)")
        if _crc32(f) != info["crc32"]:
            raise CheckpointError(f"{f}: CRC32 mismatch (corrupted)")
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


def _assemble(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    pieces: dict[str, dict] = {}
    for name in meta["files"]:
        blob = torch.load(path / name, map_location="cpu", weights_only=False)
        for n, t in blob["tensors"].items():
            spec = blob["slices"][n]
            entry = pieces.setdefault(n, {})
            entry[None if spec is None else (spec[0], spec[1], spec[2])] = t
    full = {}
    for n, parts in pieces.items():
        if None in parts:
            full[n] = parts[None]
        else:
            (dim, _, count) = next(iter(parts))
            full[n] = torch.cat([parts[(dim, i, count)] for i in range(count)], dim=dim)
    return full


@torch.no_grad()
def load_checkpoint(engine, directory: str | Path, log=None) -> dict | None:
    """Load the newest good checkpoint into ``engine`` (any layout). Returns its metadata, or
    ``None`` when there is none. Raises ``CheckpointError`` if the model does not match."""
    if getattr(engine.cfg, "zero", 0):
        raise NotImplementedError("checkpoints of ZeRO-sharded optimizers are not supported yet")
    found = latest_checkpoint(directory, log)
    if found is None:
        return None
    path, meta = found
    full = _assemble(path, meta)
    names = full_names(engine.model)
    tp_i, tp = engine.mesh.coords["tp"], engine.mesh.tp
    pairs, inner = _optimizer_views(engine)
    for p, target in pairs:
        n = names[id(p)]
        if n not in full:
            raise CheckpointError(f"{path} has no tensor {n!r} (different model?)")
        spec = slice_spec(p.shape, engine.full_shapes[n], tp_i, tp)
        p.copy_(_cut(full[n], spec).to(p.dtype))
        if target is not p:
            target.copy_(_cut(full.get(f"{n}::master", full[n]), spec).to(target.dtype))
        state = {}
        for key in ("step", "exp_avg", "exp_avg_sq"):
            t = full.get(f"{n}::{key}")
            if t is not None:
                # Adam keeps its step counter on the CPU unless capturable; moments on the device.
                state[key] = t.clone() if t.dim() == 0 else _cut(t, spec).clone().to(target.device)
        if state:
            inner.state[target] = state
    return meta | {"path": str(path)}
