"""Broadcast a small structured message between ranks without pickle.

``torch.distributed.broadcast_object_list`` pickles on the sender and *unpickles* on the
receivers: whoever can write to the job's sockets can make every rank run code. llmlab's own
control messages (a serving step's attention metadata, the cache sizes rank 0 chose) are plain
data, so they travel as what they are: a JSON header (ints, floats, strings, booleans, lists,
dicts) followed by the tensors it names, each broadcast as a tensor. A receiver only parses JSON
and fills tensors of the announced dtypes and shapes; a header that is not valid JSON or names a
dtype outside :data:`DTYPES` is refused with ``ValueError``.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from llmlab.runtime.comm import Group
from typing import Any

DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_TENSOR = "__tensor__"


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {
            _TENSOR: len(tensors) - 1,
            "dtype": str(obj.dtype).removeprefix("torch."),
            "shape": list(obj.shape),
        }
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, dict):
        if any(not isinstance(k, str) for k in obj):
            raise TypeError("message dict keys must be strings")
        return {k: _flatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot send a {type(obj).__name__} in a message (JSON data and tensors only)")


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"message names dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def _specs(obj: Any, out: list[Any]) -> list[Any]:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            out.append(obj)
        else:
            for v in obj.values():
                _specs(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _specs(v, out)
    return out


def _rebuild(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if _TENSOR in obj:
            return tensors[obj[_TENSOR]]
        if "__dtype__" in obj:
            return _dtype(obj["__dtype__"])
        return {k: _rebuild(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, tensors) for v in obj]
    return obj


def broadcast_message(
    msg: Any = None, src: int = 0, group: Group = None, device: torch.device | str = "cpu"
) -> Any:
    """Collective over ``group``: rank ``src`` passes ``msg`` (JSON-able data whose leaves may be
    tensors or ``torch.dtype`` s; tuples arrive as lists), every rank returns it. Tensors arrive on
    ``device`` (a CUDA device under NCCL). Bytes moved: 8 (header length) + header + tensors.

    Raises ``TypeError`` on the sender for a value that is neither JSON data nor a tensor, and
    ``ValueError`` on a receiver for a header that is not a valid message.
    """
    device = torch.device(device)
    is_src = dist.get_rank() == src
    tensors: list[Any] = []
    if is_src:
        header = json.dumps(_flatten(msg, tensors)).encode()
        n = torch.tensor([len(header)], dtype=torch.int64, device=device)
    else:
        n = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(n, src=src, group=group)
    buf = (
        torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
        if is_src
        else torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buf, src=src, group=group)
    if is_src:
        tree = json.loads(header)
        out = [t.to(device).contiguous() for t in tensors]
    else:
        try:
            tree = json.loads(bytes(buf.cpu().tolist()).decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"received a message that is not valid JSON: {e}") from None
        out = []
        for i, spec in enumerate(_specs(tree, [])):
            if (
                spec.get(_TENSOR) != i
                or not isinstance(spec.get("shape"), list)
                or not all(isinstance(d, int) and d >= 0 for d in spec["shape"])
            ):
                raise ValueError(f"received a malformed tensor entry {spec!r}")
            out.append(torch.empty(spec["shape"], dtype=_dtype(spec["dtype"]), device=device))
    for t in out:
        dist.broadcast(t, src=src, group=group)
    return _rebuild(tree, out)
