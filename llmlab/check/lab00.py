"""Checks for the lab 00 exercises (:mod:`llmlab.solutions.lab00`)."""

from __future__ import annotations


import math

from llmlab.check._base import _fail, _ok, _run_on_ranks
from llmlab.solutions import lab00 as ex
from llmlab.formulas.communication import ring_all_reduce_time


def training_memory_bytes(fn) -> bool:
    name = "training_memory_bytes"
    for n in (1, 8_000_000_000, 123_456):
        want, got = ex.training_memory_bytes(n), fn(n)
        for k in want:
            if not isinstance(got, dict) or got.get(k) != want[k]:
                _fail(
                    name,
                    f"{k} for {n:,} parameters",
                    want,
                    got,
                    "fp32 is 4 bytes; Adam keeps two states (m and v) per parameter.",
                )
    return _ok(
        name, "bytes for 3 model sizes match 4Ψ / 4Ψ / 8Ψ (the source articles' 32 / 32 / 64 GB for 8B)"
    )


def _rel_close(a, b) -> bool:
    return isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def training_flops_and_time(fn) -> bool:
    name = "training_flops_and_time"
    cases = (
        (8e9, 2.5e11, 312e12, 1.0, 1),
        (8e9, 2.5e11, 312e12, 0.4, 1),
        (70e9, 1.4e12, 989e12, 0.5, 1024),
        (1.2e6, 4096, 5e10, 0.25, 1),
    )
    for n, t, peak, u, g in cases:
        want, got = ex.training_flops_and_time(n, t, peak, u, g), fn(n, t, peak, u, g)
        what = f"N={n:.3g} parameters, T={t:.3g} tokens, {g} GPU(s) at {peak:.3g} FLOP/s, MFU {u}"
        if not isinstance(got, dict):
            _fail(
                name,
                f"return a dict with 'flops' and 'seconds' ({what})",
                want,
                got,
                "return {'flops': ..., 'seconds': ...}.",
            )
        if not _rel_close(got.get("flops"), want["flops"]):
            _fail(
                name,
                f"flops for {what}",
                want["flops"],
                got.get("flops"),
                "6 FLOPs per parameter per token: 2 forward + 4 backward (6·N·T).",
            )
        if not _rel_close(got.get("seconds"), want["seconds"]):
            _fail(
                name,
                f"seconds for {what}",
                want["seconds"],
                got.get("seconds"),
                "time = FLOPs / (num_gpus x peak FLOP/s x MFU): MFU < 1 makes it longer.",
            )
    days = ex.training_flops_and_time(*cases[0])["seconds"] / 86400
    return _ok(
        name,
        f"6·N·T and the time at a given MFU match for 4 cases (the source articles' 8B: {days:.0f} days)",
    )


def _ring_bytes_job(numel):
    import torch
    import torch.distributed as dist
    from llmlab.parallel.data_parallel import ring_all_reduce
    from llmlab.runtime import comm

    t = torch.full((numel,), float(dist.get_rank() + 1))
    comm.COUNTER.reset()
    ring_all_reduce(t)
    return comm.COUNTER.snapshot()["send"]


def ring_all_reduce_seconds(fn, world: int = 3) -> bool:
    name = "ring_all_reduce_seconds"
    for nbytes, n, bw, lat in (
        (112e9, 8, 64e9, 0.0),
        (4e6, 2, 1e9, 0.0),
        (4e6, 4, 1e9, 5e-5),
        (1024.0, 1, 1e9, 0.0),
    ):
        want, got = ring_all_reduce_time(nbytes, n, bw, lat), fn(nbytes, n, bw, lat)
        if not _rel_close(got, want):
            hint = (
                "each rank sends 2(N-1)/N of the bytes: (N-1)/N in the reduce-scatter and "
                "(N-1)/N in the all-gather; and each of those 2(N-1) steps pays the latency."
            )
            if n == 1:
                hint = "with one rank there is nothing to send: 2(N-1)/N = 0."
            _fail(
                name,
                f"{nbytes:.3g} bytes over {n} ranks at {bw:.3g} bytes/s, latency {lat} s",
                want,
                got,
                hint,
            )
    # At 1 byte/s the time is the bytes each rank sends: measure them on real ranks.
    numel = 3 * 1024
    sent = _run_on_ranks(name, _ring_bytes_job, world, numel)
    got = fn(4.0 * numel, world, 1.0, 0.0)
    for r, b in enumerate(sent):
        if not _rel_close(got, float(b)):
            _fail(
                name,
                f"rank {r} of a ring all-reduce of {4 * numel} bytes on {world} real ranks "
                f"sent {b} bytes; at 1 byte/s your time should equal that",
                float(b),
                got,
                "the time is (bytes sent per rank) / bandwidth, and a ring sends 2(N-1)/N of the tensor.",
            )
    return _ok(
        name,
        f"the α-β ring time matches 4 cases and the bytes measured on {world} real ranks "
        f"({sent[0]} of {4 * numel})",
    )
