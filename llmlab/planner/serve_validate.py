"""The serving planner against llmlab's engine on this machine (``llmlab plan --serve --calibrate``).

* :func:`engine_kv_pool`: the engine's own KV pool (``num_gpu_blocks``, cut from
  ``kv_cache_memory_bytes`` by :func:`llmlab.inference.engine.default_gpu_blocks`) and its own
  concurrency: how many requests of a given length its scheduler admits at once into that pool.
  :func:`predicted_kv_pool` is the planner's answer for the same model, block size and memory.
* :func:`calibrate_serving`: this machine's memory bandwidth (a large sum: bytes read / s),
  matmul FLOP/s, and the engine's fixed cost of a step (a one-sequence decode step less its
  roofline time), the numbers the decode model needs.
* :func:`validate_serving`: decode step times measured on the engine over batch sizes and
  context lengths against the planner's prediction with the calibrated numbers: relative errors
  and the Spearman rank correlation.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from llmlab.planner.cluster import ClusterSpec
from llmlab.planner.serve_spec import ServeModel, ServeWorkload

VALIDATION_MODEL: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def serve_model_from_model_config(mc: Any) -> ServeModel:
    """A :class:`ServeModel` of an llmlab :class:`~llmlab.model.config.ModelConfig` (or an
    engine's ``model_config``)."""
    n = mc.num_parameters()
    return ServeModel(
        mc.name,
        mc.num_hidden_layers,
        mc.hidden_size,
        mc.num_attention_heads,
        mc.num_key_value_heads,
        mc.head_dim,
        mc.intermediate_size,
        mc.vocab_size,
        n,
        n,
        mc.max_position_embeddings,
        mc.sliding_window,
        len(mc.sliding_window_layers),
    )


def _machine(hbm: float = 1e10, flop_rate: float = 1e10) -> ClusterSpec:
    return ClusterSpec(
        num_gpus=1,
        gpus_per_node=1,
        gpu_memory_bytes=1e12,
        peak_flops={"fp32": flop_rate, "bf16": flop_rate, "fp16": flop_rate},
        intra_bandwidth=1e9,
        inter_bandwidth=1e9,
        achievable_fraction=1.0,
        reserved_bytes=0,
        name="this machine",
        overlap=False,
    )


def predicted_kv_pool(
    model: ServeModel,
    block_size: int,
    kv_cache_memory_bytes: int,
    max_model_len: int,
    seq_len: int | None = None,
    dtype: str = "fp32",
) -> dict:
    """The planner's KV pool on one device given the engine's KV budget: blocks, tokens and how
    many sequences of ``max_model_len`` (and of ``seq_len``) it holds at once."""
    from llmlab.planner.serve_api import plan_serve

    seq_len = seq_len or max_model_len
    w = ServeWorkload(
        prompt_len=max(1, seq_len - 1),
        output_len=1,
        max_model_len=max_model_len,
        weight_dtype=dtype,
        block_size=block_size,
        max_num_seqs=10**9,
    )
    row = plan_serve(
        model,
        cluster=_machine(),
        num_gpus=1,
        workload=w,
        hbm_bandwidth=1e10,
        kv_budget_bytes=kv_cache_memory_bytes,
    )["layouts"][0]
    return {
        "num_blocks": row["kv_blocks"],
        "kv_tokens": row["kv_tokens"],
        "concurrency_max_len": row.get("max_concurrency_per_instance", 0),
        "concurrency_seq_len": row.get("concurrency_at_workload", 0),
        "kv_bytes_per_token": row["kv_bytes_per_token"],
        "fits": row["fits"],
    }


def engine_kv_pool(
    model: Any, block_size: int, kv_cache_memory_bytes: int, max_model_len: int, seq_len: int | None = None
) -> dict:
    """The engine's pool (``num_gpu_blocks``, cache tensor bytes) and how many requests of
    ``max_model_len`` (and ``seq_len``) tokens its scheduler admits into it at once."""
    from llmlab.inference.engine import LLMEngine
    from llmlab.inference.sampling import SamplingParams

    out: dict[str, Any] = {}
    for key, n_tok in (
        ("concurrency_max_len", max_model_len),
        ("concurrency_seq_len", seq_len or max_model_len),
    ):
        eng = LLMEngine(
            model,
            device="cpu",
            block_size=block_size,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            max_num_seqs=10**6,
            max_num_batched_tokens=10**9,
        )
        per_seq = -(-n_tok // block_size)
        for _ in range(eng.num_gpu_blocks // per_seq + 2):
            eng.add_request({"prompt_token_ids": [1] * n_tok}, SamplingParams(max_tokens=1))
        out[key] = len(eng.scheduler.schedule().scheduled)
        out |= {
            "num_blocks": eng.num_gpu_blocks,
            "kv_cache_bytes": eng.runner.kv_cache_bytes,
            "model": serve_model_from_model_config(eng.model_config),
        }
        eng.shutdown()
    return out


def calibrate_serving(seconds: float = 0.3) -> dict:
    """This machine's memory bandwidth (B/s, best of repeated sums over 256 MiB), fp32 matmul
    FLOP/s (best of repeated 512 x 512 x 2048 products), and the engine's costs the roofline
    leaves out, fitted to decode steps of 1 and 16 sequences of 16 tokens: ``overhead_s`` per
    step and ``per_seq_s`` per sequence."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the engine is measured
    try:
        bw, fl = _bandwidth_and_flops(torch, seconds)
    finally:
        torch.set_num_threads(threads)
    here = {"hbm_bandwidth": bw, "flop_rate": fl, "overhead_s": 0.0, "per_seq_s": 0.0}
    one, many = measure_decode_step(1, 16), measure_decode_step(16, 16)
    roof_one, roof_many = predict_decode_step(here, 1, 16), predict_decode_step(here, 16, 16)
    here["per_seq_s"] = max(0.0, ((many - roof_many) - (one - roof_one)) / 15)
    here["overhead_s"] = max(0.0, one - roof_one - here["per_seq_s"])
    return here


def _bandwidth_and_flops(torch: Any, seconds: float) -> tuple[float, float]:
    x = torch.ones(64 * 2**20)  # 256 MiB of fp32
    a, b = torch.randn(512, 512), torch.randn(512, 2048)
    bw = fl = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or not (bw and fl):
        t0 = time.perf_counter()
        x.sum()
        bw = max(bw, x.numel() * 4 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        a @ b
        fl = max(fl, 2 * 512 * 512 * 2048 / (time.perf_counter() - t0))
    return bw, fl


def _model_config() -> Any:
    from llmlab.model.config import ModelConfig

    return ModelConfig(name="serve-validation", **VALIDATION_MODEL)


def predict_decode_step(here: dict, batch: int, context: int, new_tokens: int = 12) -> float:
    """Predicted seconds of one decode step of ``batch`` sequences whose context grows from
    ``context`` over ``new_tokens`` steps (the planner's TPOT) plus the engine's calibrated
    costs: a fixed one per step and one per sequence (Python bookkeeping the roofline omits)."""
    from llmlab.planner.serve_api import plan_serve

    m = serve_model_from_model_config(_model_config())
    w = ServeWorkload(
        prompt_len=context,
        output_len=new_tokens,
        max_model_len=m.max_position,
        concurrency=batch,
        weight_dtype="fp32",
        max_num_seqs=10**6,
    )
    row = plan_serve(
        m,
        cluster=_machine(here["hbm_bandwidth"], here["flop_rate"]),
        num_gpus=1,
        workload=w,
        hbm_bandwidth=here["hbm_bandwidth"],
        kv_budget_bytes=2**30,
    )["layouts"][0]
    return row["tpot_s"] + here["overhead_s"] + here.get("per_seq_s", 0.0) * batch


def measure_decode_step(batch: int, context: int, new_tokens: int = 12) -> float:
    """Fastest of the engine's decode steps (no prefill in the step; the least disturbed on a
    loaded machine) with ``batch``
    sequences of ``context`` prompt tokens each generating ``new_tokens``."""
    import torch

    from llmlab.inference.engine import LLMEngine
    from llmlab.inference.sampling import SamplingParams

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a loaded machine cannot stall a step on a lagging one
    try:
        return _measure(LLMEngine, SamplingParams, batch, context, new_tokens)
    finally:
        torch.set_num_threads(threads)


def _measure(LLMEngine: Any, SamplingParams: Any, batch: int, context: int, new_tokens: int) -> float:
    eng = LLMEngine(
        _model_config(),
        device="cpu",
        max_num_seqs=batch,
        kv_cache_memory_bytes=2**28,
        max_num_batched_tokens=max(2048, batch * context),
    )
    for i in range(batch):
        eng.add_request(
            {"prompt_token_ids": [(7 * i + j) % 250 + 1 for j in range(context)]},
            SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0),
        )
    while eng.has_unfinished_requests():
        eng.step()
    steps = [s.duration_s for s in eng.step_metrics if s.num_prefill_tokens == 0 and s.num_seqs == batch]
    eng.shutdown()
    return min(steps)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (no ties expected)."""

    def ranks(v: list[float]) -> list[int]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0] * len(v)
        for i, k in enumerate(order):
            r[k] = i
        return r

    rx, ry, n = ranks(xs), ranks(ys), len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


POINTS = ((1, 32), (4, 128), (16, 64), (8, 512), (32, 256), (32, 512))


def validate_serving(here: dict, points: tuple = POINTS) -> dict:
    """Predicted against measured decode step times at ``(batch, context)`` points."""
    rows = []
    for b, c in points:
        p, m = predict_decode_step(here, b, c), measure_decode_step(b, c)
        rows.append({"batch": b, "context": c, "predicted_s": p, "measured_s": m, "rel_err": m / p - 1})
    return {
        "calibration": here,
        "points": rows,
        "spearman": spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]),
        "median_abs_rel_err": statistics.median(abs(r["rel_err"]) for r in rows),
    }


def format_serve_validation(v: dict) -> str:
    lines = [f"{'batch':>5} {'context':>7} {'pred ms':>8} {'meas ms':>8} {'err':>7}"]
    for r in v["points"]:
        lines.append(
            f"{r['batch']:>5} {r['context']:>7} {r['predicted_s'] * 1e3:>8.2f} "
            f"{r['measured_s'] * 1e3:>8.2f} {r['rel_err']:>+7.0%}"
        )
    lines.append(
        f"decode step time: Spearman {v['spearman']:.2f} over {len(v['points'])} points, "
        f"median |relative error| {v['median_abs_rel_err']:.0%}"
    )
    return "\n".join(lines)
