"""Soak: mixed good and bad requests against ``llmlab serve`` at a steady rate for minutes, then
check that nothing changed (not in CI; a few minutes on CPU).

    PYTHONPATH=$PWD python benchmarks/bench_serve_soak.py                       # 180 s at 4 req/s
    PYTHONPATH=$PWD python benchmarks/bench_serve_soak.py --duration 60 --rate 8 --json soak.json

The server (shipped model, in this process on an ephemeral port) gets, in a seeded random mix:
greedy and sampled completions and chats (streamed or not), ``echo`` + ``logprobs``, a legal
``logit_bias``; bad fields (NaN / 1e-40 temperature, 1e-40 repetition penalty, a logit bias over
100, an unknown field, too many prompts, too many stop strings); a body over the size limit
(413); clients that leave: a stream closed after its first chunk, a non-streamed request whose
socket is closed while it runs. At the end, once the server is idle, it checks and prints side by
side with the start: the greedy answer to a fixed prompt (same tokens), the free KV blocks (all
of them), the process's resident memory (growth under ``--max-rss-growth-mb``), ``/health`` 200,
and that every bad request got its 4xx and every good one its answer. Exit status 1 if any check
fails.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import socket
import time
import urllib.error
import urllib.request

import openai

from llmlab.serve import start_server

MODEL = "shakespeare"
BAD = {  # name -> (body, expected status)
    "nan_temperature": ({"prompt": "x", "temperature": float("nan")}, 400),
    "denormal_temperature": ({"prompt": "x", "temperature": 1e-40}, 400),
    "denormal_repetition_penalty": ({"prompt": "x", "repetition_penalty": 1e-40}, 400),
    "logit_bias_over_100": ({"prompt": "x", "logit_bias": {"65": 1000}}, 400),
    "unknown_field": ({"prompt": "x", "response_format": {"type": "json_object"}}, 400),
    "too_many_prompts": ({"prompt": ["x"] * 1000}, 400),
    "too_many_stops": ({"prompt": "x", "stop": [f"s{i}" for i in range(1000)]}, 400),
    "body_too_large": (None, 413),                      # sent by hand: see one()
}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({"model": MODEL, **body}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _greedy(c) -> list[str]:
    r = c.completions.create(model=MODEL, prompt="KING:", max_tokens=16, temperature=0, logprobs=0)
    return r.choices[0].logprobs.tokens


def _leave_non_streamed(server) -> None:
    body = json.dumps({"model": MODEL, "prompt": "ROMEO:", "max_tokens": 300,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(0.3)
    s.close()


def one(kind: str, server, c, rng: random.Random) -> tuple[str, bool]:
    """Send one request of ``kind``; returns (kind, answered as expected)."""
    if kind == "body_too_large":       # the headers announce 3 MiB; the answer comes before the body
        s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(3 * 2**20).encode() + b"\r\n\r\n" + b"{" * 1000)
        status = s.recv(64)
        s.close()
        return kind, status.startswith(b"HTTP/1.1 413")
    if kind in BAD:
        body, want = BAD[kind]
        return kind, _post(server.url, body) == want
    if kind == "leave_stream":
        stream = c.completions.create(model=MODEL, prompt="JULIET:", max_tokens=300, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        return kind, True
    if kind == "leave_non_streamed":
        _leave_non_streamed(server)
        return kind, True
    if kind == "chat":
        stream = rng.random() < 0.5
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Speak."}],
                                      max_tokens=rng.randint(4, 32), temperature=0.8,
                                      seed=rng.randrange(1000), stream=stream)
        if stream:
            return kind, any(ch.choices and ch.choices[0].finish_reason for ch in r)
        return kind, r.choices[0].finish_reason in ("stop", "length")
    if kind == "echo_logprobs":
        r = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=8, temperature=0,
                                 echo=True, logprobs=2)
        return kind, r.choices[0].logprobs.token_logprobs[0] is None
    if kind == "logit_bias":
        r = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=3, temperature=0.7,
                                 seed=1, logit_bias={"65": 100})
        return kind, r.choices[0].text == "AAA"
    r = c.completions.create(model=MODEL, prompt="ROMEO:", max_tokens=rng.randint(1, 48),
                             temperature=rng.choice([0.0, 0.8]), seed=rng.randrange(1000))
    return kind, r.choices[0].finish_reason in ("stop", "length")


KINDS = ["completion"] * 6 + ["chat"] * 3 + ["echo_logprobs", "logit_bias", "leave_stream",
                                             "leave_non_streamed"] + list(BAD)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of traffic")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (steady)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth-mb", type=float, default=300.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    with start_server(MODEL, max_num_seqs=16, num_gpu_blocks=512, block_size=8) as server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        eng = server.engines[0].engine
        greedy0, rss0 = _greedy(c), _rss_mb()
        results, futures = {}, []
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            k = 0
            while time.monotonic() - t0 < args.duration:
                kind = rng.choice(KINDS)
                futures.append(pool.submit(one, kind, server, c, random.Random(rng.random())))
                k += 1
                time.sleep(max(0.0, t0 + k / args.rate - time.monotonic()))
            for f in futures:
                try:
                    kind, ok = f.result(timeout=300)
                except Exception as e:                   # noqa: BLE001  (counted as a failure)
                    kind, ok = f"raised {type(e).__name__}", False
                results.setdefault(kind, [0, 0])[0 if ok else 1] += 1
        deadline = time.monotonic() + 60
        while (eng.has_unfinished_requests() or eng.requests) and time.monotonic() < deadline:
            time.sleep(0.1)
        greedy1, rss1 = _greedy(c), _rss_mb()
        health = urllib.request.urlopen(server.url + "/health", timeout=30).status
        free = eng.block_manager.num_free_blocks
        report = {"requests": len(futures), "seconds": round(time.monotonic() - t0, 1),
                  "by_kind": {k: {"as_expected": v[0], "not": v[1]} for k, v in sorted(results.items())},
                  "greedy_same": greedy0 == greedy1, "free_blocks": [free, eng.num_gpu_blocks],
                  "rss_mb": [round(rss0, 1), round(rss1, 1)], "health": health}
    print(json.dumps(report, indent=1))
    print(f"greedy answer before/after equal: {greedy0 == greedy1}; free KV blocks {free}/"
          f"{eng.num_gpu_blocks}; RSS {rss0:.0f} -> {rss1:.0f} MB ({rss1 / rss0:.2f}x); "
          f"/health {health}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = (greedy0 == greedy1 and free == eng.num_gpu_blocks and health == 200
          and rss1 - rss0 < args.max_rss_growth_mb and all(v[1] == 0 for v in results.values()))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
