"""When a training run saves a checkpoint, and what it records about the run beside the tensors.

A checkpoint is written every ``--checkpoint-every`` steps, every ``--checkpoint-every-minutes``
minutes of training (the source articles' practice: a snapshot every 30-60 minutes, so a lost node
costs at most that much work whatever the step time), and after the last step. Saving is
collective, so every rank must decide the same: the minutes are read on rank 0's clock and its
decision is broadcast (one 1-element broadcast a step, only when the minutes are set).

Each checkpoint's ``metadata.json`` then records (:meth:`CheckpointClock.record`), as in the
articles' metadata example (step, loss and hardware metrics): ``saved_at`` (UTC wall-clock time,
ISO 8601) and ``saved_at_unix`` (s), ``elapsed_training_s`` (training time up to this step,
summed over every resumed run: the time between the last checkpoint and a crash is not counted,
it was lost), and ``hardware`` (host name, nodes, world size, backend, device, CPU cores, torch,
the last step's time and tokens/s).
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from llmlab.runtime.hardware import usable_cores


class CheckpointClock:
    """The save schedule of one run: ``every`` steps, ``minutes`` of training, and ``last`` (the
    final step). ``resumed``: the metadata of the checkpoint this run resumed from, if any (its
    ``elapsed_training_s`` is carried on). ``device``: where the broadcast tensor lives."""

    def __init__(
        self,
        directory: str | None,
        every: int,
        minutes: float,
        last: int,
        resumed: dict | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.directory, self.every, self.minutes, self.last = directory, every, minutes, last
        self.device = torch.device(device)
        self.start = time.monotonic()
        self.previous = float((resumed or {}).get("elapsed_training_s") or 0.0)
        self.last_save = self.start

    def elapsed(self) -> float:
        """Training time in seconds up to now, over this run and the runs it resumed."""
        return self.previous + time.monotonic() - self.start

    def due(self, step: int) -> bool:
        """Whether to save after ``step``; the same answer on every rank (collective when the
        minutes are set: every rank must call it each step)."""
        if not self.directory:
            return False
        due = step == self.last or bool(self.every and step % self.every == 0)
        if self.minutes > 0:
            late = time.monotonic() - self.last_save >= 60 * self.minutes
            if dist.is_initialized() and dist.get_world_size() > 1:
                flag = torch.tensor([float(late)], device=self.device)
                dist.broadcast(flag, src=0)  # rank 0's clock decides for every rank
                late = bool(flag.item())
            due = due or late
        if due:
            self.last_save = time.monotonic()
        return due

    def record(self, step_record: dict) -> dict:
        """What this checkpoint's ``metadata.json`` records beside the tensors (module docstring)."""
        now = time.time()
        return {
            "saved_at": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
            "saved_at_unix": now,
            "elapsed_training_s": self.elapsed(),
            "hardware": hardware_summary(step_record),
        }


def hardware_summary(step_record: dict | None = None) -> dict:
    """The job's hardware as one rank sees it: host, nodes (torchrun's ``WORLD_SIZE /
    LOCAL_WORLD_SIZE``), world size, backend, device (GPU name or ``cpu``), usable CPU cores,
    torch version; with ``step_record``, its ``step_time_s`` and ``tokens_per_s``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cuda = torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"
    out = {
        "host": socket.gethostname(),
        "nodes": max(1, world // max(1, local)),
        "world_size": world,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cpu_cores": usable_cores(),
        "torch": torch.__version__,
    }
    for k in ("step_time_s", "tokens_per_s"):
        if step_record and k in step_record:
            out[k] = step_record[k]
    return out
