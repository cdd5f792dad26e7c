"""``/metrics``: Prometheus metrics with vLLM v1's names under the ``llmlab:`` prefix.

Every series carries the labels ``model_name`` and ``replica`` (the data-parallel engine replica,
``"0"`` with one). vLLM v1's names (docs: "Production Metrics"):

- gauges ``llmlab:num_requests_running``, ``llmlab:num_requests_waiting`` (requests, waiting
  includes swapped-out ones), ``llmlab:kv_cache_usage_perc`` (used / total KV blocks, 0..1);
- counters ``llmlab:num_preemptions_total``, ``llmlab:prompt_tokens_total``,
  ``llmlab:generation_tokens_total``, ``llmlab:request_success_total`` (label ``finished_reason``);
- histograms ``llmlab:time_to_first_token_seconds``, ``llmlab:time_per_output_token_seconds``
  (per request: (finish - first token) / (output tokens - 1)), ``llmlab:e2e_request_latency_seconds``.

And the source articles' two other monitoring figures:

- ``llmlab:kv_cache_fragmentation_perc``: share of the allocated KV slots holding no token
  (PagedAttention, Kwon et al. 2023 §2.3; ``StepMetrics.kv_waste_fraction`` of the last step);
- ``llmlab:engine_busy_perc``: share of the last ``busy_window_s`` seconds of wall time the engine
  spent inside ``step()`` (0..1); on CUDA also ``llmlab:gpu_utilization_perc`` from NVML
  (``torch.cuda.utilization``, needs ``pynvml``).

A :class:`ServerMetrics` owns its own ``CollectorRegistry`` (several servers in one process, as in
the tests and the lab, do not collide).
"""

from __future__ import annotations

import collections

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)
from prometheus_client import disable_created_metrics

disable_created_metrics()  # no *_created series (as vLLM): counters and histograms only

PREFIX = "llmlab:"
# vLLM v1's buckets (seconds)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)
METRIC_NAMES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "num_preemptions_total",
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "e2e_request_latency_seconds",
    "prompt_tokens_total",
    "generation_tokens_total",
    "kv_cache_fragmentation_perc",
    "engine_busy_perc",
)


