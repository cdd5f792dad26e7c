"""Lab 03 exercises: reference solutions (each docstring is the exercise statement)."""
from __future__ import annotations



def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """Lab 03. The 1F1B action list of one pipeline stage (PipeDream-Flush; Narayanan et al. 2021
    §2.2): ``min(num_stages - stage - 1, m)`` warm-up forwards, then alternate one forward and one
    backward, then the remaining backwards. Actions are ``("F", mb)`` / ``("B", mb)``."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    acts = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while f < m:
        acts.append(("F", f))
        f += 1
        acts.append(("B", b))
        b += 1
    acts += [("B", i) for i in range(b, m)]
    return acts


EXERCISES = [one_f_one_b]
