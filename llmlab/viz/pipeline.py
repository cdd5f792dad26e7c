"""Gantt charts of pipeline schedules: simulated (unit costs) or recorded on real ranks.

A timeline is a list with one entry per rank, each a list of events ``(op, chunk, mb, t0, t1)``
with ``op`` in ``F``, ``B``, ``send``, ``recv`` and times in seconds (or unit costs). That is
what :func:`llmlab.parallel.pipeline_schedules.simulate` returns under ``"timeline"`` and what
the trainer's metrics hold under ``pipeline.per_rank[r].timeline[step].events``.

Example::

    fig, ax = plt.subplots()
    draw_timeline(simulate(build_schedule("1f1b", 4, 8))["timeline"], ax, title="1F1B")
"""

from __future__ import annotations

COLORS = {
    "F": ("#9ecae1", "#3182bd", "#08519c", "#6baed6"),
    "B": ("#a1d99b", "#31a354", "#006d2c", "#74c476"),
    "send": ("#fd8d3c",),
    "recv": ("#e6550d",),
}


def timeline_from_metrics(metrics: dict, step: int = -1) -> list[list]:
    """The recorded timeline of one step (default: the last) from ``llmlab.train``'s metrics."""
    return [per["timeline"][step]["events"] for per in metrics["pipeline"]["per_rank"]]


def draw_timeline(
    timeline: list[list], ax=None, title: str | None = None, unit: str = "s", show_comm: bool = True
):
    """Draw one row per rank (rank 0 on top): forward (blue) and backward (green) bars labelled
    with the micro-batch (``chunk.mb`` when there are several chunks), p2p waits in orange/red,
    idle time left white. Returns the matplotlib axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.5 + 0.5 * len(timeline)))
    p = len(timeline)
    end = max((e[4] for tl in timeline for e in tl), default=1.0)
    chunks = max((e[1] for tl in timeline for e in tl if e[0] in ("F", "B")), default=0) + 1
    for r, events in enumerate(timeline):
        y = p - 1 - r
        for op, chunk, mb, t0, t1 in events:
            if op in ("send", "recv") and not show_comm:
                continue
            colors = COLORS.get(op, ("#999999",))
            h = 0.8 if op in ("F", "B") else 0.3
            ax.barh(
                y,
                t1 - t0,
                left=t0,
                height=h,
                color=colors[chunk % len(colors)],
                edgecolor="black" if op in ("F", "B") else "none",
                linewidth=0.3,
            )
            if op in ("F", "B") and (t1 - t0) > end / 60:
                label = f"{chunk}.{mb}" if chunks > 1 else str(mb)
                ax.text((t0 + t1) / 2, y, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(p))])
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time ({unit})")
    if title:
        ax.set_title(title, fontsize=10)
    handles = [Patch(color=COLORS["F"][1], label="forward"), Patch(color=COLORS["B"][1], label="backward")]
    if show_comm:
        handles += [
            Patch(color=COLORS["send"][0], label="send"),
            Patch(color=COLORS["recv"][0], label="recv wait"),
        ]
    ax.legend(handles=handles, fontsize=7, loc="upper right", ncol=len(handles))
    return ax


def measured_bubble(metrics: dict, skip: int = 1) -> float:
    """The bubble measured on the ranks of one pipeline run (a fraction of the flush time).

    Per rank and step the runner records ``1 - (forward + backward time) / flush time``: every
    moment a rank is not computing (waiting on a receive, posting a send, idle) is bubble. This
    takes each rank's **median** over the steps after the first ``skip`` (the first includes
    connection set-up; a median ignores a step slowed by another process) and averages the
    ranks, which is what :func:`~llmlab.parallel.pipeline_schedules.bubble_fraction_theory`
    predicts when stages cost the same and messages are free.
    ``metrics``: ``llmlab.train``'s metrics (``assemble_metrics``) of a run with ``pp > 1``.
    """
    import statistics

    per_rank = [r["bubble_fraction_per_step"] for r in metrics["pipeline"]["per_rank"]]
    return sum(statistics.median(b[skip:] or b) for b in per_rank) / len(per_rank)


def compute_time_spread(metrics: dict, skip: int = 1) -> float:
    """How steady the ranks' compute was in a pipeline run: for each (rank, model chunk, F or B)
    the interquartile range of its durations over micro-batches and steps (after the first
    ``skip``), divided by their median; the median of those ratios over the groups.

    On a machine that gives every rank its own core the same forward takes the same time, and this
    is a few percent; when other processes time-share the cores it rises to 0.5 or more, and a rank
    that waits lends its core to one that computes, so idle time is no longer the schedule's.
    """
    import statistics

    ratios = []
    for per in metrics["pipeline"]["per_rank"]:
        groups: dict[tuple, list[float]] = {}
        for step in per["timeline"][skip:] or per["timeline"]:
            for op, chunk, _mb, t0, t1 in step["events"]:
                if op in ("F", "B"):
                    groups.setdefault((op, chunk), []).append(t1 - t0)
        for d in groups.values():
            if len(d) >= 4:
                q1, med, q3 = statistics.quantiles(d, n=4)
                ratios.append((q3 - q1) / med if med > 0 else 0.0)
    return statistics.median(ratios) if ratios else 0.0
