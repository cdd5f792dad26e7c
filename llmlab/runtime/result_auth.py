"""What llmlab trusts of the bytes that come back from ranks: HMAC-tagged values and a JSON round trip.

The rendezvous store (and, under ``torchrun``, a peer's bytes) is reachable by any process on the
node, so every value a rank sends carries an HMAC-SHA256 tag (RFC 2104) over its key and body
under the job's secret: :func:`_sign` writes ``tag || body``, :func:`_verified` checks the tag
*before* anything is decoded and raises :class:`ForgedValueError` naming the rank and key.
Under ``torchrun`` the secret comes from the user (:func:`torchrun_secret`); without one, results
travel as JSON through :func:`_to_json` / :func:`_from_json`, which rebuild exactly the value
(None, bool, int, float, str, list, tuple, dict) and nothing else. Used by
:mod:`llmlab.runtime.launch`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Any


class ForgedValueError(RuntimeError):
    """A value llmlab reads from the rendezvous store (or, under torchrun, from a peer) does not
    carry this job's authentication tag: another process that reached the store's port wrote or
    changed it. Nothing of it was decoded. ``rank`` is the rank the value claims to come from,
    ``key`` the store key (``res/<rank>``, ``err/<rank>``, ``m/<rank>/<i>``, ``n/<rank>``).
    See docs/workshop.md, "Running on a shared node"."""

    def __init__(
        self,
        rank: int,
        key: str,
        why: str = "its HMAC tag does not match",
        where: str = "in the rendezvous store",
    ) -> None:
        self.rank, self.key = rank, key
        super().__init__(
            f"rank {rank}: the value of {key!r} {where} was forged or tampered with "
            f"({why}); it was rejected without being decoded. Some other process "
            f"reached the job's ports: see docs/workshop.md, 'Running on a shared node'"
        )


# --------------------------------------------------------------------------------------------
# Authentication of what travels through the store (HMAC-SHA256, RFC 2104)
# --------------------------------------------------------------------------------------------
_TAG_BYTES = 32


def _tag(secret: bytes, key: str, body: bytes) -> bytes:
    # The key is part of the message, so a genuine value moved to another key (rank 1's result
    # copied to res/0) does not verify either.
    return hmac.new(secret, key.encode() + b"\0" + body, hashlib.sha256).digest()


def _sign(secret: bytes, key: str, body: bytes) -> bytes:
    """``tag || body``: what a rank writes under ``key``."""
    return _tag(secret, key, body) + body


def _verified(secret: bytes, rank: int, key: str, blob: bytes, **where: str) -> bytes:
    """The body of a signed value, or :class:`ForgedValueError` before anything is decoded."""
    if len(blob) < _TAG_BYTES:
        raise ForgedValueError(rank, key, f"{len(blob)} bytes, shorter than the tag", **where)
    if not hmac.compare_digest(blob[:_TAG_BYTES], _tag(secret, key, blob[_TAG_BYTES:])):
        raise ForgedValueError(rank, key, **where)
    return blob[_TAG_BYTES:]


def torchrun_secret() -> bytes | None:
    """The job secret under torchrun: ``LLMLAB_SECRET``, else the contents of the file named by
    ``LLMLAB_SECRET_FILE``, else ``None``. Raises ``ValueError`` for an empty one."""
    if os.environ.get("LLMLAB_SECRET"):
        return os.environ["LLMLAB_SECRET"].encode()
    path = os.environ.get("LLMLAB_SECRET_FILE")
    if not path:
        return None
    data = Path(path).read_bytes().strip()
    if not data:
        raise ValueError(f"LLMLAB_SECRET_FILE={path} is empty")
    return data


def _verified_torchrun(secret: bytes, rank: int, blob: bytes) -> bytes:
    try:
        return _verified(secret, rank, f"res/{rank}", blob, where="received from the process group")
    except ForgedValueError:
        raise ForgedValueError(
            rank,
            f"res/{rank}",
            "its HMAC tag does not match: forged, or LLMLAB_SECRET differs between nodes",
            where="received from the process group",
        ) from None


_SCALARS = (type(None), bool, int, float, str)


def _to_json(v: Any) -> Any:
    """A JSON value that :func:`_from_json` turns back into exactly ``v`` (lists, tuples and
    dicts are tagged, so a tuple stays a tuple and dict keys keep their type)."""
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, list):
        return {"l": [_to_json(x) for x in v]}
    if isinstance(v, tuple):
        return {"t": [_to_json(x) for x in v]}
    if isinstance(v, dict):
        return {"d": [[_to_json(k), _to_json(x)] for k, x in v.items()]}
    raise TypeError(f"{type(v).__name__} is not JSON-encodable")


def _from_json(v: Any) -> Any:
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, dict) and len(v) == 1:
        ((tag, items),) = v.items()
        if isinstance(items, list):
            if tag == "l":
                return [_from_json(x) for x in items]
            if tag == "t":
                return tuple(_from_json(x) for x in items)
            if tag == "d" and all(isinstance(kv, list) and len(kv) == 2 for kv in items):
                out = {}
                for k, x in items:
                    k = _from_json(k)
                    try:
                        out[k] = _from_json(x)
                    except TypeError:
                        raise ValueError(f"unhashable dict key {k!r}") from None
                return out
    raise ValueError(f"unexpected JSON value {str(v)[:80]!r}")
