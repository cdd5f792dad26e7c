"""Shared test settings for tests/ and the labs/ notebooks (nbval kernels inherit this env).

Ranks are real processes (gloo on CPU); keep every test small.
"""
import json
import os

# Notebook kernels are separate processes: let them import this checkout's llmlab even when the
# package is not installed (pytest's own `pythonpath` setting reaches only this process).
_root = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_root, os.environ.get("PYTHONPATH")) if p)

os.environ.setdefault("LLMLAB_LIVE", "0")          # plots redraw once, at the end
os.environ.setdefault("LLMLAB_PG_TIMEOUT", "120")  # a stuck collective fails within 2 minutes
os.environ.setdefault("LLMLAB_SOLUTIONS", "1")     # labs run their exercise cells with the solutions

# Without an NVIDIA GPU the Triton kernels run in Triton's interpreter; it must be chosen before
# triton is first imported.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402


def pytest_report_header(config):
    """Which CPU fast paths this run exercises (llmlab.kernels.cpu_isa; LLMLAB_CPU_ISA lowers
    the level: the suite then runs as a smaller CPU would)."""
    import torch

    from llmlab.kernels import cpu_build, cpu_isa, cpu_linear
    try:
        level = cpu_isa.cpu_isa()
    except ValueError as e:
        return f"llmlab CPU fast paths: {e}"
    packed = "/".join(cpu_linear.path(d) for d in (torch.float32, torch.bfloat16, torch.float16))
    march = next((f for f in cpu_build.flags() if f.startswith("-march")), "no -march")
    low = cpu_isa.fallback()
    amx = {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_isa.effective_flags()  # (amx_linear)
    panels = {"avx2", "fma"} <= cpu_isa.effective_flags()  # (panel_linear's fp32 kernel)
    return (f"llmlab CPU fast paths: level {level} (this CPU: {cpu_isa.detected()}, {cpu_isa.ENV}="
            f"{os.environ.get(cpu_isa.ENV, 'unset')}); packed linear fp32/bf16/fp16: {packed}"
            f"{', fp32 decode batches in panels' if panels else ''}"
            f"{', bf16 decode batches on AMX tiles' if amx else ''}; "
            f"C++ kernels {march}" + (f"; the kernel tests also force {low}" if low else ""))


@pytest.fixture(scope="session", autouse=True)
def _metrics_files_follow_the_schema():
    """Every metrics JSON a test writes (``--metrics-json``, ``TrainConfig(metrics_json=...)``) is
    validated against llmlab/metrics/train_metrics.schema.json before it is written (session
    scope, so that module-scoped fixtures that train are covered too)."""
    from llmlab.metrics.schema import validate_train_metrics
    from llmlab.training import trainer
    write = trainer.write_metrics

    def validated(metrics, path):
        validate_train_metrics(json.loads(json.dumps(metrics, allow_nan=False)))  # strict JSON, as a reader sees it
        write(metrics, path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "write_metrics", validated)
        yield
