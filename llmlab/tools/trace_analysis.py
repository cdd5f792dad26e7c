"""Reading llmlab's profiler traces (``--profile-dir``) with Holistic Trace Analysis (HTA).

:func:`llmlab_phases` loads every rank's trace with ``hta.trace_analysis.TraceAnalysis`` and keeps
the regions llmlab named (:func:`llmlab.metrics.profiling.phase`) as ``Phase(name, args, start,
end)`` (microseconds). On top of them:

* :func:`ddp_overlap`: how much of data parallelism's gradient communication ran during backward
  (the bucket all-reduces launched inside ``llmlab.backward``, and the share of the
  communication window, first launch to the end of the last wait, that backward covers);
* :func:`pipeline_idle`: each pipeline rank's share of the step outside forward/backward
  actions (waiting on receives, the bubble), to set against ``formulas.pipeline``;
* :func:`engine_breakdown`: where the serving engine's step time goes (schedule, prefill,
  decode, attention, sampling).

On GPUs HTA's own ``get_comm_comp_overlap`` reads the same from the CUDA kernels; on CPU (gloo) a
trace has no kernels, and the named regions are what there is.
Needs ``HolisticTraceAnalysis`` (extra ``llmlab[observe]``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Phase:
    """One named region of one thread: ``name`` (``"ddp bucket all_reduce"``), its ``key=value``
    ``args``, ``start`` and ``end`` in microseconds of the trace's clock."""

    name: str
    args: dict
    start: float
    end: float

    @property
    def dur(self) -> float:
        return self.end - self.start


def _parse(label: str) -> tuple[str, dict]:
    words = label.removeprefix("llmlab.").split(" ")
    args = dict(w.split("=", 1) for w in words if "=" in w)
    return " ".join(w for w in words if "=" not in w), args


def llmlab_phases(trace_dir: str | Path) -> dict[int, list[Phase]]:
    """rank -> its llmlab phases, by start time, as HTA parses the traces in ``trace_dir``."""
    logging.getLogger("hta").setLevel(logging.ERROR)
    from hta.trace_analysis import TraceAnalysis

    # llmlab's traces end with their last recorded step complete: keep it (HTA drops it by default)
    ta = TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=True)
    sym = ta.t.symbol_table.sym_table
    out = {}
    for rank in ta.t.get_ranks():
        df = ta.t.get_trace(rank)
        rows = []
        for name_id, ts, dur in zip(df["name"], df["ts"], df["dur"]):
            label = sym[int(name_id)]
            if label.startswith("llmlab."):
                name, args = _parse(label)
                rows.append(Phase(name, args, float(ts), float(ts) + float(dur)))
        out[int(rank)] = sorted(rows, key=lambda p: p.start)
    return out


def _inside(t: float, spans: list[Phase]) -> bool:
    return any(s.start <= t <= s.end for s in spans)


def _covered(lo: float, hi: float, spans: list[Phase]) -> float:
    """Microseconds of ``[lo, hi]`` covered by ``spans`` (assumed disjoint, as one thread's)."""
    return sum(max(0.0, min(hi, s.end) - max(lo, s.start)) for s in spans)


def ddp_overlap(phases: list[Phase]) -> dict:
    """One rank's data-parallel overlap over the recorded steps: ``buckets`` (bucket all-reduces
    launched per step), ``launched_in_backward`` (per step, those launched while
    ``llmlab.backward`` ran), ``comm_window_us`` and ``overlap_fraction`` (share of the window
    from the first launch to the end of the last bucket wait spent in backward; mean over steps)."""
    steps = [p for p in phases if p.name == "step"] or [Phase("all", {}, -1e300, 1e300)]
    launched, nbuckets, fractions, windows = [], [], [], []
    for st in steps:
        mine = [p for p in phases if st.start <= p.start <= st.end]
        back = [p for p in mine if p.name == "backward"]
        launches = [p for p in mine if p.name == "ddp bucket all_reduce"]
        waits = [p for p in mine if p.name == "ddp bucket wait"]
        if not launches:
            continue
        nbuckets.append(len(launches))
        launched.append(sum(_inside(p.start, back) for p in launches))
        lo, hi = launches[0].start, max(p.end for p in waits + launches)
        windows.append(hi - lo)
        fractions.append(_covered(lo, hi, back) / (hi - lo) if hi > lo else 0.0)
    if not nbuckets:
        raise ValueError(
            "no 'llmlab.ddp bucket all_reduce' in the trace: profile a --dp > 1 run with --dp-mode ddp"
        )
    return {
        "buckets": nbuckets[0],
        "launched_in_backward": launched[0],
        "comm_window_us": sum(windows) / len(windows),
        "overlap_fraction": sum(fractions) / len(fractions),
        "steps": len(nbuckets),
    }


def pipeline_idle(phases: list[Phase]) -> dict:
    """One pipeline rank's time per recorded step: ``compute_us`` (its forward/backward actions),
    ``step_us`` and ``idle_fraction`` = 1 - compute / step (receives waited on, the bubble, the
    flush's bookkeeping), mean over steps."""
    steps = [p for p in phases if p.name == "step"]
    if not steps:
        raise ValueError("no 'llmlab.step' in the trace: a training trace is needed")
    fr, comp = [], []
    for st in steps:
        work = [
            p
            for p in phases
            if p.name in ("forward", "backward") and "action" in p.args and st.start <= p.start <= st.end
        ]
        c = sum(p.dur for p in work)
        comp.append(c)
        fr.append(1 - c / st.dur)
    return {
        "compute_us": sum(comp) / len(comp),
        "step_us": sum(s.dur for s in steps) / len(steps),
        "idle_fraction": sum(fr) / len(fr),
    }


def engine_breakdown(phases: list[Phase]) -> dict[str, float]:
    """Total microseconds of the engine's named phases: ``engine step``, ``schedule``,
    ``prefill``, ``decode`` (a mixed step counts as ``decode+prefill``), ``attention``,
    ``sampling``."""
    out: dict[str, float] = {}
    for p in phases:
        if p.name in (
            "engine step",
            "schedule",
            "prefill",
            "decode",
            "decode+prefill",
            "attention",
            "sampling",
        ):
            out[p.name] = out.get(p.name, 0.0) + p.dur
    return out
