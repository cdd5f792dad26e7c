"""Lab 00 exercises: reference solutions (each docstring is the exercise statement)."""

from __future__ import annotations


def training_memory_bytes(num_params: int, bytes_per_param: int = 4, optimizer_states: int = 2) -> dict:
    """Lab 00. Bytes of parameters, gradients and optimizer states for plain fp32 Adam training:
    return ``{"params", "grads", "optimizer_states"}`` (Adam keeps ``optimizer_states`` = 2 fp32
    tensors per parameter: m and v)."""
    return {
        "params": num_params * bytes_per_param,
        "grads": num_params * bytes_per_param,
        "optimizer_states": num_params * bytes_per_param * optimizer_states,
    }


def training_flops_and_time(
    num_params: float, num_tokens: float, peak_flops_per_s: float, mfu: float, num_gpus: int = 1
) -> dict:
    """Lab 00. The compute wall: return ``{"flops": F, "seconds": t}`` for training a model of
    ``num_params`` parameters on ``num_tokens`` tokens, where ``F = 6·N·T`` FLOPs (2 per parameter
    per token forward, 4 backward; Kaplan et al. 2020, §2.1) and ``t = F / (num_gpus ·
    peak_flops_per_s · mfu)`` seconds (MFU, the model FLOPs utilisation in (0, 1]: PaLM, Chowdhery
    et al. 2022, App. B). The source articles' 8B model on 2.5e11 tokens at 312 TFLOP/s, MFU 1: 1.2e22 FLOPs,
    about 445 days."""
    flops = 6.0 * num_params * num_tokens
    return {"flops": flops, "seconds": flops / (num_gpus * peak_flops_per_s * mfu)}


def ring_all_reduce_seconds(
    nbytes: float, world_size: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Lab 00. The communication wall: seconds for one ring all-reduce of ``nbytes`` bytes over
    ``world_size`` ranks, each link carrying ``bandwidth_bytes_per_s`` (bytes/s): a reduce-scatter
    then an all-gather, each N-1 steps in which every rank sends one chunk of nbytes/N and pays the
    latency ``latency_s`` once, so ``2(N-1)·(latency_s + nbytes / (N · bandwidth))`` (the α-β
    model; Thakur, Rabenseifner & Gropp 2005). One rank (N = 1) sends nothing."""
    steps = 2 * (world_size - 1)
    return steps * (latency_s + nbytes / (world_size * bandwidth_bytes_per_s))


EXERCISES = [training_memory_bytes, training_flops_and_time, ring_all_reduce_seconds]
