"""``llmlab bench serve --endpoint URL``: load an OpenAI-compatible server over HTTP.

As vLLM's ``benchmark_serving``: the seeded ShareGPT-like workload of
:func:`llmlab.inference.workload.sharegpt_workload` (heavy-tailed prompt and output lengths; prompts
as token ids < 256, valid for any vocabulary of at least 256) is sent to ``/v1/completions`` with
Poisson arrivals at each ``request_rate`` (``inf``: all at once), streamed, greedy, with
``ignore_eos`` so every request produces exactly its output length. Each request's times are
taken on the client: send, first streamed token, last token. Per rate:

- ``throughput_tokens_per_s``: generated tokens / (last finish - first send);
- ``request_throughput_per_s``: completed requests / the same duration;
- ``ttft_s``, ``tpot_s``, ``e2e_s``: ``{"p50", "p99"}`` (definitions in
  :mod:`llmlab.inference.metrics`);
- ``goodput_requests_per_s``: completed requests meeting every given SLO (TTFT <= ``slo_ttft``,
  TPOT <= ``slo_tpot``, seconds) per second (DistServe, Zhong et al., OSDI 2024 §2; vLLM's
  ``--goodput``); equal to ``request_throughput_per_s`` without SLOs.

Requests run on client threads (one per request in flight, stdlib ``http.client``), so the client
needs nothing beyond Python. JSON shape: CONTRACT ``llmlab bench serve --endpoint``.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
from urllib.parse import urlparse

from llmlab.inference.workload import poisson_arrivals, sharegpt_workload
from llmlab.inference.metrics import RequestTiming, summarize


def parse_rates(text: str) -> list[float]:
    """``"1,2,inf"`` -> ``[1.0, 2.0, inf]``. Raises ``ValueError`` for a rate <= 0 or junk."""
    rates = []
    for part in str(text).split(","):
        try:
            r = float(part)
        except ValueError:
            raise ValueError(
                f"--request-rate {text!r}: {part!r} is not a number (use e.g. 1,2,inf)"
            ) from None
        if not r > 0:
            raise ValueError(f"--request-rate {text!r}: every rate must be > 0 (inf: all at once)")
        rates.append(r)
    return rates


class _Endpoint:
    def __init__(self, url: str, api_key: str | None, timeout: float):
        u = urlparse(url if "://" in url else "http://" + url)
        if u.scheme != "http":
            raise ValueError(f"--endpoint {url!r}: only http:// endpoints are supported")
        if not u.hostname:
            raise ValueError(f"--endpoint {url!r}: no host name")
        self.host, self.port = u.hostname, u.port or 80
        self.base = u.path.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def get_json(self, path: str) -> dict:
        c = self.conn()
        try:
            c.request("GET", self.base + path, headers=self.headers)
            r = c.getresponse()
            body = r.read()
            if r.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {r.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            c.close()


def _one_request(ep: _Endpoint, model: str, prompt: list[int], max_tokens: int) -> dict:
    """Send one streamed completion; returns times (perf_counter) and token count, or an error."""
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    c = ep.conn()
    t_send = time.perf_counter()
    first = None
    tokens = None
    rid = None
    try:
        c.request("POST", ep.base + "/v1/completions", body=body, headers=ep.headers)
        r = c.getresponse()
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {r.read()[:200]!r}"}
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                return {"error": msg["error"].get("message", str(msg))}
            rid = rid or msg.get("id")
            if msg.get("choices") and first is None and msg["choices"][0].get("text"):
                first = time.perf_counter()
            if msg.get("usage"):
                tokens = msg["usage"]["completion_tokens"]
        end = time.perf_counter()
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        c.close()
    if first is None or tokens is None:
        return {"error": "the stream ended without tokens or usage"}
    return {"send": t_send, "first": first, "end": end, "tokens": tokens, "id": rid}


def run_rate(
    ep: _Endpoint,
    model: str,
    workload: dict,
    arrivals: list[float],
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    return_requests: bool = False,
) -> dict:
    """Send every request of ``workload`` at its arrival offset; the summary for one rate (with
    ``return_requests`` also ``"requests"``: ``{"send", "first_token", "finish",
    "num_output_tokens", "id"}`` of each completed request, seconds on the client's clock, ``id``
    the response's id)."""
    results: list[dict | None] = [None] * len(arrivals)

    def worker(i):
        results[i] = _one_request(ep, model, workload["prompts"][i], workload["output_lens"][i])

    threads = []
    t0 = time.perf_counter()
    for i, a in enumerate(arrivals):
        delay = t0 + a - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=worker, args=(i,), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    ok = [r for r in results if r and "error" not in r]
    errors = [r["error"] if r else "no result (its thread failed)" for r in results if not r or "error" in r]
    if not ok:
        raise RuntimeError(f"every request failed; first error: {errors[0] if errors else '?'}")
    timings = [RequestTiming(r["send"], r["first"], r["end"], r["tokens"]) for r in ok]
    s = summarize(timings)
    good = sum(
        1
        for t in timings
        if (slo_ttft is None or t.ttft <= slo_ttft)
        and (slo_tpot is None or t.tpot is None or t.tpot <= slo_tpot)
    )
    dur = s["duration_s"]
    extra = (
        {
            "requests": [
                {
                    "send": r["send"],
                    "first_token": r["first"],
                    "finish": r["end"],
                    "num_output_tokens": r["tokens"],
                    "id": r["id"],
                }
                for r in ok
            ]
        }
        if return_requests
        else {}
    )
    return {
        **extra,
        "completed": len(ok),
        "failed": len(errors),
        "errors": errors[:5],
        "duration_s": dur,
        "throughput_tokens_per_s": s["throughput_tokens_per_s"],
        "request_throughput_per_s": len(ok) / dur if dur > 0 else float("inf"),
        "goodput_requests_per_s": good / dur if dur > 0 else float("inf"),
        "ttft_s": s["ttft_s"],
        "tpot_s": s["tpot_s"],
        "e2e_s": s["e2e_s"],
        "num_output_tokens": s["num_output_tokens"],
    }


def bench_endpoint(
    endpoint: str,
    request_rates,
    *,
    num_requests: int = 64,
    seed: int = 0,
    model: str | None = None,
    api_key: str | None = None,
    slo_ttft: float | None = None,
    slo_tpot: float | None = None,
    prompt_len_median: float = 32.0,
    output_len_median: float = 32.0,
    length_sigma: float = 0.9,
    timeout: float = 600.0,
    return_requests: bool = False,
) -> dict:
    """Benchmark the server at ``endpoint`` (``http://host:port``) at each rate; the CONTRACT
    dict. ``model``: the id to send (default: the server's first model). Raises ``ValueError``
    for bad arguments or no server at ``endpoint``, ``RuntimeError`` when every request fails.
    ``return_requests``: keep each request's times in its rate's entry (see :func:`run_rate`)."""
    if num_requests < 1:
        raise ValueError(f"--num-requests {num_requests} must be >= 1")
    for name, v in (("--slo-ttft", slo_ttft), ("--slo-tpot", slo_tpot)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} {v} must be > 0 seconds")
    rates = (
        parse_rates(request_rates) if isinstance(request_rates, str) else [float(r) for r in request_rates]
    )
    ep = _Endpoint(endpoint, api_key, timeout)
    try:
        models = ep.get_json("/v1/models")["data"]
    except OSError as e:
        raise ValueError(f"--endpoint {endpoint}: no server answers ({e})") from None
    entry = next((m for m in models if model in (None, m["id"])), None)
    if entry is None:
        raise ValueError(
            f"--served-model {model!r} is not served at {endpoint} (it serves {[m['id'] for m in models]})"
        )
    max_len = int(entry.get("max_model_len") or 512)
    wl = sharegpt_workload(
        num_requests,
        seed=seed,
        max_len=max_len,
        vocab_size=256,
        prompt_len_median=prompt_len_median,
        output_len_median=output_len_median,
        sigma=length_sigma,
    )
    out = {
        "endpoint": endpoint,
        "model": entry["id"],
        "workload": {
            "num_requests": num_requests,
            "seed": seed,
            "prompt_lens": wl["prompt_lens"],
            "output_lens": wl["output_lens"],
        },
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "rates": [],
    }
    for rate in rates:
        arrivals = poisson_arrivals(num_requests, None if math.isinf(rate) else rate, seed)
        res = run_rate(ep, entry["id"], wl, arrivals, slo_ttft, slo_tpot, return_requests)
        out["rates"].append({"request_rate": rate, **res})
    return out


def print_table(res: dict) -> None:
    print(f"{res['model']} at {res['endpoint']}: {res['workload']['num_requests']} requests per rate")
    print(
        f"{'rate/s':>7} {'done':>5} {'fail':>4} {'tok/s':>8} {'req/s':>6} {'goodput':>7} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'e2e p99':>8}"
    )
    for r in res["rates"]:
        ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}ms"  # noqa: E731
        print(
            f"{r['request_rate']:>7g} {r['completed']:>5} {r['failed']:>4} "
            f"{r['throughput_tokens_per_s']:>8.1f} {r['request_throughput_per_s']:>6.2f} "
            f"{r['goodput_requests_per_s']:>7.2f} {ms(r['ttft_s']['p50']):>9} "
            f"{ms(r['ttft_s']['p99']):>9} {ms(r['tpot_s']['p50']):>9} {ms(r['tpot_s']['p99']):>9} "
            f"{r['e2e_s']['p99']:>7.2f}s"
        )
