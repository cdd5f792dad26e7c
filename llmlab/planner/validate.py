"""``llmlab plan --validate``: train the planner's top layouts in miniature and compare.

For the local rank count, the layouts the search ranks first (those the trainer accepts, picked
so that consecutive predicted step times differ by at least ``spread``, so that noise on a
loaded machine cannot swap them) each run for real through :func:`llmlab.training.trainer.train`.
Compared, per layout:

* memory per rank: ``params + grads + optimizer_states + activations_peak`` of the metrics JSON
  (``ranks[*].memory_bytes``: exact tensor bytes, :mod:`llmlab.metrics.memory`), the largest over
  ranks, against the planner's ``model_states + activations - recompute_transient`` of the busiest
  rank (buffers are not counted by the trainer and are 0 on a calibrated CPU cluster; the layer
  being recomputed saves its tensors inside backward, which the trainer's counter does not see);
* step time: the median ``step_time_s`` of the steps after ``warmup``, against ``step_time_s``.

Returns ``{"layouts", "memory_max_rel_err", "spearman", "memory_quantity", ...}`` (the JSON's
``"validation"``).
"""

from __future__ import annotations

import statistics

from llmlab.planner.search import search
from llmlab.planner.specs import Workload, from_preset

MEMORY_QUANTITY = (
    "max over ranks of params + grads + optimizer_states + activations_peak "
    "(metrics JSON ranks[*].memory_bytes) vs predicted model_states + activations - recompute_transient"
)


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); ``ValueError`` under 2 points."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("spearman needs two lists of the same length >= 2")

    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


def train_config(row: dict, model: str, workload, steps: int):
    from llmlab.training.config import TrainConfig

    return TrainConfig(
        model=model,
        dp=row["dp"],
        tp=row["tp"],
        pp=row["pp"],
        cp=row["cp"],
        ep=row["ep"],
        zero=row["zero"],
        num_microbatches=row["num_microbatches"],
        virtual_stages=row["virtual_stages"],
        pp_schedule="interleaved" if row["virtual_stages"] > 1 else "1f1b",
        sequence_parallel=row["sequence_parallel"],
        activation_checkpointing=row["recompute"] == "full",
        steps=steps,
        global_batch_size=workload.global_batch_size,
        seq_len=workload.seq_len,
        dtype=workload.dtype,
    )


def pick_layouts(
    rows: list[dict], model: str, workload, steps: int, count: int, spread: float, skip_cp: bool = False
) -> list[dict]:
    """Trainer-valid layouts, best first, each predicted ``spread``× slower than the last
    (without context parallelism when ``skip_cp``)."""
    from llmlab.training.config import validate as validate_cfg

    picked: list[dict] = []
    for row in sorted(rows, key=lambda r: r["step_time_s"]):
        if skip_cp and row["cp"] > 1:
            continue
        try:
            validate_cfg(train_config(row, model, workload, steps))
        except (ValueError, NotImplementedError):
            continue
        if not picked or row["step_time_s"] >= spread * picked[-1]["step_time_s"]:
            picked.append(row)
        if len(picked) == count:
            break
    return picked


def measure(row: dict, model: str, workload, steps: int, warmup: int) -> dict:
    from llmlab.training.trainer import train

    metrics = train(train_config(row, model, workload, steps), progress=False)
    times = [s["step_time_s"] for s in metrics["steps"][warmup:]]
    mem = max(
        sum(r["memory_bytes"][k] for k in ("params", "grads", "optimizer_states", "activations_peak"))
        for r in metrics["ranks"]
    )
    m = row["memory"]
    predicted = m["model_states"] + m["activations"] - m["recompute_transient"]
    label = f"{row['name']} zero{row['zero']} m{row['num_microbatches']}" + (
        " rc" if row["recompute"] == "full" else ""
    )
    return (
        {"label": label}
        | {
            k: row[k]
            for k in ("dp", "tp", "pp", "cp", "ep", "zero", "num_microbatches", "virtual_stages", "recompute")
        }
        | {
            "memory_predicted": predicted,
            "memory_measured": mem,
            "memory_rel_err": abs(predicted - mem) / mem,
            "step_time_predicted_s": row["step_time_s"],
            "step_time_measured_s": statistics.median(times),
            "step_times_measured_s": times,
        }
    )


def validate(
    cluster,
    model: str = "tiny",
    seq_len: int = 256,
    global_batch_size: int = 16,
    count: int = 6,
    spread: float = 1.5,
    steps: int = 8,
    warmup: int = 2,
    on_result=None,
    skip_cp: bool | None = None,
) -> dict:
    """Train up to ``count`` layouts on ``cluster.num_gpus`` local ranks; see the module doc.
    ``on_result(run)`` is called with each layout's comparison as soon as it is measured.

    ``skip_cp`` (default: on a cluster that does not overlap, i.e. CPU ranks) leaves context-
    parallel layouts out: llmlab's ring attention computes explicit score blocks on CPU, a cost
    the calibrated FLOP/s (measured with the fused attention kernel) does not contain, so the
    model is known to under-predict them there (docs/planner.md).

    Raises ``ValueError`` if fewer than 2 layouts can run (no correlation to compute)."""
    if steps <= warmup:
        raise ValueError(f"--validate-steps {steps} must exceed the {warmup} warm-up steps")
    spec = from_preset(model)
    workload = Workload(seq_len, seq_len * global_batch_size, "fp32", "adamw", 1e9).validate()
    rows = search(spec, workload, cluster, max_microbatches=8)
    skip_cp = not cluster.overlap if skip_cp is None else skip_cp
    picked = pick_layouts(rows, model, workload, steps, count, spread, skip_cp)
    if len(picked) < 2:
        raise ValueError(
            f"only {len(picked)} layout(s) of {model} on {cluster.num_gpus} ranks "
            f"can be trained and told apart; validation needs 2"
        )
    runs = []
    for r in picked:
        runs.append(measure(r, model, workload, steps, warmup))
        if on_result is not None:
            on_result(runs[-1])
    return {
        "world_size": cluster.num_gpus,
        "backend": (cluster.op_links or {}).get("backend", "?"),
        "model": model,
        "seq_len": seq_len,
        "global_batch_size": global_batch_size,
        "steps": steps,
        "warmup_steps": warmup,
        "memory_quantity": MEMORY_QUANTITY,
        "skipped_cp": skip_cp,
        "layouts": runs,
        "memory_max_rel_err": max(r["memory_rel_err"] for r in runs),
        "spearman": spearman(
            [r["step_time_predicted_s"] for r in runs], [r["step_time_measured_s"] for r in runs]
        ),
    }
