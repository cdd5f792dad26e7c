"""Lab 00 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations



def training_memory_bytes(num_params: int, bytes_per_param: int = 4, optimizer_states: int = 2) -> dict:
    """Lab 00. Bytes of parameters, gradients and optimizer states for plain fp32 Adam training:
    return ``{"params", "grads", "optimizer_states"}`` (Adam keeps ``optimizer_states`` = 2 fp32
    tensors per parameter: m and v)."""
    return {"params": num_params * bytes_per_param, "grads": num_params * bytes_per_param,
            "optimizer_states": num_params * bytes_per_param * optimizer_states}


EXERCISES = [training_memory_bytes]
