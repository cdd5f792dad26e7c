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


class LivePlot:
    """Line plots of named series against ``step``, one panel per series.

    ``update(record)`` takes a dict with ``step`` and any of the series names (e.g. the records
    ``llmlab.train(on_step=...)`` produces); ``update(record, label="rank 1")`` draws several
    lines per panel. ``finish()`` draws the final state. Works outside notebooks (no display).
    """

    def __init__(self, series: list[str], title: str | None = None, interval: float = 0.25,
                 figsize: tuple[float, float] | None = None, logy: tuple[str, ...] = ()):
        import matplotlib
        if not _in_notebook():
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        self.series, self.interval, self.logy = list(series), interval, set(logy)
        self.data: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
        self.fig, axes = plt.subplots(1, len(series), figsize=figsize or (4.2 * len(series), 3.0),
                                      squeeze=False)
        self.axes = dict(zip(series, axes[0]))
        if title:
            self.fig.suptitle(title)
        plt.close(self.fig)  # the inline backend must not show it a second time
        self.live = os.environ.get("LLMLAB_LIVE", "1") != "0"
        self.handle = None
        self._last = 0.0
        if _in_notebook():
            from IPython.display import display
            self.handle = display(self.fig, display_id=True)

    def update(self, record: dict, label: str = "") -> None:
        for name in self.series:
            if name in record and record[name] is not None:
                self.data[name][label].append((record.get("step", len(self.data[name][label]) + 1),
                                               record[name]))
        if self.live and time.monotonic() - self._last >= self.interval:
            self._draw()

    def _draw(self) -> None:
        for name, ax in self.axes.items():
            ax.clear()
            for label, pts in self.data[name].items():
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, label=label or None)
            ax.set_title(name)
            ax.set_xlabel("step")
            if name in self.logy:
                ax.set_yscale("log")
            self._decorate(name, ax)
            if any(self.data[name].keys() - {""}) or ax.get_legend_handles_labels()[1]:
                ax.legend(fontsize=8)
        self.fig.tight_layout()
        if self.handle is not None:
            self.handle.update(self.fig)
        self._last = time.monotonic()

    def _decorate(self, name: str, ax) -> None:
        """Subclasses add to panel ``name`` after its lines are drawn (reference lines, markers)."""

    def finish(self) -> None:
        """Draw the final state (always, even with ``LLMLAB_LIVE=0``)."""
        self._draw()
