"""Is a directory the same directory on every rank? (multi-node checkpoints need it)

llmlab's checkpoints (:mod:`llmlab.training.checkpoint`) are written by every rank into one
``--checkpoint-dir``, then rank 0 checksums every shard and renames the folder. That works only
if the directory is on a filesystem that every node mounts (NFS, Lustre, GPFS, a cloud file
share): on one node it always is; across nodes a local path such as ``/tmp/ckpt`` is a different
directory on each node, rank 0 would not find the other nodes' shards, and a resume would read
only what its own node wrote. :func:`check_shared_directory` probes this once before training.
"""
from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import torch.distributed as dist


def check_shared_directory(directory: str | os.PathLike, group=None) -> None:
    """Collective: rank 0 writes a probe file with a fresh token into ``directory``, every rank
    reads it, and all learn who saw it. Raises ``RuntimeError`` on every rank, naming the ranks
    and hosts that could not see the file, when the directory is not shared by all ranks. A
    no-op outside ``torch.distributed`` or with one rank."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    token = [uuid.uuid4().hex if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group else 0,
                               group=group)
    probe = d / f".llmlab-shared-probe-{token[0]}"
    if dist.get_rank(group) == 0:
        probe.write_text(token[0])
    dist.barrier(group=group)
    try:
        seen = probe.read_text() == token[0]
    except OSError:
        seen = False
    views = [None] * dist.get_world_size(group)
    dist.all_gather_object(views, (seen, socket.gethostname()), group=group)
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
            f"file share); pass a --checkpoint-dir on it")
