"""Timestamps that mean *GPU work done*, not *GPU work queued*.

On a GPU, ``time.perf_counter()`` around a kernel launch measures the launch (microseconds), and
an NCCL work's future completes when the collective is enqueued: a timeline built from them shows
bars of zero width. Two ways to time real work, both used by llmlab's timelines:

* :func:`device_clock` - host seconds taken after ``torch.cuda.synchronize``: simple and exact,
  at the cost of a synchronisation per timestamp (the pipeline runner's per-op timeline);
* :class:`EventTimeline` - CUDA events recorded on the streams where the work runs (a collective's
  end on a side stream that waits for it), converted to host seconds once per step, so the
  timeline does not serialise the overlap it shows (the DDP bucket timeline).

On CPU both are ``time.perf_counter()`` (gloo futures complete when the work does).
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def device_clock(device: torch.device | str) -> Callable[[], float]:
    """A clock for ``device``: ``time.perf_counter`` after the device's queued work has finished
    (``torch.cuda.synchronize(device)`` first on CUDA), in seconds."""
    device = torch.device(device)
    if device.type != "cuda":
        return time.perf_counter

    def now() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return now


class EventTimeline:
    """``(kind, index, seconds)`` events appended to ``events`` (a list the caller owns).

    ``mark(kind, index)``: now, on the current stream; ``mark_done(kind, index, work)``: when the
    async collective ``work`` has finished. On CUDA they are CUDA events, written to ``events`` (in
    host seconds) by :meth:`resolve`, which the owner calls after waiting for its works.
    """

    def __init__(self, device: torch.device | str, events: list):
        self.cuda = torch.device(device).type == "cuda"
        self.events = events
        self._pending: list = []
        self._ref: tuple[torch.cuda.Event, float] | None = None  # (reference event, its host time)
        self._stream: torch.cuda.Stream | None = None

    def _cuda_event(self):
        if self._ref is None:  # one synchronisation per step: the host time of a reference event
            torch.cuda.synchronize()
            self._ref = (torch.cuda.Event(enable_timing=True), time.perf_counter())
            self._ref[0].record()
        return torch.cuda.Event(enable_timing=True)

    def mark(self, kind: str, index) -> None:
        if not self.cuda:
            self.events.append((kind, index, time.perf_counter()))
            return
        ev = self._cuda_event()
        ev.record()
        self._pending.append((kind, index, ev))

    def mark_done(self, kind: str, index, work) -> None:
        if not self.cuda:
            work.get_future().then(lambda f: self.events.append((kind, index, time.perf_counter())))
            return
        ev = self._cuda_event()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            work.wait()  # this side stream waits for the collective; the compute stream does not
            ev.record(self._stream)
        self._pending.append((kind, index, ev))

    def resolve(self) -> None:
        """Convert the pending CUDA events to host seconds (synchronises); no-op on CPU."""
        if not self._pending:
            return
        torch.cuda.synchronize()
        if self._ref is None:  # made with the first pending event
            raise RuntimeError("EventTimeline: pending events without a reference event")
        ref_ev, ref_t = self._ref
        for kind, index, ev in self._pending:
            self.events.append((kind, index, ref_t + ref_ev.elapsed_time(ev) / 1e3))
        self.events.sort(key=lambda e: e[2])
        self._pending, self._ref = [], None