class BusyWindow:
    """Seconds spent stepping within the last ``window_s`` seconds of wall time (thread-safe)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._steps: collections.deque = collections.deque()  # (start, end)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def record(self, start: float, end: float) -> None:
        with self._lock:
            self._steps.append((start, end))

    def fraction(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        lo = max(now - self.window_s, self._t0)
        with self._lock:
            while self._steps and self._steps[0][1] < lo:
                self._steps.popleft()
            busy = sum(min(e, now) - max(s, lo) for s, e in self._steps if e > lo)
        return 0.0 if now <= lo else min(1.0, busy / (now - lo))


class ServerMetrics:
    """The server's collectors; :meth:`replica` gives the label-bound view one engine updates."""

    def __init__(self, model_name: str, device_type: str = "cpu", busy_window_s: float = 10.0):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.busy_window_s = busy_window_s
        labels = ["model_name", "replica"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(PREFIX + name, doc, labels, registry=r)

        self.running = gauge("num_requests_running", "Requests with KV blocks in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. swapped).")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: used / total blocks (1 = full).")
        self.kv_frag = gauge(
            "kv_cache_fragmentation_perc", "Share of allocated KV slots holding no token (last step)."
        )
        self.busy = gauge("engine_busy_perc", "Share of recent wall time spent in engine steps.")
        self.gpu_util = (
            gauge("gpu_utilization_perc", "GPU utilisation from NVML (0..1).")
            if device_type == "cuda"
            else None
        )
        self.preemptions = Counter(PREFIX + "num_preemptions", "Preempted sequences.", labels, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.", labels, registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens.", labels, registry=r
        )
        self.success = Counter(
            PREFIX + "request_success", "Finished requests.", labels + ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to last token.",
            labels,
            buckets=E2E_BUCKETS,
            registry=r,
        )

    def replica(self, replica: str) -> "ReplicaMetrics":
        return ReplicaMetrics(self, str(replica))

    def exposition(self) -> bytes:
        """The Prometheus text format of every series."""
        return generate_latest(self.registry)


class ReplicaMetrics:
    """What one engine replica reports; called from its engine thread."""

    def __init__(self, parent: ServerMetrics, replica: str):
        lab = (parent.model_name, replica)
        self.parent = parent
        self.busy_window = BusyWindow(parent.busy_window_s)
        self.running, self.waiting = parent.running.labels(*lab), parent.waiting.labels(*lab)
        self.kv_usage, self.kv_frag = parent.kv_usage.labels(*lab), parent.kv_frag.labels(*lab)
        parent.busy.labels(*lab).set_function(self.busy_window.fraction)
        if parent.gpu_util is not None:
            parent.gpu_util.labels(*lab).set_function(_nvml_utilization)
        self.preemptions = parent.preemptions.labels(*lab)
        self.prompt_tokens = parent.prompt_tokens.labels(*lab)
        self.generation_tokens = parent.generation_tokens.labels(*lab)
        self.ttft, self.tpot, self.e2e = (h.labels(*lab) for h in (parent.ttft, parent.tpot, parent.e2e))
        self._lab = lab
        # The latest finished requests' own times (time.perf_counter seconds, the clock of an
        # in-process client such as lab 11's): {"request_id", "arrival", "first_token", "finish"}.
        self.recent: collections.deque = collections.deque(maxlen=1024)

    def on_step(self, step_metrics, start: float, end: float) -> None:
        """After ``engine.step()``: its :class:`StepMetrics` and wall-clock span."""
        self.busy_window.record(start, end)
        if step_metrics is not None:
            self.preemptions.inc(step_metrics.num_preemptions)
            self.kv_frag.set(step_metrics.kv_waste_fraction)

    def on_state(self, engine) -> None:
        """Queue and cache gauges from the engine's scheduler and block pool."""
        sched, bm = engine.scheduler, engine.block_manager
        self.running.set(len({s.request_id for s in sched.running}))
        self.waiting.set(len({s.request_id for s in list(sched.waiting) + list(sched.swapped)}))
        self.kv_usage.set(bm.num_used_blocks / bm.num_blocks)
        if not sched.running:
            self.kv_frag.set(0.0)

    def on_tokens(self, new_prompt_tokens: int, new_output_tokens: int) -> None:
        if new_prompt_tokens:
            self.prompt_tokens.inc(new_prompt_tokens)
        if new_output_tokens:
            self.generation_tokens.inc(new_output_tokens)

    def on_finish(self, output) -> None:
        """A finished :class:`RequestOutput`: latency histograms and the success counter."""
        m = output.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
        self.recent.append(
            {
                "request_id": output.request_id,
                "arrival": m.arrival_time,
                "first_token": m.first_token_time,
                "finish": m.finish_time,
            }
        )
        for c in output.outputs:
            self.parent.success.labels(*self._lab, c.finish_reason or "abort").inc()


def _nvml_utilization() -> float:
    try:
        import torch

        return torch.cuda.utilization() / 100.0
    except Exception:  # no pynvml / no NVML: report nothing useful
        return float("nan")


def scrape(base_url: str, timeout: float = 10.0) -> dict[str, list[tuple[dict, float]]]:
    """``GET base_url/metrics`` parsed: ``{sample name: [(labels, value), ...]}`` (a histogram's
    samples are ``<name>_bucket`` with an ``le`` label, ``<name>_sum``, ``<name>_count``)."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def sample(scraped: dict, name: str, **labels) -> float:
    """Sum of the values of ``name`` whose labels include ``labels`` (0.0 if none)."""
    return sum(v for lab, v in scraped.get(name, []) if all(lab.get(k) == str(x) for k, x in labels.items()))


def histogram_buckets(scraped: dict, name: str, **labels) -> list[tuple[float, float]]:
    """``[(upper bound, cumulative count)]`` of histogram ``name`` (summed over the series matching
    ``labels``, e.g. over replicas), sorted, the last bound ``inf``."""
    acc: dict[float, float] = {}
    for lab, v in scraped.get(name + "_bucket", []):
        if all(lab.get(k) == str(x) for k, x in labels.items()):
            b = float(lab["le"])
            acc[b] = acc.get(b, 0.0) + v
    return sorted(acc.items())
