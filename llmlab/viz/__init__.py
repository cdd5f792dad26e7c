"""Notebook plots: live curves updated while work runs (:class:`LivePlot` and its subclasses),
static charts, and one plotting style for all of them (:func:`use_style`, applied on import)."""

from llmlab.viz.live import STYLE, WIDTH, LiveBars, LivePlot, use_style

use_style()

__all__ = ["LiveBars", "LivePlot", "STYLE", "WIDTH", "use_style"]
