"""Live notebook plots that also leave a static figure when run headless (nbval, nbconvert).

The figure is shown once with ``display(fig, display_id=True)`` and then redrawn in place with
``handle.update(fig)`` at most every ``interval`` seconds. nbval compares only the first display
and ignores updates, so the cell passes; ``clear_output`` loops would not (measured under nbval).
``LLMLAB_LIVE=0`` skips intermediate redraws.

Example::

    plot = LivePlot(["loss", "tokens_per_s"])
    llmlab.train(cfg, progress=False, on_step=plot.update)
    plot.finish()
"""

from __future__ import annotations

import os
import time
from collections import defaultdict


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        return ip is not None and "IPKernelApp" in ip.config
    except ImportError:
        return False


STYLE = {
    # One look for every llmlab figure: readable in a notebook column, light grid, no top/right
    # frame, the same colour cycle. Applied by :func:`use_style` (on importing llmlab.viz).
    "figure.dpi": 100,
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "xtick.labelsize": 9,
    "ytick.labelsize": 9,
    "legend.fontsize": 8,
    "legend.frameon": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.6,
    "lines.markersize": 5,
    "figure.titlesize": 11,
}
# Axis labels of the metrics llmlab's records carry (``llmlab.train(on_step=...)``, the trainer's
# metrics JSON), used when ``LivePlot(ylabels=...)`` does not name one.
UNITS = {
    "loss": "nats/token",
    "tokens_per_s": "tokens/s",
    "step_time_s": "s",
    "mfu": "fraction of peak",
    "lb_loss": "balancing loss",
    "imbalance": "max / mean tokens per expert",
}
WIDTH = 10.0  # inches: a figure this wide fits a notebook column without shrinking its text


def use_style() -> None:
    """Apply :data:`STYLE` to matplotlib (all later figures)."""
    import matplotlib

    matplotlib.rcParams.update(STYLE)  # type: ignore[arg-type]  # the stub takes only Literal key names


