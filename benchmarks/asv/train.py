"""asv: training steps of the tiny model over a few layouts and the ZeRO stages.

``TrainStep.time_train_step`` (the quick subset's) times one optimizer step of one rank in this
process, in CPU time (``timer = time.process_time``: time the process ran, not time it waited
for a core of a shared machine), one thread. The multi-rank layouts launch 2 ranks with
``llmlab train``: each ``track_step_time`` is the median ``step_time_s`` (wall seconds) of steps
3..6 of a 6-step run (the first two warm up)."""
import statistics
import time

import torch

from llmlab.training.config import TrainConfig
from llmlab.training.trainer import train

BASE = dict(model="tiny", steps=6, global_batch_size=8, seq_len=64, device="cpu", seed=0)


def _median_step(**layout) -> float:
    m = train(TrainConfig(**(BASE | layout)), progress=False)
    return statistics.median(s["step_time_s"] for s in m["steps"][2:])


class TrainStep:
    """One rank, no parallelism: the model's forward, backward and AdamW on 8 x 64 tokens."""

    timeout = 300
    timer = time.process_time
    rounds = 1  # asv_compare.py interleaves its own rounds (--rounds) of each commit
    warmup_time = 0.5

    def setup(self):
        from llmlab.data import BatchLoader
        from llmlab.runtime.mesh import Mesh
        from llmlab.training.trainer import Engine
        torch.set_num_threads(1)
        cfg = TrainConfig(**BASE)
        self.engine = Engine(cfg, Mesh.build(), torch.device("cpu"))
        loader = BatchLoader(global_batch_size=8, seq_len=64, seed=0)
        self.micro = list(loader.microbatches(1, 0, 1, 1))

    def time_train_step(self):
        self.engine.train_step(self.micro, 1)


class TrainLayouts:
    """Two ranks: DDP, pipeline (1F1B, 2 micro-batches), tensor parallel."""

    timeout = 300
    params = ["dp2", "pp2", "tp2"]
    param_names = ["layout"]
    LAYOUTS = {"dp2": dict(dp=2), "pp2": dict(pp=2, num_microbatches=2), "tp2": dict(tp=2)}

    def track_step_time(self, layout):
        return _median_step(**self.LAYOUTS[layout])

    track_step_time.unit = "seconds"


class ZeroStages:
    """dp=2 with ZeRO stage 1, 2 and 3."""

    timeout = 300
    params = [1, 2, 3]
    param_names = ["zero"]

    def track_step_time(self, zero):
        return _median_step(dp=2, zero=zero)

    track_step_time.unit = "seconds"
