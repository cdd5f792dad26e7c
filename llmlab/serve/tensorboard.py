"""``llmlab serve --tensorboard DIR`` and ``llmlab bench serve --tensorboard DIR``: the serving
gauges as TensorBoard scalars (the Prometheus ``/metrics`` and the benchmark's JSON stay the
contract).

:class:`GaugeLogger` samples a :class:`~llmlab.serve.metrics.ServerMetrics` every
``interval_s`` seconds on a thread of its own and writes each gauge and counter sample as
``serve/<name>/replica<R>`` (``llmlab:`` dropped; counters as ``<name>_total``; histograms as
their ``_sum`` and ``_count``), step = sample number. :func:`~llmlab.metrics.tensorboard.write_bench` writes a benchmark's
numbers as ``bench/<system or rate>/<key>``
(:func:`llmlab.metrics.tensorboard.write_bench`).
"""

from __future__ import annotations

import threading
from typing import Any

from llmlab.metrics.tensorboard import open_writer, write_scalars


def gauge_values(metrics: Any) -> dict[str, float]:
    """``{"<name>/replica<R>": value}`` of every gauge, counter and histogram sum/count sample
    in ``metrics.registry`` (finite values only)."""
    out = {}
    for fam in metrics.registry.collect():
        for s in fam.samples:
            if fam.type == "histogram" and not s.name.endswith(("_sum", "_count")):
                continue
            if s.value != s.value or s.value in (float("inf"), float("-inf")):
                continue
            name = s.name.removeprefix("llmlab:")
            extra = "".join(
                f"_{v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "replica")
            )
            out[f"{name}{extra}/replica{s.labels.get('replica', '0')}"] = float(s.value)
    return out


class GaugeLogger:
    """Writes :func:`gauge_values` to TensorBoard every ``interval_s`` s until :meth:`close`."""

    def __init__(self, metrics: Any, logdir: str, interval_s: float = 1.0):
        self.metrics, self.interval_s, self.step = metrics, interval_s, 0
        self.writer = open_writer(logdir)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmlab-tensorboard", daemon=True)

    def start(self) -> "GaugeLogger":
        self._thread.start()
        return self

    def tick(self) -> dict[str, float]:
        """Write one sample now; returns what was written."""
        values = gauge_values(self.metrics)
        write_scalars(self.writer, "serve", values, self.step)
        self.step += 1
        return values

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def close(self) -> None:
        """Stop the thread, write a last sample, flush."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.tick()
        self.writer.close()
