"""A serving dashboard that updates live while the engine runs, fed by each engine step.

Five panels against the engine step: sequences running / waiting, tokens computed per step (all /
prefill), KV-cache blocks in use (% of the pool, preemptions marked), and the TTFT and TPOT of each
request as it finishes, with running p50 / p99 lines (definitions: :mod:`llmlab.inference.metrics`,
as in vLLM's ``benchmark_serving``). Drawing is :class:`~llmlab.viz.live.LivePlot`'s (one display
handle updated in place, passes nbval; ``LLMLAB_LIVE=0`` draws once at :meth:`finish`).

Driven from the notebook loop, with what the engine already exposes::

    dash = ServingDashboard()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        dash.update(engine.step_metrics[-1], outputs)
    dash.finish()
    dash.summary()     # {"ttft_s": {"p50", "p99"}, "tpot_s": ..., "num_finished", ...}

or ``LLMEngine(on_step=dash.on_step)`` for the step panels alone. The data (``dash.steps``,
``dash.finished``) are plain lists of dicts, in seconds, so they can be tested and exported.
"""

from __future__ import annotations

from llmlab.inference.metrics import p50_p99
from llmlab.viz.live import LivePlot

PANELS = {
    "seqs": "sequences",
    "tokens": "tokens per step",
    "kv": "KV blocks in use",
    "ttft": "TTFT of finished requests",
    "tpot": "TPOT of finished requests",
}
UNITS = {"seqs": "requests", "tokens": "tokens", "kv": "% of the pool", "ttft": "ms", "tpot": "ms"}


class ServingDashboard(LivePlot):
    """Live serving metrics of one engine run.

    ``update(step_metrics, outputs)``: ``step_metrics`` a :class:`~llmlab.inference.StepMetrics`
    (a step already seen is ignored, so passing ``engine.step_metrics[-1]`` after an empty step is
    safe), ``outputs`` the :class:`~llmlab.inference.RequestOutput` list ``engine.step()`` returned;
    each finished request is recorded once. ``interval``: seconds between redraws.
    """

    def __init__(
        self,
        title: str | None = "serving: live engine metrics",
        interval: float = 0.5,
        figsize: tuple[float, float] = (10.0, 5.6),
    ):
        super().__init__(
            list(PANELS.values()),
            title=title,
            interval=interval,
            figsize=figsize,
            ylabels={PANELS[k]: u for k, u in UNITS.items()},
            ncols=3,
        )
        self.steps: list[dict] = []  # one dict per engine step
        self.finished: list[dict] = []  # one dict per finished request, in finishing order
        self._seen: set[str] = set()
        self._last_step = 0

    # --- data ---------------------------------------------------------------------------------
    def on_step(self, m) -> None:
        """Record one :class:`StepMetrics` (usable as ``LLMEngine(on_step=dash.on_step)``)."""
        if m is None or m.step <= self._last_step:
            return
        self._last_step = m.step
        rec = {
            "step": m.step,
            "duration_s": m.duration_s,
            "num_running": m.num_running,
            "num_waiting": m.num_waiting,
            "num_seqs": m.num_seqs,
            "num_batched_tokens": m.num_batched_tokens,
            "num_prefill_tokens": m.num_prefill_tokens,
            "kv_usage": m.kv_blocks_used / m.kv_blocks_total if m.kv_blocks_total else 0.0,
            "num_preemptions": m.num_preemptions,
        }
        self.steps.append(rec)
        P = PANELS
        LivePlot.update(self, {"step": m.step, P["seqs"]: m.num_running}, label="running")
        LivePlot.update(self, {"step": m.step, P["seqs"]: m.num_waiting}, label="waiting")
        LivePlot.update(self, {"step": m.step, P["tokens"]: m.num_batched_tokens}, label="all")
        LivePlot.update(self, {"step": m.step, P["tokens"]: m.num_prefill_tokens}, label="prefill")
        LivePlot.update(self, {"step": m.step, P["kv"]: 100.0 * rec["kv_usage"]})

    def on_outputs(self, outputs) -> None:
        """Record the finished requests among ``outputs`` (each once)."""
        for o in outputs or ():
            if not o.finished or o.request_id in self._seen:
                continue
            self._seen.add(o.request_id)
            mt = o.metrics
            rec = {
                "request_id": o.request_id,
                "step": self._last_step,
                "ttft_s": mt.ttft,
                "tpot_s": mt.tpot,
                "num_output_tokens": mt.num_output_tokens,
                "e2e_s": None if mt.finish_time is None else mt.finish_time - mt.arrival_time,
            }
            self.finished.append(rec)
            P = PANELS
            if rec["ttft_s"] is not None:
                LivePlot.update(self, {"step": rec["step"], P["ttft"]: 1e3 * rec["ttft_s"]}, label="request")
            if rec["tpot_s"] is not None:
                LivePlot.update(self, {"step": rec["step"], P["tpot"]: 1e3 * rec["tpot_s"]}, label="request")

    def update(self, step_metrics=None, outputs=()) -> None:
        """Record one engine step and the requests it finished, then redraw if it is time."""
        self.on_step(step_metrics)
        self.on_outputs(outputs)

    def summary(self) -> dict:
        """``{"ttft_s", "tpot_s", "e2e_s"}`` (each ``{"p50", "p99"}``, seconds) over the finished
        requests, plus ``num_finished``, ``num_steps``, ``max_kv_usage`` (fraction of blocks),
        ``num_preemptions`` and ``max_batched_tokens``."""
        return {
            "ttft_s": p50_p99(r["ttft_s"] for r in self.finished),
            "tpot_s": p50_p99(r["tpot_s"] for r in self.finished),
            "e2e_s": p50_p99(r["e2e_s"] for r in self.finished),
            "num_finished": len(self.finished),
            "num_steps": len(self.steps),
            "max_kv_usage": max((s["kv_usage"] for s in self.steps), default=0.0),
            "num_preemptions": sum(s["num_preemptions"] for s in self.steps),
            "max_batched_tokens": max((s["num_batched_tokens"] for s in self.steps), default=0),
        }

    # --- drawing ------------------------------------------------------------------------------
    def _decorate(self, name: str, ax) -> None:
        ax.set_xlabel("engine step")
        key = {PANELS["ttft"]: "ttft_s", PANELS["tpot"]: "tpot_s"}.get(name)
        if key is not None:
            for line in ax.get_lines():
                line.set_linestyle("none")
                line.set_marker(".")
            pct = p50_p99(r[key] for r in self.finished)
            for q, style in (("p50", "-"), ("p99", "--")):
                v = pct[q]
                if v is not None:
                    ax.axhline(
                        1e3 * v, color="k", linestyle=style, linewidth=1, label=f"{q} {1e3 * v:.1f} ms"
                    )
        elif name == PANELS["kv"]:
            ax.set_ylim(0, 105)
            pre = [s["step"] for s in self.steps if s["num_preemptions"]]
            if pre:
                ax.plot(pre, [100.0] * len(pre), "rv", label="preemption")
