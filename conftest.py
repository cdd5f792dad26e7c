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
