"""Pipeline schedules as data: per rank, the list of actions the runner executes.

A schedule is a ``list[list[Action]]`` (one list per pipeline rank). Each :class:`Action` is a
forward ``F`` or backward ``B`` of one micro-batch through one model chunk, or a point-to-point
transfer: ``RECV_ACT``/``SEND_ACT`` (activations, forward direction) and
``RECV_GRAD``/``SEND_GRAD`` (their gradients, backward direction). The same lists are printed
(:func:`format_schedule`), simulated with unit costs (:func:`simulate`: deadlock check, ideal
timeline, theoretical bubble), drawn (:mod:`llmlab.viz.pipeline`) and executed on real ranks
(:mod:`llmlab.parallel.pipeline_parallel`). This is DeepSpeed's "instruction stream" idea.

With ``p`` ranks and ``v`` chunks per rank the model is cut into ``p*v`` *virtual stages*;
chunk ``c`` of rank ``r`` is virtual stage ``s = c*p + r`` (Megatron's interleaved placement), so
activations go ``r -> r+1`` and, between chunks, from the last rank back to rank 0.

Schedules (``m`` micro-batches):

* ``gpipe``: all ``m`` forwards, then all ``m`` backwards (Huang et al. 2019, GPipe, §2.2).
  Every rank holds the activations of all ``m`` micro-batches at once.
* ``1f1b``: rank ``r`` runs ``min(p-r-1, m)`` warm-up forwards, then alternates one forward and
  one backward (steady state), then drains the remaining backwards (cool-down) (PipeDream-Flush,
  Narayanan et al. 2021 "Memory-efficient pipeline-parallel DNN training"; Megatron-LM SC'21 §2.2.1).
  At most ``p-r`` micro-batches are in flight on rank ``r``. Same bubble as GPipe.
* ``interleaved``: 1F1B over ``v`` chunks per rank in Megatron's order (Narayanan et al. 2021,
  "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2.2.2):
  micro-batches go through the chunks in groups of ``p``; warm-up ``2(p-r-1) + (v-1)p`` forwards.
  Needs ``m % p == 0``. Bubble ``(p-1)/(v*m+p-1)`` of the flush, paid with ``v`` times more p2p.

Bubble fraction (CONTRACT): idle time over the total time of one flush, averaged over ranks;
:func:`bubble_fraction_theory` gives ``(p-1)/(m+p-1)`` (GPipe, 1F1B) or ``(p-1)/(v*m+p-1)``.
"""

from __future__ import annotations

from typing import Any

from typing import NamedTuple

from llmlab.formulas.pipeline import pipeline_bubble_fraction

F, B = "F", "B"
RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD = "RECV_ACT", "SEND_ACT", "RECV_GRAD", "SEND_GRAD"
COMPUTE = (F, B)
COMM = (RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD)
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    """One instruction. ``op``: F, B or a p2p op; ``chunk``: model chunk on this rank (0..v-1);
    ``mb``: micro-batch index; ``peer``: the other pipeline rank of a p2p op (else None)."""

    op: str
    chunk: int
    mb: int
    peer: int | None = None

    def __str__(self) -> str:
        c = f"{self.chunk}." if self.chunk else ""
        if self.op in COMPUTE:
            return f"{self.op}{c}{self.mb}"
        arrow = "<" if self.op.startswith("RECV") else ">"
        return f"{self.op[:4].lower()}{self.op[4:].lower()}{c}{self.mb}{arrow}{self.peer}"


def check_schedule_args(schedule: str, p: int, m: int, v: int = 1) -> None:
    """Raise ``ValueError`` naming the constraint a (schedule, p, m, v) combination breaks."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pp={p}, num_microbatches={m}, virtual_stages={v} must all be >= 1")
    if schedule == "interleaved":
        if v < 2:
            raise ValueError(f"the interleaved schedule needs --virtual-stages >= 2 (got {v})")
        if m % p:
            raise ValueError(
                f"the interleaved schedule needs num_microbatches={m} to be a "
                f"multiple of pp={p} (micro-batches go through the chunks in groups "
                f"of pp, Megatron-LM)"
            )
    elif v != 1:
        raise ValueError(
            f"--virtual-stages {v} needs --pp-schedule interleaved ({schedule} has one model chunk per rank)"
        )


def compute_order(schedule: str, p: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per rank, the order of ``(op, chunk, mb)`` forwards and backwards (no p2p yet)."""
    check_schedule_args(schedule, p, m, v)
    orders = []
    for r in range(p):
        if schedule == "interleaved":
            total = m * v

            def fwd(k: int, back: bool = False) -> tuple[int, int]:
                group, pos = divmod(k, p * v)  # groups of p micro-batches through all chunks
                chunk = pos // p
                return (v - 1 - chunk if back else chunk), group * p + pos % p

            warmup = min(total, 2 * (p - r - 1) + (v - 1) * p)
        else:
            total = m

            def fwd(k: int, back: bool = False) -> tuple[int, int]:
                return 0, k

            warmup = m if schedule == "gpipe" else min(m, p - r - 1)
        ops = [(F, *fwd(k)) for k in range(warmup)]
        nb = 0
        for k in range(warmup, total):  # steady state: one forward, one backward
            ops.append((F, *fwd(k)))
            ops.append((B, *fwd(nb, back=True)))
            nb += 1
        ops += [(B, *fwd(k, back=True)) for k in range(nb, total)]  # cool-down
        orders.append(ops)
    return orders


