"""asv: llmlab's kernels on CPU tensors (the dispatching entry points of ``llmlab.kernels``):
RMSNorm, SwiGLU, attention, and the paged-attention reference the engine falls back to."""
import time

import torch

from llmlab import kernels


class Kernels:
    """Each ``time_*`` times one call (asv picks the number of calls and repeats), in CPU time
    of one thread (``time.process_time``: a shared machine's waits for a core do not count)."""

    timer = time.process_time
    rounds = 1  # asv_compare.py interleaves its own rounds (--rounds) of each commit

    def setup(self):
        torch.manual_seed(0)
        torch.set_num_threads(1)          # a shared machine: one thread is the steadier measure
        self.x = torch.randn(512, 1024)
        self.w = torch.ones(1024)
        self.gate, self.up = torch.randn(512, 2048), torch.randn(512, 2048)
        self.q, self.k, self.v = (torch.randn(1, 4, 256, 32) for _ in range(3))

    def time_rms_norm(self):
        kernels.rms_norm(self.x, self.w)

    def time_swiglu(self):
        kernels.swiglu(self.gate, self.up)

    def time_attention(self):
        kernels.attention(self.q, self.k, self.v, causal=True)
