"""Memory accounting from tensors, saved activations, throughput formulas, live plots."""

import pytest
import torch

from llmlab.metrics.memory import SavedActivations, grad_bytes, optimizer_state_bytes, tensor_bytes
from llmlab.metrics.throughput import mfu, training_flops_per_token
from llmlab.viz import LivePlot


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(100)  # 400 bytes
    view = a[10:20]
    b = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    assert tensor_bytes([a, view, b, None]) == 480


def test_saved_activations_are_the_inputs_kept_for_backward():
    w = torch.nn.Parameter(torch.randn(64, 32))
    x = torch.randn(8, 64, requires_grad=True)
    with SavedActivations([w]) as act:
        h = x @ w  # saves x (2048 B); w is a parameter: excluded
        y = torch.relu(h)  # saves its output (8*32*4 = 1024 B)
        assert act.current == 8 * 64 * 4 + 8 * 32 * 4
        y.sum().backward()
    assert act.peak == 8 * 64 * 4 + 8 * 32 * 4
    del h, y
    assert act.current == 0  # the graph is freed


def test_adam_state_and_grad_bytes():
    m = torch.nn.Linear(10, 5)  # 55 parameters
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 10)).sum().backward()
    opt.step()
    assert grad_bytes(m.parameters()) == 55 * 4
    # exp_avg + exp_avg_sq (2 x 55 fp32) + one fp32 step scalar per parameter tensor
    assert optimizer_state_bytes(opt) == 2 * 55 * 4 + 2 * 4


def test_flops_formula_and_mfu():
    assert training_flops_per_token(1e9, 10, 100, 1000) == 6e9 + 12 * 10 * 100 * 1000
    assert mfu(1000.0, 6e9, 1.2e13) == 0.5
    assert mfu(1000.0, 6e9, None) is None


def test_live_plot_runs_headless():
    plot = LivePlot(["loss", "tokens_per_s"], title="t")
    for s in range(1, 4):
        plot.update({"step": s, "loss": 5.0 / s, "tokens_per_s": 100.0 * s})
    plot.update({"step": 1, "loss": 4.0}, label="rank 1")
    plot.finish()
    lines = plot.axes["loss"].get_lines()
    assert len(lines) == 2 and list(lines[0].get_ydata()) == [5.0, 2.5, 5.0 / 3]


def test_live_plot_xticks_label_every_panel():
    plot = LivePlot(["p99", "tok/s"], x="rate", xticks={4: "4", 16: "16", 64: "all at once"})
    plot.update({"rate": 64, "p99": 120.0, "tok/s": 900.0})
    plot.finish()
    for ax in plot.axes.values():
        assert list(ax.get_xticks()) == [4, 16, 64]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "16", "all at once"]


def test_mfu_peak_is_the_peak_of_the_run_dtype(monkeypatch):
    """An fp32 run divided by the bf16 tensor-core peak read ~15x too low on an H100."""
    from llmlab.metrics import throughput as tp

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    # allow_tf32 is a property of torch's cuBLAS module: set and restored by hand (pytest 9.2's
    # monkeypatch deletes such an attribute on undo, which fails and leaves the mocks above in place)
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        matmul.allow_tf32 = False
        assert tp.peak_flops("cuda", "bf16") == 989e12
        assert tp.peak_flops("cuda", "fp32") == 67e12
        matmul.allow_tf32 = True
        assert tp.peak_flops("cuda", "fp32") == 495e12
    finally:
        matmul.allow_tf32 = before
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla V100-SXM2-32GB")
    assert tp.peak_flops("cuda", "bf16") is None and tp.peak_flops("cuda", "fp16") == 125e12
    assert tp.peak_flops("cpu", "fp32") is None
    with pytest.raises(ValueError, match="expected bf16, fp16 or fp32"):
        tp.peak_flops("cuda", "int8")


def test_each_training_run_starts_a_new_cuda_peak(monkeypatch):
    """The caching allocator's peak lasts for the process: a second run in a notebook reported
    the first run's peak. rank_main resets it (a no-op on CPU)."""
    from llmlab.metrics import memory
    from llmlab.training import trainer
    from llmlab.training.config import TrainConfig

    seen = []
    monkeypatch.setattr(trainer, "reset_cuda_peak", lambda d: seen.append(torch.device(d)))
    trainer.rank_main(TrainConfig(steps=1, global_batch_size=2, seq_len=8, device="cpu"))
    assert seen == [torch.device("cpu")]
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: calls.append(d))
    memory.reset_cuda_peak(torch.device("cpu"))
    memory.reset_cuda_peak(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


def test_gpu_timestamps_wait_for_the_work(monkeypatch):
    """A host clock around queued GPU work measures the launch, and an NCCL future completes at
    enqueue: timelines on a GPU synchronise (pipeline) or use CUDA events (DDP buckets)."""
    import time

    from llmlab.metrics import timing

    assert timing.device_clock("cpu") is time.perf_counter
    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    timing.device_clock("cuda:1")()
    assert synced == [torch.device("cuda", 1)]

    gpu_time = [0.0]  # a fake device: events read the device clock when the stream reaches them

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = gpu_time[0] + (stream.delay if stream is not None else 0.0)

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    class Stream:
        delay = 0.0

        def wait_stream(self, other):
            pass

    side = Stream()

    class Work:  # an all-reduce that will take 0.5 s on the device once queued
        def wait(self):
            side.delay = 0.5

        def get_future(self):
            raise AssertionError("a CUDA future completes at enqueue: not a 'done' time")

    import contextlib

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: side)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    events = []
    tl = timing.EventTimeline("cuda", events)
    tl.mark("launch", 0)
    tl.mark_done("done", 0, Work())
    gpu_time[0] = 0.1
    tl.mark("grad_ready", 1)
    assert events == []  # CUDA events are read once per step
    tl.resolve()
    assert [e[:2] for e in events] == [("launch", 0), ("grad_ready", 1), ("done", 0)]
    t = {k: s for k, _, s in events}
    assert t["done"] - t["launch"] == pytest.approx(0.5) and t["grad_ready"] - t["launch"] == pytest.approx(
        0.1
    )
