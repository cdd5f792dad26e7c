"""The checks of the lab 00-04 exercises fail on realistic wrong answers, in plain words.

(Every registered reference passes its check in tests/test_exercises.py.) Each wrong answer is a
mistake a learner would make; the test asserts the words of the message, the expected/got lines and
the hint, and that it is an ExerciseFailed, not a bare assertion.
"""

import pytest
import torch
import torch.distributed as dist

from llmlab import check, exercises
from llmlab.check import ExerciseFailed


# --- lab 00 -----------------------------------------------------------------------------------
def _flops_forward_only(n, t, peak, mfu, g=1):
    f = 2 * n * t  # forgot the backward pass (4·N·T)
    return {"flops": f, "seconds": f / (g * peak * mfu)}


def _time_ignores_mfu(n, t, peak, mfu, g=1):
    f = 6 * n * t
    return {"flops": f, "seconds": f / (g * peak)}


def _ring_one_phase(nbytes, world, bw, lat=0.0):
    return lat + (world - 1) / world * nbytes / bw  # only the reduce-scatter


def _ring_factor_two(nbytes, world, bw, lat=0.0):
    return 2 * (world - 1) * lat + 2 * nbytes / bw  # the N -> infinity limit, wrong for small N


def _ring_latency_once(nbytes, world, bw, lat=0.0):
    return lat + 2 * (world - 1) / world * nbytes / bw  # one latency per call, not per ring step


WRONG = []
WRONG += [
    ("training_flops_and_time", _flops_forward_only, "flops for N=8e+09"),
    ("training_flops_and_time", _time_ignores_mfu, "seconds for N=8e+09 parameters"),
    ("ring_all_reduce_seconds", _ring_one_phase, "over 8 ranks"),
    ("ring_all_reduce_seconds", _ring_factor_two, "over 8 ranks"),
    ("ring_all_reduce_seconds", _ring_latency_once, "latency 5e-05 s"),
]


# --- lab 01 -----------------------------------------------------------------------------------
def _ring_gather(chunks, rank, world, send_of, add):
    chunks = [c.clone() for c in chunks]
    right, left = (rank + 1) % world, (rank - 1) % world
    for s in range(world - 1):
        i, j = send_of(rank, s, world), (send_of(rank, s, world) - 1) % world
        buf = torch.empty_like(chunks[j])
        if rank % 2 == 0:
            dist.send(chunks[i], right)
            dist.recv(buf, left)
        else:
            dist.recv(buf, left)
            dist.send(chunks[i], right)
        chunks[j] = chunks[j] + buf if add else buf
    return torch.cat(chunks)


def _gather_off_by_one(chunks, rank, world):  # the reduce-scatter's indices: sends a stale chunk
    return _ring_gather(chunks, rank, world, lambda r, s, w: (r - s) % w, add=False)


def _gather_adds(chunks, rank, world):  # adds the received chunk instead of overwriting it
    return _ring_gather(chunks, rank, world, lambda r, s, w: (r + 1 - s) % w, add=True)


def _buckets_forward_order(sizes, cap, first=2**20):
    out = exercises.ddp_buckets(sizes[::-1], cap, first)  # forgot that backward runs last-to-first
    return [[len(sizes) - 1 - i for i in b] for b in out]


def _buckets_no_first_cap(sizes, cap, first=2**20):
    return exercises.ddp_buckets(sizes, cap, cap)  # every bucket, the first too, at bucket_cap


WRONG += [
    ("ring_all_gather", _gather_off_by_one, "rank 0 should end with every reduced chunk"),
    ("ring_all_gather", _gather_adds, "rank 0 should end with every reduced chunk; chunk(s) [0, 2] differ"),
    ("ddp_buckets", _buckets_forward_order, "bucket 0 differs (4 buckets expected, 4 returned)"),
    ("ddp_buckets", _buckets_no_first_cap, "first bucket cap 4 bytes: bucket 0 differs"),
]


