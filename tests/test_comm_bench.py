"""``llmlab bench comm``: nccl-tests bandwidth definitions on real gloo ranks."""

import json

import pytest

from llmlab.tools.comm_bench import OPS, bus_factor, default_sizes, parse_size


def test_bus_factors_and_sizes():
    assert bus_factor("all_reduce", 4) == 1.5
    assert (
        bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == bus_factor("all_to_all", 4) == 0.75
    )
    assert bus_factor("all_reduce", 2) == 1.0
    with pytest.raises(ValueError, match="unknown collective 'bcast'"):
        bus_factor("bcast", 2)
    assert parse_size("64K") == 65536 and parse_size("4MiB") == 4 * 2**20 and parse_size("100") == 100
    with pytest.raises(ValueError, match="as a size in bytes"):
        parse_size("lots")
    assert default_sizes(1024, 16384, 4) == [1024, 4096, 16384]


def test_bench_comm_cli_json(tmp_path):
    from llmlab.cli import main

    out = tmp_path / "comm.json"
    assert (
        main(
            [
                "bench",
                "comm",
                "--world-size",
                "2",
                "--min-bytes",
                "4K",
                "--max-bytes",
                "16K",
                "--iters",
                "2",
                "--warmup",
                "1",
                "--backend",
                "gloo",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["backend"] == "gloo"
    rows = res["results"]
    assert [(r["op"], r["size_bytes"]) for r in rows] == [(op, s) for op in OPS for s in (4096, 16384)]
    for r in rows:
        # the bytes llmlab.runtime.comm counted per call are the nccl-tests "size"
        assert r["payload_bytes_counted"] == r["size_bytes"]
        assert r["time_s"] > 0
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], 2))
