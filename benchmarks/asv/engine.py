"""asv: the serving engine on the bundled shakespeare model, CPU, one thread: offline throughput
(all 16 requests at t=0) and TTFT/TPOT medians at a fixed Poisson rate of 20 requests/s
(``llmlab.inference.bench.bench_serve``, the ``llmlab bench serve`` workload, smaller)."""
from llmlab.inference.bench import bench_serve

WORKLOAD = dict(num_requests=16, prompt_len_median=16, output_len_median=16, check=False,
                num_threads=1, seed=0)


class EngineOffline:
    timeout = 300
    rounds, repeat, number = 3, 1, 1

    def track_time_per_token(self):
        """1 / offline throughput: asv flags an increase, so lower is better here too."""
        return 1.0 / bench_serve(**WORKLOAD)["llmlab"]["throughput_tokens_per_s"]

    track_time_per_token.unit = "seconds"


class EngineAtRate:
    timeout = 300
    rounds, repeat, number = 3, 1, 1

    def setup_cache(self):
        r = bench_serve(request_rate=20.0, **WORKLOAD)["llmlab"]
        return {"ttft": r["ttft_s"]["p50"], "tpot": r["tpot_s"]["p50"]}

    def track_ttft_p50(self, r):
        return r["ttft"]

    def track_tpot_p50(self, r):
        return r["tpot"]

    track_ttft_p50.unit = track_tpot_p50.unit = "seconds"
