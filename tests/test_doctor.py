"""`llmlab doctor` and the hardware-sized lab configuration, on this CPU machine."""

import json

import torch

from llmlab.cli import main
from llmlab.doctor import check_comm
from pathlib import Path

import pytest

from llmlab.lab_sizes import LAB_LAYOUTS, LAB_SIZES, lab_layout_error, lab_size_for
from llmlab.runtime.hardware import lab_size


def test_doctor_runs_a_real_all_reduce_and_writes_json(tmp_path, capsys):
    out = tmp_path / "doctor.json"
    rc = main(["doctor", "--json", str(out)])
    report = json.loads(out.read_text())
    gloo = report["comm"][0]
    assert gloo["backend"] == "gloo" and gloo["ok"] and gloo["busbw_GBps"] > 0
    assert report["hardware"]["cpu_cores"] >= 1
    assert set(report["labs"]) >= {"00_three_walls", "06_paged_kv_cache"}
    text = capsys.readouterr().out
    assert "gloo all-reduce over 2 ranks: ok" in text and "labs will run as" in text
    if not torch.cuda.is_available():  # each lab's own size, as the notebook will choose it
        assert report["labs"]["04_expert_parallel"]["model"] == "tiny-moe"
        assert report["labs"]["06_paged_kv_cache"]["world_size"] == 1
        assert "08_3d_parallelism        4 ranks (gloo, cpu), model 'tiny', 5 steps" in text
        assert "05_zero                  2 ranks (gloo, cpu), model 'tiny', 2 steps" in text
        assert "06_paged_kv_cache        1 process on cpu, model 'shakespeare'" in text
    from llmlab.doctor import format_report

    no_triton = dict(report, triton={"ok": False, "installed": False})
    assert "note: triton is not installed, so lab 09 skips its Triton kernels" in format_report(no_triton)
    assert rc == (0 if report["verdict"] == "ok" else 1)


def test_bad_rank_counts_are_refused_and_the_error_names_the_whole_command(capsys):
    assert main(["doctor", "--ranks", "1"]) == 2
    assert "llmlab doctor: error: --ranks must be >= 2" in capsys.readouterr().err
    assert main(["bench", "comm", "--world-size", "1"]) == 2
    assert "llmlab bench comm: error: --world-size must be >= 2" in capsys.readouterr().err


def test_a_broken_backend_is_reported_with_its_error_not_raised():
    # More NCCL ranks than GPUs (on any host): launch refuses, and the doctor reports it.
    n = torch.cuda.device_count() + 1 if torch.cuda.is_available() else 2
    r = check_comm("nccl", n)
    assert r["ok"] is False and "one GPU per rank" in r["error"] and f"world_size={n}" in r["error"]


def test_lab_size_on_cpu():
    s = lab_size(force_cpu=True)
    assert (s.kind, s.device, s.backend, s.world_size, s.model) == ("cpu", "cpu", "gloo", 2, "tiny")
    assert "2 ranks on CPU" in s.describe()


def test_lab_size_steps_and_single_process_labs(monkeypatch):
    s = lab_size(max_ranks=1, min_ranks=1, force_cpu=True, cpu_steps=3, gpu_steps=30)
    assert (s.world_size, s.device, s.steps) == (1, "cpu", 3)
    assert lab_size(force_cpu=True).steps == 20  # defaults unchanged
    monkeypatch.delenv("LLMLAB_DEVICE", raising=False)
    monkeypatch.setattr("llmlab.runtime.hardware.gpu_count", lambda: 1)
    one = lab_size(max_ranks=1, min_ranks=1, cpu_steps=3, gpu_steps=30)
    assert (one.kind, one.device, one.backend, one.world_size, one.steps) == ("gpu", "cuda", "nccl", 1, 30)
    assert lab_size(max_ranks=4, min_ranks=2).device == "cpu"  # one GPU cannot host 2 NCCL ranks