def build_schedule(
    schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0
) -> list[list[Action]]:
    """The full action list per rank: compute order plus the p2p each op needs.

    Point-to-point is placed in *synchronous rounds* (the bulk-synchronous idea behind Megatron's
    combined ``send_forward_recv_backward`` calls): the flush is replayed with costs ``t_f``/``t_b``
    (forward/backward of one chunk, any unit; backward ~ 2x forward by default), and at each
    instant every output finished since the last round is sent, in the same round in which its
    receiver posts the matching receive. So a rank's k-th batch (consecutive p2p actions, posted
    together as one ``batch_isend_irecv``) only ever pairs with its peers' batches of the same
    round, and the schedule cannot deadlock even if every send blocks until its receive is posted
    (NCCL: a large send completes only once the peer's matching batch runs; ``simulate(...,
    blocking_sends=True)`` checks it). Sends go out as soon as their data exists and receives are
    posted when the data is due, so with matching costs :func:`simulate` reproduces the
    theoretical bubble. Raises ``ValueError`` on invalid arguments or non-positive costs.
    """
    if t_f <= 0 or t_b <= 0:
        raise ValueError(f"t_f={t_f} and t_b={t_b} must be > 0")
    orders = compute_order(schedule, p, m, v)
    S = p * v
    acts: list[list[Action]] = [[] for _ in range(p)]
    nxt, busy = [0] * p, [0.0] * p
    arrived: list[set[Any]] = [set() for _ in range(p)]  # inputs (op, chunk, mb) delivered
    outbox: list[list[Any]] = [[] for _ in range(p)]  # (ready_at, send Action, dst, dst's need)
    t = 0.0
    while any(nxt[r] < len(orders[r]) or outbox[r] for r in range(p)):
        for r in range(p):  # the round at time t: sends of ready outputs, and their receives
            due = [o for o in outbox[r] if o[0] <= t]
            outbox[r] = [o for o in outbox[r] if o[0] > t]
            for _, send, dst, need in due:
                acts[r].append(send)
                kind = RECV_ACT if send.op == SEND_ACT else RECV_GRAD
                acts[dst].append(Action(kind, need[1], need[2], r))
                arrived[dst].add(need)
        for r in range(p):  # then every idle rank starts its next op if its input is here
            if busy[r] > t or nxt[r] >= len(orders[r]):
                continue
            op, c, mb = orders[r][nxt[r]]
            s = c * p + r
            if (op == F and s > 0 or op == B and s < S - 1) and (op, c, mb) not in arrived[r]:
                continue
            nxt[r] += 1
            acts[r].append(Action(op, c, mb))
            busy[r] = t + (t_f if op == F else t_b)
            if op == F and s < S - 1:
                outbox[r].append(
                    (busy[r], Action(SEND_ACT, c, mb, (r + 1) % p), (r + 1) % p, (F, (s + 1) // p, mb))
                )
            elif op == B and s > 0:
                outbox[r].append(
                    (busy[r], Action(SEND_GRAD, c, mb, (r - 1) % p), (r - 1) % p, (B, (s - 1) // p, mb))
                )
        pending = [busy[r] for r in range(p) if busy[r] > t] + [o[0] for ob in outbox for o in ob]
        if not pending and any(nxt[r] < len(orders[r]) for r in range(p)):
            raise RuntimeError(
                f"{schedule}: compute order waits forever at "
                f"{[orders[r][nxt[r]] for r in range(p) if nxt[r] < len(orders[r])]}"
            )
        t = min(pending) if pending else t
    return acts


def message_key(action: Action, rank: int, p: int) -> tuple[str, int, int]:
    """``(kind, receiving virtual stage, mb)``: the same on the sending and receiving side."""
    s = action.chunk * p + rank
    if action.op == SEND_ACT:
        return ("act", s + 1, action.mb)
    if action.op == RECV_ACT:
        return ("act", s, action.mb)
    if action.op == SEND_GRAD:
        return ("grad", s - 1, action.mb)
    return ("grad", s, action.mb)


def bubble_fraction_theory(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle share of one flush of ``schedule``: ``(p-1)/(m+p-1)``, or ``(p-1)/(v*m+p-1)``
    interleaved (GPipe §2.2; Megatron-LM SC'21 §2.2.1-2.2.2, written relative to total time);
    the formula is :func:`llmlab.formulas.pipeline.pipeline_bubble_fraction`."""
    return pipeline_bubble_fraction(p, m, v if schedule == "interleaved" else 1)


def _deadlock(waiting: dict[int, list[Action]], blocking_sends: bool) -> RuntimeError:
    """The error of a stuck simulation, naming the actions each unfinished rank waits at."""
    stuck = {r: " ".join(str(x) for x in acts) for r, acts in waiting.items()}
    how = " (circular wait with blocking sends)" if blocking_sends else ""
    return RuntimeError(f"pipeline schedule deadlocks{how}: ranks wait at {stuck}")


def simulate(
    schedule: list[list[Action]], t_f: float = 1.0, t_b: float = 2.0, blocking_sends: bool = False
) -> dict[str, Any]:
    """Run the action lists with unit costs and instant p2p, as an event simulation.

    Each rank executes its actions in order; ``t_f``/``t_b`` are the costs of a forward/backward
    of one chunk. With ``blocking_sends=False`` a receive waits until the matching send has been
    issued and sends never block (gloo, small messages). With ``blocking_sends=True`` each batch
    of consecutive p2p actions (one ``batch_isend_irecv``) completes only when every one of its
    sends and receives has its counterpart posted by the peer (NCCL with messages larger than
    its buffers: a send completes only once the matching receive runs), which finds circular
    waits that the first model hides.

    Returns ``{"timeline": [[(op, chunk, mb, t0, t1), ...] per rank], "span": flush time,
    "bubble_fraction": idle/span averaged over ranks, "peak_inflight": [max micro-batches
    forwarded but not yet backwarded, per rank]}``. Raises ``RuntimeError`` naming the stuck
    actions if the schedule deadlocks or a message is never matched.
    """
    p = len(schedule)
    sent: dict[tuple[Any, ...], float] = {}
    posted: dict[tuple[Any, ...], float] = {}  # blocking model: (key, is_send) -> time posted
    pc = [0] * p
    clock = [0.0] * p
    timeline: list[list[Any]] = [[] for _ in range(p)]
    inflight, peak = [0] * p, [0] * p

    def batch_end(r: int) -> int:  # the end of the run of p2p actions at rank r's next action
        return next(
            (j for j in range(pc[r], len(schedule[r])) if schedule[r][j].op not in COMM), len(schedule[r])
        )

    while any(pc[r] < len(schedule[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pc[r] < len(schedule[r]):
                a = schedule[r][pc[r]]
                if a.op in COMM and blocking_sends:
                    j = batch_end(r)
                    batch = schedule[r][pc[r] : j]
                    keys = [(message_key(x, r, p), x.op in (SEND_ACT, SEND_GRAD)) for x in batch]
                    for k in keys:
                        posted.setdefault(k, clock[r])
                    peers = [(k, not is_send) for k, is_send in keys]
                    if not all(k in posted for k in peers):
                        break
                    clock[r] = max([clock[r]] + [posted[k] for k in peers])
                    pc[r] = j
                elif a.op in (SEND_ACT, SEND_GRAD):
                    sent[message_key(a, r, p)] = clock[r]
                    pc[r] += 1
                elif a.op in (RECV_ACT, RECV_GRAD):
                    key = message_key(a, r, p)
                    if key not in sent:
                        break
                    clock[r] = max(clock[r], sent.pop(key))
                    pc[r] += 1
                else:
                    dt = t_f if a.op == F else t_b
                    timeline[r].append((a.op, a.chunk, a.mb, clock[r], clock[r] + dt))
                    clock[r] += dt
                    inflight[r] += 1 if a.op == F else -1
                    peak[r] = max(peak[r], inflight[r])
                    pc[r] += 1
                progressed = True
        if not progressed:
            waiting = {
                r: schedule[r][pc[r] : batch_end(r)] or schedule[r][pc[r] : pc[r] + 1] for r in range(p)
            }
            raise _deadlock({r: w for r, w in waiting.items() if pc[r] < len(schedule[r])}, blocking_sends)
    unmatched = (
        sorted(sent) if not blocking_sends else sorted(k for (k, s) in posted if (k, not s) not in posted)
    )
    if unmatched:
        raise RuntimeError(f"unmatched sends: {unmatched}")
    span = max(clock)
    busy = [sum(e[4] - e[3] for e in tl) for tl in timeline]
    bubble = sum(1 - b / span for b in busy) / p
    return {"timeline": timeline, "span": span, "bubble_fraction": bubble, "peak_inflight": peak}


def format_schedule(schedule: list[list[Action]], compute_only: bool = True) -> str:
    """A text table, one line per rank (``F3`` forward of micro-batch 3, ``B1.0`` backward of
    chunk 1, micro-batch 0; with ``compute_only=False`` also ``recvact0<3`` style p2p ops)."""
    lines = []
    for r, acts in enumerate(schedule):
        shown = [str(a) for a in acts if not compute_only or a.op in COMPUTE]
        lines.append(f"rank {r}: " + " ".join(shown))
    return "\n".join(lines)
