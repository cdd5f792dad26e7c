"""llmlab.launch: real processes, results, error propagation, no leftovers, torchrun."""

import json
import os
import shutil
import signal
from pathlib import Path
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import llmlab
from llmlab.runtime.launch import RankError


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def test_results_come_back_by_rank_after_a_real_all_reduce():
    out = llmlab.launch(_rank_and_sum, 3, backend="gloo")
    assert out == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_function_defined_locally_with_arguments_and_closure_runs():
    scale = 10.0

    def local_fn(a, *, b):  # not importable: travels by value (as from a notebook cell)
        return (dist.get_rank() + a + b) * scale

    assert llmlab.launch(local_fn, 2, 1, b=2) == [30.0, 40.0]


def _raise_on_rank_1(pid_dir):
    (pid_dir / f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()  # both pid files are written
    if dist.get_rank() == 1:
        raise ValueError("bad shard on purpose")
    dist.barrier()  # rank 0 would wait forever without the launcher stopping it
    return "unreachable"


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); look at its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_a_failing_rank_is_named_with_its_traceback_and_nothing_is_left(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        llmlab.launch(_raise_on_rank_1, 2, tmp_path, backend="gloo")
    assert time.monotonic() - t0 < 60
    err = info.value
    assert err.rank == 1
    assert "ValueError: bad shard on purpose" in str(err)
    assert "_raise_on_rank_1" in err.rank_traceback
    assert (Path(err.log_dir) / "rank1.log").exists()  # kept for reading after a failure
    shutil.rmtree(err.log_dir)
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "a rank process outlived the launch"


def _killed_rank():
    if dist.get_rank() == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def test_a_rank_killed_by_a_signal_is_reported():
    with pytest.raises(RankError) as info:
        llmlab.launch(_killed_rank, 2, backend="gloo")
    assert info.value.rank == 0
    assert "SIGKILL" in str(info.value)
    assert f"(log: {info.value.log_dir}/rank0.log)" in str(info.value)
    shutil.rmtree(info.value.log_dir)


def _reports(n):
    for i in range(n):
        llmlab.report({"rank": dist.get_rank(), "i": i})
    return n


def test_metrics_stream_to_the_caller_in_order():
    seen = []
    llmlab.launch(_reports, 2, 3, backend="gloo", on_metric=lambda r, rec: seen.append((r, rec["i"])))
    assert sorted(seen) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [i for r, i in seen if r == 1] == [0, 1, 2]


def test_bad_arguments_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="world_size"):
        llmlab.launch(_rank_and_sum, 0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="one GPU per rank"):
            llmlab.launch(_rank_and_sum, 2, backend="nccl")
    with pytest.raises(ValueError, match="backend"):
        llmlab.launch(_rank_and_sum, 2, backend="mpi-ish")


def _sleep_forever():
    time.sleep(600)


def test_timeout_kills_the_ranks():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        llmlab.launch(_sleep_forever, 2, backend="gloo", timeout=3)
    assert time.monotonic() - t0 < 30
    assert Path(info.value.log_dir).is_dir()
    shutil.rmtree(info.value.log_dir)


def test_launch_joins_torchrun_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import json, sys
        import torch, torch.distributed as dist
        import llmlab

        def fn(x):
            t = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(t)
            return [dist.get_rank(), x, t.item()]

        res = llmlab.launch(fn, 2, 7, backend="gloo")  # a CPU tensor: gloo, on GPU nodes too
        if dist.is_initialized():
            raise SystemExit("process group leaked")
        import os
        if os.environ["RANK"] == "0":  # one writer: two ranks' lines could interleave
            print("RESULT " + json.dumps(res))
    """)
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines == [[[0, 7, 1.0], [1, 7, 1.0]]]


def _env_value():
    return os.environ.get("LLMLAB_TEST_ENV")


def test_ranks_see_the_callers_current_environment(monkeypatch):
    llmlab.launch(_env_value, 1, backend="gloo")  # the fork server is already running now
    monkeypatch.setenv("LLMLAB_TEST_ENV", "set-after-the-fork-server-started")
    assert llmlab.launch(_env_value, 2, backend="gloo") == ["set-after-the-fork-server-started"] * 2


def test_torchrun_backend_needs_one_gpu_per_local_rank(monkeypatch):
    """auto picks NCCL under torchrun only when every local rank gets its own GPU."""
    from llmlab.runtime.launch import resolve_torchrun_backend

    for gpus, local_ws, want in (
        (0, 2, "gloo"),
        (1, 2, "gloo"),
        (2, 2, "nccl"),
        (8, 4, "nccl"),
        (3, 4, "gloo"),
    ):
        monkeypatch.setattr(torch.cuda, "is_available", lambda g=gpus: g > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda g=gpus: g)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ws))
        monkeypatch.setenv("WORLD_SIZE", str(2 * local_ws))  # two nodes
        assert resolve_torchrun_backend("auto") == want, (gpus, local_ws)
        assert resolve_torchrun_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=4 > 3 GPUs"):
        resolve_torchrun_backend("nccl")
    with pytest.raises(ValueError, match="expected 'auto'"):
        resolve_torchrun_backend("mpi")


def test_one_backend_choice_for_launch_inference_and_the_trainer(monkeypatch):
    """runtime.process.resolve_backend: by GPU count, or by the device; NCCL refused with more
    ranks than GPUs unless the count is the launcher's to check (ranks=None)."""
    from llmlab.runtime.process import resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [resolve_backend("auto", n) for n in (1, 2, 3)] == ["nccl", "nccl", "gloo"]
    assert resolve_backend("auto", 2, device="cpu") == "gloo"
    assert resolve_backend("auto", None, device="cuda") == "nccl"  # the trainer: 16 ranks, 2 nodes
    with pytest.raises(ValueError, match="needs one GPU per rank: world_size=3 > 2 GPUs"):
        resolve_backend("auto", 3, device="cuda:0")
    with pytest.raises(ValueError, match="expected 'auto'"):
        resolve_backend("mpi", 1)
