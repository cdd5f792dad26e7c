"""The machine the planner plans for: GPUs, their peak FLOP/s, memory and links.

A :class:`ClusterSpec` is ``num_gpus`` devices in nodes of ``gpus_per_node``. Each collective
runs at the α-β model's latency α (seconds per ring step) and bandwidth β (bytes/s per GPU, as
nccl-tests' busbw) of the link it crosses: inside a node (NVLink) or between nodes (InfiniBand).
``achievable_fraction`` is the share of peak FLOP/s a large matmul reaches (the rest of the MFU
gap is the communication and bubble the cost model adds).

Presets (:data:`NODE_PRESETS`) are 8-GPU SXM nodes with one InfiniBand NIC per GPU, from the
vendors' data sheets: A100/A800 312 TFLOP/s bf16 (the source articles' A800 figure), H100/H200
989 TFLOP/s bf16 dense; NVLink 300 GB/s per direction on A100 (600 GB/s bidirectional), 200 GB/s
on A800 (400), 450 GB/s on H100/H200 (900); HDR 200 Gb/s = 25 GB/s per GPU on A100/A800, NDR
400 Gb/s = 50 GB/s on H100/H200. fp32 runs at the TF32 tensor-core rate (156 / 495 TFLOP/s).
Measured busbw is typically 70-90 % of these; ``llmlab plan --calibrate`` replaces them with
this machine's numbers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class ClusterSpec:
    """``peak_flops`` maps a dtype (fp32, bf16, fp16) to one GPU's peak FLOP/s; bandwidths in
    bytes/s per GPU, latencies in seconds; ``gpu_memory_bytes`` per GPU; ``reserved_bytes`` is
    what the framework keeps for itself (CUDA context, NCCL buffers, fragmentation)."""

    num_gpus: int
    gpus_per_node: int
    gpu_memory_bytes: float
    peak_flops: dict
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float = 5e-6
    inter_latency: float = 1e-5
    achievable_fraction: float = 0.6
    reserved_bytes: float = 2e9
    name: str = "custom"
    overlap: bool = True  # collectives can hide under compute (GPUs); not on CPU/gloo
    op_links: dict | None = None  # calibrated: {op: {"latency", "bandwidth"}} (one machine)

    def validate(self) -> "ClusterSpec":
        if self.num_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"--num-gpus {self.num_gpus} and --gpus-per-node {self.gpus_per_node} must be >= 1"
            )
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"--gpus-per-node {self.gpus_per_node} must divide --num-gpus {self.num_gpus} (whole nodes)"
            )
        positive = {
            "--gpu-memory-gb": self.gpu_memory_bytes,
            "--intra-bw-gb-s": self.intra_bandwidth,
            "--inter-bw-gb-s": self.inter_bandwidth,
        } | {f"--peak-tflops (--dtype {k})": v for k, v in self.peak_flops.items()}
        for name, v in positive.items():  # NaN and inf fail too: not (nan > 0), not finite
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name, v in (
            ("--intra-latency-us", self.intra_latency),
            ("--inter-latency-us", self.inter_latency),
        ):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not 0 < self.achievable_fraction <= 1:
            raise ValueError(f"--achievable-fraction must be in (0, 1], got {self.achievable_fraction}")
        return self

    def link(self, group_span: int, op: str = "all_reduce") -> tuple[float, float]:
        """(latency s, bandwidth B/s) of a group whose ranks span ``group_span`` consecutive
        GPUs: inside a node when it fits in one, else the inter-node link."""
        if self.op_links and op in self.op_links:
            c = self.op_links[op]
            return c["latency"], c["bandwidth"]
        if group_span <= self.gpus_per_node:
            return self.intra_latency, self.intra_bandwidth
        return self.inter_latency, self.inter_bandwidth

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(
                f"no peak FLOP/s for dtype {dtype!r} on {self.name}; known: {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[dtype]

    def replace(self, **kw) -> "ClusterSpec":
        return replace(self, **kw)

    def to_dict(self) -> dict:
        return asdict(self)


def _node(name, mem_gb, bf16_tflops, tf32_tflops, nvlink_gbs, ib_gbs):
    return ClusterSpec(
        num_gpus=8,
        gpus_per_node=8,
        gpu_memory_bytes=mem_gb * GB,
        peak_flops={"bf16": bf16_tflops * 1e12, "fp16": bf16_tflops * 1e12, "fp32": tf32_tflops * 1e12},
        intra_bandwidth=nvlink_gbs * GB,
        inter_bandwidth=ib_gbs * GB,
        name=name,
    )


NODE_PRESETS = {
    "a100": _node("a100", 80, 312, 156, 300, 25),
    "a800": _node("a800", 80, 312, 156, 200, 25),
    "h100": _node("h100", 80, 989, 495, 450, 50),
    "h200": _node("h200", 141, 989, 495, 450, 50),
}


def cluster_preset(name: str, num_gpus: int | None = None, **overrides) -> ClusterSpec:
    """A node preset (:data:`NODE_PRESETS`) scaled to ``num_gpus`` GPUs, with overrides."""
    if name not in NODE_PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; known: {', '.join(NODE_PRESETS)}")
    c = NODE_PRESETS[name]
    if num_gpus is not None:
        c = c.replace(num_gpus=num_gpus)
    return c.replace(**overrides).validate()
