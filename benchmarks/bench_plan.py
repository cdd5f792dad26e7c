"""How long `llmlab plan` takes: 8B on 8 GPUs and 70B on 1024 GPUs (target: seconds, < 60 s).

    python benchmarks/bench_plan.py
"""
import time

import llmlab

for name, kw in (("8e9 on 8 x a800", dict(params=8e9, num_gpus=8, cluster="a800")),
                 ("llama3-70b on 1024 x h100", dict(model="llama3-70b", num_gpus=1024, cluster="h100")),
                 ("7e10 on 1024 x h100", dict(params=7e10, num_gpus=1024, cluster="h100"))):
    t0 = time.perf_counter()
    r = llmlab.plan(**kw)
    dt = time.perf_counter() - t0
    best = r["layouts"][0]
    print(f"{name:<28} {r['num_layouts']:>6} layouts in {dt:6.2f} s  (target < 60 s: "
          f"{dt / 60:.3f} of it); best {best['name']} zero{best['zero']} m{best['num_microbatches']} "
          f"{best['step_time_s']:.2f} s/step MFU {best['mfu']:.2f}")
