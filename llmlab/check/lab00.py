"""Checks for the lab 00 exercises (:mod:`llmlab.exercises.lab00`)."""
from __future__ import annotations


from llmlab.check._base import _fail, _ok
from llmlab.exercises import lab00 as ex


def training_memory_bytes(fn) -> bool:
    name = "training_memory_bytes"
    for n in (1, 8_000_000_000, 123_456):
        want, got = ex.training_memory_bytes(n), fn(n)
        for k in want:
            if not isinstance(got, dict) or got.get(k) != want[k]:
                _fail(name, f"{k} for {n:,} parameters", want, got,
                      "fp32 is 4 bytes; Adam keeps two states (m and v) per parameter.")
    return _ok(name, "bytes for 3 model sizes match 4Ψ / 4Ψ / 8Ψ (the seed's 32 / 32 / 64 GB for 8B)")
