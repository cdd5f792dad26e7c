"""Notebook plots: live training curves (:class:`LivePlot`) and static charts."""
from llmlab.viz.live import LivePlot

__all__ = ["LivePlot"]
