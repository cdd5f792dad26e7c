"""The server's and the client's latencies of the same requests, side by side (lab 11, section 3).

The server's clock starts when its HTTP handler hands a request to the engine (the wait for the
engine thread included, not when that thread picks the request up between steps); each finished
request's own times stay in ``ReplicaMetrics.recent`` and the load test keeps each response's id,
so both sides of one request can be matched. One process, one ``perf_counter``: the server's
arrival follows the client's send, and the server's first token precedes the client's first chunk."""

import time

from llmlab.serve import start_server
from llmlab.serve.load_test import bench_endpoint
from llmlab.serve.metrics import histogram_buckets, scrape


def test_server_and_client_times_of_the_same_requests_are_ordered(monkeypatch):
    with start_server("shakespeare", max_num_seqs=4, num_gpu_blocks=128, block_size=8) as s:
        eng = s.engines[0]
        real_add = eng.engine.add_request
        admitted = {}

        def add_request(prompt, params, request_id=None, arrival_time=None):
            admitted[request_id] = time.perf_counter()
            time.sleep(0.05)  # the engine thread is late picking requests up
            return real_add(prompt, params, request_id=request_id, arrival_time=arrival_time)

        monkeypatch.setattr(eng.engine, "add_request", add_request)
        run = bench_endpoint(
            s.url,
            [float("inf")],
            num_requests=6,
            prompt_len_median=8,
            output_len_median=4,
            seed=0,
            return_requests=True,
        )["rates"][0]
        server = {r["request_id"].rsplit("-", 1)[0]: r for r in eng.metrics.recent}
        assert run["completed"] == 6 and len({q["id"] for q in run["requests"]}) == 6
        for q in run["requests"]:
            r = server[q["id"]]
            assert q["send"] <= r["arrival"] <= r["first_token"] <= q["first_token"], (q, r)
            assert r["finish"] <= q["finish"]
            # the clock started before the engine thread admitted it: the wait is in the TTFT
            wait = admitted[f"{q['id']}-0"] - r["arrival"]
            assert wait > 0 and r["first_token"] - r["arrival"] >= wait + 0.05
        ttft = dict(histogram_buckets(scrape(s.url), "llmlab:time_to_first_token_seconds"))
        assert ttft[float("inf")] == 6
