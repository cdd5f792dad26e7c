"""Live routing heat-map for mixture-of-experts training (tokens per expert, per layer).

``RoutingHeatmap().update(record)`` takes the per-step records of ``llmlab.train`` for a MoE
model (they carry ``tokens_per_expert``: ``[layers][experts]`` token counts of that step, see
:func:`llmlab.model.moe.collect_moe_stats`) and redraws, in place, the heat-map of the step's
routing next to the load imbalance (max/mean tokens per expert, mean over layers) so far. Same display-handle
mechanism as every llmlab live plot (:class:`llmlab.viz.live.LiveFigure`), so it passes nbval.
"""

from __future__ import annotations

from llmlab.viz.live import LiveFigure, pyplot


class RoutingHeatmap(LiveFigure):
    """Heat-map ``layers x experts`` of the last step's token counts, plus imbalance vs step."""

    def __init__(self, title: str | None = None, interval: float = 0.25):
        fig, (self.ax_map, self.ax_imb) = pyplot().subplots(
            1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [1, 1.3]}
        )
        if title:
            fig.suptitle(title)
        self.steps: list[int] = []
        self.imbalance: list[float] = []
        self.counts = None
        self._show(fig, interval)

    def update(self, record: dict) -> None:
        if "tokens_per_expert" not in record:
            return
        self.counts = record["tokens_per_expert"]
        self.steps.append(record.get("step", len(self.steps) + 1))
        self.imbalance.append(record["imbalance"])
        self._maybe_draw()

    def _draw(self) -> None:
        if self.counts is None:
            return
        self.ax_map.clear()
        self.ax_map.imshow(self.counts, aspect="auto", cmap="viridis")
        for i, row in enumerate(self.counts):
            for j, c in enumerate(row):
                self.ax_map.text(j, i, str(c), ha="center", va="center", color="w", fontsize=7)
        self.ax_map.set_xlabel("expert")
        self.ax_map.set_ylabel("layer")
        self.ax_map.set_title(f"tokens per expert, step {self.steps[-1]}")
        self.ax_imb.clear()
        self.ax_imb.plot(self.steps, self.imbalance)
        self.ax_imb.axhline(1.0, color="gray", lw=0.8, ls="--")
        self.ax_imb.set_xlabel("step")
        self.ax_imb.set_title("imbalance (max/mean, mean over layers)")
        self._publish()
