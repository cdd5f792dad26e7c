"""``llmlab doctor --selftest [--quick] [--json PATH]``: prove on this machine, in one command, that
the kernels, the engine, training on one device and every parallel layout compute what their
references compute, and measure what the machine does.

Each check runs in its own Python process with its own timeout (a hang is a FAIL, the process
group is killed, nothing is left running) and prints one line: ``PASS``, ``FAIL`` (with the error)
or ``SKIP`` (with the reason: a check the hardware cannot run), with its measured numbers.
``--json`` writes ``{"checks": {name: {"status", "seconds", ...}}, "machine": {...}}``;
the exit code is 1 if any check fails. ``--quick`` runs every check on smaller sizes (<= 2 minutes
on a 2-core CPU; the test suite runs it).

Layout: :mod:`~llmlab.selftest.runner` (:data:`CHECKS`, the process per check, the report, the
``python -m llmlab.selftest NAME [--quick]`` entry), the checks by kind in
:mod:`~llmlab.selftest.kernels`, :mod:`~llmlab.selftest.cpu_kernels`, :mod:`~llmlab.selftest.engine` and :mod:`~llmlab.selftest.training`.

Checks (:data:`CHECKS`, in order):

* ``flash_attention_fwd``, ``flash_attention_bwd``, ``fused_rmsnorm``, ``fused_swiglu``,
  ``paged_attention_decode``, ``paged_attention_prefill``: the Triton kernels (compiled on a GPU,
  Triton's interpreter on CPU) against their PyTorch references in fp32/fp16/bf16 (bf16 ``tl.dot``
  kernels only on a GPU: Triton 3.9's interpreter multiplies bf16 dot operands as raw bits);
* ``cpu_packed_linear``, ``cpu_paged_attention``, ``cpu_fused_ops``: the CPU fast paths (oneDNN
  prepacked linear, C++ PagedAttention and fused operators) against their references in fp32 and
  bf16, each reporting the path this CPU took (:mod:`~llmlab.selftest.cpu_kernels`; a broken fast
  path is a FAIL);
* ``engine_greedy_vs_hf``: the paged-KV engine's greedy tokens equal Hugging Face ``generate``
  (fp64, a random Llama checkpoint); ``engine_device_vs_cpu`` (GPU): CUDA tokens equal CPU fp32
  tokens up to the first step whose top-2 logit margin is below the dtype's tolerance;
* ``train_one_device``: bf16 training within 2% of fp32 over 20 steps (trailing 5-step loss
  means; ``small`` on a GPU, ``tiny`` on CPU);
* ``train_layouts``: DP, TP, PP (GPipe, 1F1B, interleaved), EP and ZeRO 1-3 on 2 real ranks
  (NCCL with >= 2 GPUs, gloo otherwise) equal one device, plus one interleaved run whose
  activations exceed NCCL's buffers;
* ``collectives``: all-reduce / all-gather / reduce-scatter results checked, bus bandwidth;
* ``mfu``: achieved model FLOP/s of a training run over the peak of its dtype (figure shown);
* ``paged_attention_bandwidth``: bytes of K/V read per second by paged decode over the peak.
"""

from llmlab.selftest.common import FAIL, PASS, SKIP, Skip
from llmlab.selftest.runner import CHECKS, format_line, run_check, run_check_here, run_selftest

__all__ = [
    "CHECKS",
    "FAIL",
    "PASS",
    "SKIP",
    "Skip",
    "format_line",
    "run_check",
    "run_check_here",
    "run_selftest",
]