def test_ddp_buckets_reference_is_llmlab_ddp_rule():
    """The exercise's rule is the one DistributedDataParallel uses (build_buckets) on the tiny model."""
    from types import SimpleNamespace
    from llmlab import LlamaForCausalLM, get_preset
    from llmlab.parallel.data_parallel import build_buckets

    params = list(LlamaForCausalLM(get_preset("tiny"), seed=0).parameters())
    mesh = SimpleNamespace(size=lambda key: 2, groups={"dp": None, "edp": None})
    index = {id(p): i for i, p in enumerate(params)}
    sizes = [p.numel() * p.element_size() for p in params]
    for cap, first in ((0.05 * 2**20, 2**20), (25 * 2**20, 2**20), (64 * 1024, 16 * 1024)):
        real = [[index[id(p)] for p in b.params] for b in build_buckets(params, mesh, cap, first)]
        assert exercises.ddp_buckets(sizes, cap, first) == real
        assert len(real) > 1 or cap > sum(sizes)


# --- lab 02 -----------------------------------------------------------------------------------
def _column_no_bias(x, w, b, gather, group=None):
    return exercises.column_parallel_forward(x, w, None, gather, group)


def _column_gather_wrong_dim(x, w, b, gather, group=None):
    y = x @ w.t() + b
    if not gather:
        return y
    parts = [torch.empty_like(y) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y, group=group)
    return torch.cat(parts, dim=0)  # stacks batches instead of features


def _ce_local_max(logits, target, start, group=None):
    m = logits.max(-1).values  # no MAX all-reduce: each rank shifts by its own max
    sum_exp = (logits - m[:, None]).exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    local = target - start
    mine = (local >= 0) & (local < logits.shape[-1])
    t = (logits - m[:, None]).gather(-1, local.clamp(0, logits.shape[-1] - 1)[:, None])[:, 0] * mine
    dist.all_reduce(t, group=group)
    return sum_exp.log() - t


