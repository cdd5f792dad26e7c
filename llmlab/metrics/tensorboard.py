"""TensorBoard scalars of a run, written from the metrics JSON (which stays the contract).

``llmlab train --tensorboard DIR`` writes, per step, ``train/loss``, ``train/grad_norm``,
``train/lr``, ``train/tokens_per_s``, ``train/mfu`` (GPU runs), ``train/skipped`` (0/1),
``train/step_time_s``, and once, at the last step, ``memory/rank{R}/{params,grads,
optimizer_states,activations_peak}`` (bytes); the serving benchmark and server write their gauges
with :func:`write_scalars`. View with ``tensorboard --logdir DIR``. Needs the ``tensorboard``
package (extra ``llmlab[observe]``); :func:`open_writer` says so when it is missing.
"""

from __future__ import annotations

from typing import Any, Mapping

TRAIN_KEYS = ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "skipped", "step_time_s")
MEMORY_KEYS = ("params", "grads", "optimizer_states", "activations_peak")


def open_writer(logdir: str) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``logdir``; ``RuntimeError`` naming the
    package to install when tensorboard is absent."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise RuntimeError(
            "--tensorboard needs the tensorboard package: pip install tensorboard (or llmlab[observe])"
        ) from None
    return SummaryWriter(log_dir=logdir)


def write_scalars(writer: Any, prefix: str, values: Mapping[str, object], step: int) -> int:
    """Add every number of ``values`` (bools as 0/1; ``None`` and non-numbers skipped) as
    ``{prefix}/{key}`` at ``step``; returns how many were written."""
    n = 0
    for k, v in values.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, (int, float)):
            writer.add_scalar(f"{prefix}/{k}", float(v), step)
            n += 1
    return n


def write_train_metrics(metrics: Mapping[str, Any], logdir: str) -> None:
    """The per-step scalars of a training metrics dict (CONTRACT) and each rank's memory."""
    writer = open_writer(logdir)
    try:
        steps = metrics.get("steps") or []
        for rec in steps:
            write_scalars(writer, "train", {k: rec.get(k) for k in TRAIN_KEYS}, rec["step"])
        last = steps[-1]["step"] if steps else 0
        for r in metrics.get("ranks", []):
            mem = r.get("memory_bytes", {})
            write_scalars(writer, f"memory/rank{r['rank']}", {k: mem.get(k) for k in MEMORY_KEYS}, last)
    finally:
        writer.close()


def write_bench(results: Mapping[str, Any], logdir: str) -> None:
    """A ``bench serve`` result dict: each sub-dict (a system offline, a rate over HTTP) becomes
    ``bench/<its key>/<number>``; a list of runs is written one step per run."""
    writer = open_writer(logdir)
    try:
        runs = results if isinstance(results, list) else [results]
        for i, run in enumerate(runs):
            for key, value in run.items():
                if isinstance(value, Mapping):
                    write_scalars(writer, f"bench/{key}", value, i)
            write_scalars(writer, "bench", run, i)
    finally:
        writer.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in ``logdir``'s event files -> ``[(step, value), ...]`` (tensorboard's
    ``EventAccumulator``): what TensorBoard will show."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