def test_lab_size_takes_a_lab_specific_model_and_steps(monkeypatch):
    s = lab_size(max_ranks=2, force_cpu=True, cpu_model="tiny-moe", gpu_model="small", cpu_steps=5)
    assert (s.model, s.steps, s.world_size) == ("tiny-moe", 5, 2)
    assert "model 'tiny-moe', 5 steps" in s.describe()
    import llmlab.runtime.hardware as hw

    monkeypatch.setattr(hw, "gpu_count", lambda: 8)  # a node of 8 GPUs, seen by lab_size
    g = hw.lab_size(max_ranks=4, min_ranks=2, force_cpu=False, gpu_model="small", gpu_steps=30)
    assert (g.kind, g.device, g.backend, g.world_size, g.model, g.steps) == (
        "multi-gpu",
        "cuda",
        "nccl",
        4,
        "small",
        30,
    )
    assert hw.lab_size(max_ranks=4, force_cpu=False).model == "base"  # the default for 8 GPUs
    monkeypatch.setattr(hw, "gpu_count", lambda: 1)  # one GPU: a 2-rank lab stays on CPU
    assert hw.lab_size(min_ranks=2, force_cpu=False).device == "cpu"
    assert hw.lab_size(min_ranks=1, force_cpu=False).world_size == 1


def test_every_lab_takes_its_size_from_the_one_table():
    labs = sorted(p.stem for p in Path(__file__).resolve().parents[1].joinpath("labs").glob("*.ipynb"))
    assert labs == sorted(LAB_SIZES)
    for lab in labs:
        src = Path(__file__).resolve().parents[1].joinpath("labs", lab + ".ipynb").read_text()
        assert f'lab_size_for(\\"{lab}\\")' in src, lab
    assert lab_size_for("04_expert_parallel", force_cpu=True).model == "tiny-moe"
    with pytest.raises(KeyError, match="no lab named '10_x'"):
        lab_size_for("10_x")


def test_every_lab_draws_a_live_plot_from_llmlab_viz():
    """The kit's promise (issue 20): every lab imports a live plot from ``llmlab.viz`` and draws
    it while its work runs (``update`` / ``on_step`` fed as it runs), not only a static figure at the end."""
    import re

    labs = sorted(Path(__file__).resolve().parents[1].joinpath("labs").glob("*.ipynb"))
    assert len(labs) >= 12
    live = r"(LivePlot|LiveBars|ServingDashboard|RoutingHeatmap)"
    for lab in labs:
        code = "\n".join(
            "".join(c["source"]) for c in json.loads(lab.read_text())["cells"] if c["cell_type"] == "code"
        )
        assert re.search(r"from llmlab\.viz(\.\w+)? import [^\n]*" + live, code), lab.name
        assert re.search(r"\.(update|on_step)\b", code), lab.name  # fed while the work runs


@pytest.mark.parametrize("gpus", range(1, 9))
def test_every_lab_layout_validates_on_1_to_8_gpus(monkeypatch, gpus):
    """Mocked GPU counts: each lab's rank count must pass the trainer's validation for every
    layout the lab trains (3 GPUs once gave tp=3 on 8 heads and pp=3 on 8 layers)."""
    import llmlab.runtime.hardware as hw
    from llmlab.training.config import TrainConfig, validate

    monkeypatch.delenv("LLMLAB_DEVICE", raising=False)
    monkeypatch.setattr(hw, "gpu_count", lambda: gpus)
    for lab in LAB_SIZES:
        s = lab_size_for(lab)
        if s.device != "cuda":
            assert gpus < LAB_SIZES[lab]["min_ranks"], lab  # enough GPUs never fall back to CPU
            continue
        assert s.world_size <= gpus and s.backend == "nccl"
        for kw in LAB_LAYOUTS.get(lab, lambda n: [])(s.world_size):
            validate(TrainConfig(model=s.model, device="cpu", **kw))
    want = {3: (2, 2, 2), 5: (4, 4, 4), 6: (4, 4, 4), 7: (4, 4, 4)}
    if gpus in want:
        assert (
            tuple(
                lab_size_for(lab).world_size
                for lab in ("02_tensor_parallel", "03_pipeline_parallel", "05_zero")
            )
            == want[gpus]
        )
    assert lab_layout_error("02_tensor_parallel", 3, "small") is not None