def _ce_no_target_mask(logits, target, start, group=None):
    m = logits.max(-1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    sum_exp = (logits - m[:, None]).exp().sum(-1)
    dist.all_reduce(sum_exp, group=group)
    idx = (target - start).clamp(0, logits.shape[-1] - 1)  # every rank adds a logit, not only the owner
    t = (logits - m[:, None]).gather(-1, idx[:, None])[:, 0]
    dist.all_reduce(t, group=group)
    return sum_exp.log() - t


WRONG += [
    ("column_parallel_forward", _column_no_bias, "rank 0, gather_output=False: output differs from slice 0"),
    ("column_parallel_forward", _column_gather_wrong_dim, "concatenate them on the last dim in rank order"),
    ("vocab_parallel_cross_entropy", _ce_local_max, "ReduceOp.MAX"),
    (
        "vocab_parallel_cross_entropy",
        _ce_no_target_mask,
        "rank 0: per-token loss differs from F.cross_entropy",
    ),
]


# --- lab 03 -----------------------------------------------------------------------------------
def _bubble_over_ideal(p, m, v=1):
    return (p - 1) / (v * m)  # relative to the ideal time, not to the whole flush


def _bubble_ignores_v(p, m, v=1):
    return (p - 1) / (m + p - 1)


def _pipe_reversed_order(mbs, stage_fn, rank, world):
    out = exercises.pipeline_forward(mbs, stage_fn, rank, world)
    return out[::-1] if out is not None else None  # last stage hands micro-batches back reversed


def _pipe_last_stage_skips_layers(mbs, stage_fn, rank, world):
    outs = []
    for mb in mbs:
        x = mb if rank == 0 else torch.empty_like(mb)
        if rank > 0:
            dist.recv(x, rank - 1)
        if rank < world - 1:
            dist.send(stage_fn(x).contiguous(), rank + 1)
        else:
            outs.append(x)  # forgot to run the last stage's own layers
    return outs if rank == world - 1 else None


WRONG += [
    ("bubble_fraction", _bubble_over_ideal, "p=4 stages, m=8 micro-batches, v=1"),
    ("bubble_fraction", _bubble_ignores_v, "v=2 chunks per rank"),
    ("pipeline_forward", _pipe_reversed_order, "it is the output of micro-batch 2"),
    ("pipeline_forward", _pipe_last_stage_skips_layers, "rank 2 (last stage), output of micro-batch 0"),
]


def test_bubble_fraction_reference_is_what_the_simulator_measures():
    from llmlab.parallel.pipeline_schedules import build_schedule, simulate

    for name, p, m, v in (("gpipe", 4, 8, 1), ("1f1b", 2, 3, 1), ("interleaved", 4, 8, 2)):
        sim = simulate(build_schedule(name, p, m, v), t_f=1.0, t_b=2.0)
        assert abs(exercises.bubble_fraction(p, m, v) - sim["bubble_fraction"]) < 1e-9


# --- lab 04 -----------------------------------------------------------------------------------
def _lb_without_e(probs, idx, E):
    return exercises.load_balancing_loss(probs, idx, E) / E  # forgot the factor E


def _lb_first_choice_only(probs, idx, E):
    return exercises.load_balancing_loss(probs, idx[:, :1], E)  # f from the top-1 choice only


def _splits_no_exchange(counts, group=None):
    send = counts.reshape(dist.get_world_size(group), -1).sum(1).tolist()
    return send, send  # assumes every rank receives what it sends


def _splits_strided_experts(counts, group=None):
    ep = dist.get_world_size(group)
    recv = torch.empty_like(counts)
    strided = counts.reshape(-1, ep).t().contiguous().reshape(-1)  # expert e on rank e % ep
    dist.all_to_all_single(recv, strided, group=group)
    return strided.reshape(ep, -1).sum(1).tolist(), recv.reshape(ep, -1).sum(1).tolist()


WRONG += [
    ("load_balancing_loss", _lb_without_e, "loss for T=16 tokens, E=4 experts, top-1"),
    ("load_balancing_loss", _lb_first_choice_only, "loss for T=16 tokens, E=4 experts, top-2"),
    ("a2a_split_sizes", _splits_no_exchange, "output_splits (rows received from each rank)"),
    ("a2a_split_sizes", _splits_strided_experts, "rank 0 of ep=3, E=6: input_splits"),
]


def test_load_balancing_loss_reference_is_the_moe_layers_lb_loss():
    from llmlab import get_preset
    from llmlab.model.moe import MoE

    torch.manual_seed(1)
    layer = MoE(get_preset("tiny-moe"))
    x = torch.randn(1, 20, layer.gate.in_features)
    with torch.no_grad():
        layer(x)
        _, probs, topi, _ = layer.route(x.reshape(-1, x.shape[-1]))
    assert abs(float(exercises.load_balancing_loss(probs, topi, layer.num_experts)) - layer.lb_loss) < 1e-6
    assert layer.lb_loss > 1.0  # a random router is not balanced: the loss is above its minimum 1


def _returns_nothing(*args):
    return None  # a stub that forgot its return statement


# --- the tests ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name,wrong,words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_wrong_answer_is_explained(name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    msg = str(info.value)
    assert words in msg, msg
    assert "expected:" in msg and "got:" in msg and "hint:" in msg, msg
    assert not isinstance(info.value, AssertionError)


def test_every_new_exercise_has_a_wrong_answer_here():
    labs = {exercises.LAB_OF[n] for n, _, _ in WRONG}
    covered = {n for n, _, _ in WRONG}
    for name, lab in exercises.LAB_OF.items():
        if lab in labs and name not in (
            "training_memory_bytes",
            "ring_reduce_scatter",
            "row_parallel_forward",
            "one_f_one_b",
            "topk_route",
        ):
            assert name in covered, name


@pytest.mark.parametrize(
    "name",
    [
        "training_flops_and_time",
        "ring_all_reduce_seconds",
        "ddp_buckets",
        "bubble_fraction",
        "load_balancing_loss",
        "column_parallel_forward",
    ],
)
def test_a_function_returning_none_is_explained_not_crashed(name):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(_returns_nothing)
    assert "got:      None" in str(info.value) and "hint:" in str(info.value)
