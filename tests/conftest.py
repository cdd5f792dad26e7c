"""Shared test settings: ranks are real processes (gloo on CPU); keep every test small."""
import os

os.environ.setdefault("LLMLAB_LIVE", "0")
os.environ.setdefault("LLMLAB_PG_TIMEOUT", "120")

# Triton kernels run on CPU only through Triton's interpreter, which must be chosen before
# triton is first imported (tests/test_kernels_triton.py). Harmless when triton is absent.
if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "" or not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
