"""asv: what llmlab's profiler hooks cost when no profiler records (issue 44: "profiling off costs
nothing measurable"). ``time_phase_off`` is one hook as the pipeline enters it (its label's
arguments built, then ``phase()`` reading the profiler flag and returning the shared no-op
context); ``track_hooks_share_of_step`` is the hooks' cost in one training step (hooks per step,
counted in a profiled step, times that cost) as a fraction of the step's CPU time."""

import time

import torch

HOOKS_PER_CALL = 100


def _hook_loop(phase, acts) -> None:
    for _ in range(HOOKS_PER_CALL):
        with phase("pp p2p", actions=",".join(map(str, acts))):
            pass


class ProfilingOff:
    timeout = 300
    timer = time.process_time
    rounds = 1  # asv_compare.py interleaves its own rounds (--rounds) of each commit

    def setup(self):
        try:  # a commit before the hooks has nothing to measure: asv skips the benchmark
            from llmlab.metrics.profiling import phase
        except ImportError:
            raise NotImplementedError("no llmlab.metrics.profiling at this commit") from None
        from llmlab.parallel.pipeline_schedules import Action

        torch.set_num_threads(1)
        self.phase, self.acts = phase, [Action("SEND_ACT", 0, 1, 1), Action("RECV_GRAD", 0, 0, 1)]

    def time_phase_off(self):
        """``HOOKS_PER_CALL`` hooks entered and left with profiling off."""
        _hook_loop(self.phase, self.acts)

    def track_hooks_share_of_step(self):
        """(llmlab.* regions in one step of the one-rank tiny-model step) x (CPU time of one hook)
        / (CPU time of the step), best of 5 each: the share of a step the hooks take."""
        from .train import TrainStep

        bench = TrainStep()
        bench.setup()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            bench.time_train_step()
        hooks = sum(e.count for e in prof.key_averages() if e.key.startswith("llmlab."))
        step, hook = [], []
        for _ in range(5):
            t0 = time.process_time()
            bench.time_train_step()
            t1 = time.process_time()
            _hook_loop(self.phase, self.acts)
            step.append(t1 - t0)
            hook.append((time.process_time() - t1) / HOOKS_PER_CALL)
        return hooks * min(hook) / min(step)

    track_hooks_share_of_step.unit = "fraction"
