"""Is a directory the same directory on every rank? (multi-node checkpoints need it)

llmlab's checkpoints (:mod:`llmlab.training.checkpoint`) are written by every rank into one
``--checkpoint-dir``, then rank 0 checksums every shard and renames the folder. That works only
if the directory is on a filesystem that every node mounts (NFS, Lustre, GPFS, a cloud file
share): on one node it always is; across nodes a local path such as ``/tmp/ckpt`` is a different
directory on each node, rank 0 would not find the other nodes' shards, and a resume would read
only what its own node wrote. :func:`check_shared_directory` probes this once before training.

Only tensors cross the network here (the token and host names as bytes): nothing received is
unpickled (``broadcast_object_list``/``all_gather_object`` would unpickle what a peer sends).
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
from llmlab.runtime.comm import Group

_HOST_BYTES = 64  # host names travel as fixed-size UTF-8 byte rows


def _device(group: Group) -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(group) == "nccl"
        else torch.device("cpu")
    )


def check_shared_directory(directory: str | os.PathLike[str], group: Group = None) -> None:
    """Collective: rank 0 writes a probe file with a fresh token into ``directory``, every rank
    reads it, and all learn who saw it. Raises ``RuntimeError`` on every rank, naming the ranks
    and hosts that could not see the file, when the directory is not shared by all ranks. A
    no-op outside ``torch.distributed`` or with one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    dev = _device(group)
    raw = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8).to(dev)
    dist.broadcast(raw, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    token = bytes(raw.cpu().tolist()).hex()
    probe = d / f".llmlab-shared-probe-{token}"
    if dist.get_rank(group) == 0:
        probe.write_text(token)
    dist.barrier(group=group)
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    host = socket.gethostname().encode()[: _HOST_BYTES - 1]
    row = torch.zeros(_HOST_BYTES + 1, dtype=torch.uint8)
    row[0] = int(seen)
    row[1 : 1 + len(host)] = torch.tensor(list(host), dtype=torch.uint8)
    rows = [torch.empty_like(row, device=dev) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, row.to(dev), group=group)
    views = [(bool(r[0]), bytes(r[1:].cpu().tolist()).rstrip(b"\0").decode(errors="replace")) for r in rows]
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        probe.unlink(missing_ok=True)
    blind = [(r, host) for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        hosts = sorted({h for _, h in blind})
        raise RuntimeError(
            f"checkpoint directory {str(d)!r} is not shared by every rank: ranks "
            f"{[r for r, _ in blind]} (on {', '.join(hosts)}) cannot see a file rank 0 wrote there. "
            f"Multi-node checkpoints need a filesystem all nodes mount (NFS, Lustre, a cloud "
            f"file share); pass a --checkpoint-dir on it"
        )