class LiveFigure:
    """What every llmlab live plot shares: ``self.fig`` is shown once (``display_id``) and redrawn
    in place by the subclass's ``_draw`` at most every ``interval`` seconds while work runs; with
    ``LLMLAB_LIVE=0`` only :meth:`finish` draws (nbval keeps one static figure)."""

    def _show(self, fig, interval: float) -> None:
        import matplotlib.pyplot as plt

        self.fig, self.interval, self._last = fig, interval, 0.0
        plt.close(fig)  # the inline backend must not show it a second time
        self.live = os.environ.get("LLMLAB_LIVE", "1") != "0"
        self.handle = None
        if _in_notebook():
            from IPython.display import display

            self.handle = display(fig, display_id=True)

    def _maybe_draw(self) -> None:
        if self.live and time.monotonic() - self._last >= self.interval:
            self._draw()

    def _publish(self) -> None:
        """End of a ``_draw``: lay out and push the figure to its display."""
        self.fig.tight_layout()
        if self.handle is not None:
            self.handle.update(self.fig)
        self._last = time.monotonic()

    def _draw(self) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Draw the final state (always, even with ``LLMLAB_LIVE=0``)."""
        self._draw()


def pyplot():
    """``matplotlib.pyplot``, on the Agg backend outside notebooks (no window, no display)."""
    import matplotlib

    if not _in_notebook():
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


class LivePlot(LiveFigure):
    """Line plots of named series against ``step``, one panel per series, redrawn while work runs.

    ``update(record)`` takes a dict with ``step`` (or the key named by ``x``) and any of the series
    names (e.g. the records ``llmlab.train(on_step=...)`` produces); ``update(record, label="rank
    1")`` draws several lines per panel. ``finish()`` draws the final state. Works outside
    notebooks (no display).

    ``ylabels``: axis label per series (units: "MiB", "ms", "%"); ``xlabel``: the x axis label;
    ``ncols``: panels per row (more panels wrap onto further rows); ``markers``: draw points too;
    ``xticks``: ``{x value: tick label}`` for every panel (e.g. ``{64: "all at once"}`` for a
    request rate of infinity plotted at 64, or layer names for event numbers), replacing the
    automatic ticks; ``legend_outside``: one legend, right of the last panel, instead of one
    inside each (when every panel has the same lines and a legend would cover them).
    """

    def __init__(
        self,
        series: list[str],
        title: str | None = None,
        interval: float = 0.25,
        figsize: tuple[float, float] | None = None,
        logy: tuple[str, ...] = (),
        ylabels: dict[str, str] | None = None,
        x: str = "step",
        xlabel: str | None = None,
        ncols: int = 3,
        logx: bool = False,
        markers: bool = False,
        xticks: dict[float, str] | None = None,
        legend_outside: bool = False,
    ):
        import math

        plt = pyplot()
        use_style()
        self.series, self.logy = list(series), set(logy)
        self.ylabels, self.x, self.xlabel = UNITS | dict(ylabels or {}), x, xlabel or x
        self.logx, self.markers, self.xticks = logx, markers, dict(xticks or {})
        self.legend_outside = legend_outside
        self.data: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        ncols = max(1, min(ncols, len(series)))
        nrows = math.ceil(len(series) / ncols)
        if figsize is None:
            figsize = (min(WIDTH, 3.6 * ncols), 2.8 * nrows + (0.3 if title else 0.0))
        fig, axes = plt.subplots(nrows, ncols, figsize=figsize, squeeze=False)
        flat = list(axes.flat)
        for ax in flat[len(series) :]:
            ax.set_visible(False)
        self.axes = dict(zip(series, flat))
        if title:
            fig.suptitle(title)
        self._show(fig, interval)

    def update(self, record: dict, label: str = "") -> None:
        for name in self.series:
            if name in record and record[name] is not None:
                self.data[name][label].append(
                    (record.get(self.x, len(self.data[name][label]) + 1), record[name])
                )
        self._maybe_draw()

    def _draw(self) -> None:
        for name, ax in self.axes.items():
            ax.clear()
            for label, pts in self.data[name].items():
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, label=label or None, marker="o" if self.markers else None)
            ax.set_title(name)
            ax.set_xlabel(self.xlabel)
            if name in self.ylabels:
                ax.set_ylabel(self.ylabels[name])
            if name in self.logy:
                ax.set_yscale("log")
            if self.logx:
                ax.set_xscale("log", base=2)
            if self.xticks:
                from matplotlib.ticker import NullLocator

                ax.set_xticks(list(self.xticks), list(self.xticks.values()))
                ax.xaxis.set_minor_locator(NullLocator())
            elif self.x == "step" and not self.logx:  # steps are whole numbers: no tick at 2.5
                from matplotlib.ticker import MaxNLocator

                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            self._decorate(name, ax)
            if any(self.data[name].keys() - {""}) or ax.get_legend_handles_labels()[1]:
                if not self.legend_outside:
                    ax.legend(fontsize=8)
                elif name == self.series[-1]:
                    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
        self._publish()

    def _decorate(self, name: str, ax) -> None:
        """Subclasses add to panel ``name`` after its lines are drawn (reference lines, markers)."""


class LiveBars(LiveFigure):
    """Stacked bars, one per group, drawn as each group's values arrive (e.g. the memory per rank
    of each configuration as its run finishes), with an optional reference mark per group (the
    formula). Same display mechanics as :class:`LivePlot`.

    ``update(group, {kind: value}, reference=None)`` adds or replaces a bar; ``finish()`` draws
    the final state.
    """

    def __init__(
        self,
        kinds: list[str],
        title: str | None = None,
        ylabel: str = "",
        figsize: tuple[float, float] | None = None,
        interval: float = 0.0,
        reference_label: str = "formula",
    ):
        plt = pyplot()
        use_style()
        self.kinds, self.title, self.ylabel = list(kinds), title, ylabel
        self.reference_label = reference_label
        self.groups: dict[str, dict[str, float]] = {}
        self.refs: dict[str, float] = {}
        fig, self.ax = plt.subplots(figsize=figsize or (7.0, 3.2))
        self._show(fig, interval)

    def update(self, group: str, values: dict, reference: float | None = None) -> None:
        self.groups[group] = {k: float(values.get(k, 0.0)) for k in self.kinds}
        if reference is not None:
            self.refs[group] = float(reference)
        self._maybe_draw()

    def _draw(self) -> None:
        ax = self.ax
        ax.clear()
        names = list(self.groups)
        bottom = [0.0] * len(names)
        for k in self.kinds:
            vals = [self.groups[n][k] for n in names]
            ax.bar(names, vals, bottom=bottom, label=k)
            bottom = [b + v for b, v in zip(bottom, vals)]
        xs = [i for i, n in enumerate(names) if n in self.refs]
        if xs:
            ax.hlines(
                [self.refs[names[i]] for i in xs],
                [i - 0.4 for i in xs],
                [i + 0.4 for i in xs],
                colors="k",
                linewidth=2,
                label=self.reference_label,
            )
        ax.set_ylabel(self.ylabel)
        if self.title:
            ax.set_title(self.title)
        if names:  # outside the axes, right of them: a legend never covers a bar
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
            ax.tick_params(axis="x", labelsize=8)
            ax.figure.tight_layout()
        self._publish()
