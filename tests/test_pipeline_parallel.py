"""Pipeline parallelism: schedules as data, refusals, and real ranks against one rank and
against torch.distributed.pipelining.Schedule1F1B.

Process launches are expensive on the shared CPU box, so each rank function runs many
configurations in one launch (a fresh Mesh per configuration, exactly what the trainer does).
"""

import subprocess
import sys

import pytest
import torch

import llmlab
from llmlab.data import BatchLoader
from llmlab.model.config import get_preset
from llmlab.model.llama import LlamaForCausalLM
from llmlab.parallel import pipeline_schedules as ps
from llmlab.training.config import TrainConfig, strategy_configs, validate
from llmlab.training.trainer import assemble_metrics, rank_main

GB, T, STEPS = 8, 16, 3
CASES_V1 = [(s, m) for s in ("gpipe", "1f1b") for m in (1, 4, 8)]


def cfg_for(pp=1, schedule="1f1b", m=1, v=1, **kw):
    return TrainConfig(
        pp=pp,
        pp_schedule=schedule,
        num_microbatches=m,
        virtual_stages=v,
        steps=kw.pop("steps", STEPS),
        global_batch_size=kw.pop("gb", GB),
        seq_len=T,
        device="cpu",
        **kw,
    )


# --- schedules as data (no processes) -----------------------------------------------------------
@pytest.mark.parametrize(
    "schedule,p,m,v",
    [
        ("gpipe", 2, 1, 1),
        ("gpipe", 4, 8, 1),
        ("1f1b", 2, 4, 1),
        ("1f1b", 4, 1, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 4, 3, 1),
        ("interleaved", 2, 4, 2),
        ("interleaved", 4, 8, 2),
        ("interleaved", 4, 4, 3),
        ("interleaved", 2, 2, 4),
    ],
)
def test_schedule_simulates_to_theory(schedule, p, m, v):
    for t_f, t_b in ((1.0, 1.0), (1.0, 2.0)):  # p2p placed for these costs, then replayed
        sched = ps.build_schedule(schedule, p, m, v, t_f=t_f, t_b=t_b)
        for r, acts in enumerate(sched):  # every (chunk, mb) forward and backward exactly once
            for op in (ps.F, ps.B):
                done = sorted((a.chunk, a.mb) for a in acts if a.op == op)
                assert done == [(c, i) for c in range(v) for i in range(m)], (r, op)
        sim = ps.simulate(sched, t_f, t_b)  # raises on a deadlock or unmatched message
        assert sim["bubble_fraction"] == pytest.approx(ps.bubble_fraction_theory(schedule, p, m, v))
    peak = sim["peak_inflight"]
    if schedule == "gpipe":
        assert peak == [m] * p
    elif schedule == "1f1b":
        assert peak == [min(m, p - r) for r in range(p)]
    else:
        assert max(peak) < m * v or m == p  # interleaving keeps fewer than all chunk-forwards


def test_no_schedule_deadlocks_when_sends_block():
    """NCCL completes a large send only when the peer's matching batch runs: replay every schedule
    with blocking sends (each batch of p2p a rendezvous). Megatron's interleaved order with each
    send right after its forward had circular waits here (e.g. p=2, M=4, v=2)."""
    for p in range(2, 9):
        for m in sorted({1, 3, p, 2 * p, 3 * p}):
            for schedule, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3, 4))):
                for v in vs:
                    if schedule == "interleaved" and m % p:
                        continue
                    sim = ps.simulate(ps.build_schedule(schedule, p, m, v), blocking_sends=True)
                    assert sim["bubble_fraction"] >= ps.bubble_fraction_theory(schedule, p, m, v) - 1e-9
    # the blocking model does find a circular wait that non-blocking sends hide
    crossed = [
        [ps.Action(ps.SEND_ACT, 0, 0, 1), ps.Action(ps.F, 0, 1), ps.Action(ps.RECV_GRAD, 0, 0, 1)],
        [ps.Action(ps.SEND_GRAD, 0, 0, 0), ps.Action(ps.B, 0, 1), ps.Action(ps.RECV_ACT, 0, 0, 0)],
    ]
    ps.simulate(crossed)
    with pytest.raises(RuntimeError, match="circular wait with blocking sends"):
        ps.simulate(crossed, blocking_sends=True)


def test_1f1b_phases_and_printing():
    sched = ps.build_schedule("1f1b", 4, 8)
    ops0 = [f"{a.op}{a.mb}" for a in sched[0] if a.op in ps.COMPUTE]
    assert ops0[:5] == ["F0", "F1", "F2", "F3", "B0"]  # 3 warm-up forwards, then 1F1B
    ops3 = [f"{a.op}{a.mb}" for a in sched[3] if a.op in ps.COMPUTE]
    assert ops3[:4] == ["F0", "B0", "F1", "B1"]
    text = ps.format_schedule(ps.build_schedule("gpipe", 2, 2), compute_only=False)
    assert text.splitlines()[1] == "rank 1: recv_act0<0 F0 recv_act1<0 F1 B0 send_grad0>0 B1 send_grad1>0"
    bad = [
        [ps.Action(ps.RECV_ACT, 0, 0, 1), ps.Action(ps.F, 0, 0), ps.Action(ps.SEND_ACT, 0, 0, 1)],
        [ps.Action(ps.RECV_ACT, 0, 0, 0), ps.Action(ps.F, 0, 0), ps.Action(ps.SEND_ACT, 0, 0, 0)],
    ]
    with pytest.raises(RuntimeError, match="deadlock"):
        ps.simulate(bad)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(pp=3, tp=1), "pp=3 must divide num_hidden_layers=4"),
        (
            dict(pp=4, pp_schedule="interleaved", virtual_stages=2, num_microbatches=4),
            r"pp\*virtual_stages = 4\*2 = 8 must divide num_hidden_layers=4",
        ),
        (
            dict(pp=2, pp_schedule="interleaved", virtual_stages=2, num_microbatches=3, global_batch_size=6),
            "num_microbatches=3 to be a multiple of pp=2",
        ),
        (
            dict(pp=2, pp_schedule="interleaved", virtual_stages=1, num_microbatches=2),
            "needs --virtual-stages >= 2",
        ),
        (
            dict(pp=2, pp_schedule="1f1b", virtual_stages=2, num_microbatches=2),
            "needs --pp-schedule interleaved",
        ),
    ],
)
def test_invalid_layouts_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        validate(TrainConfig(device="cpu", **kw))


def test_cli_refuses_before_launch():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmlab",
            "train",
            "--pp",
            "2",
            "--pp-schedule",
            "interleaved",
            "--virtual-stages",
            "2",
            "--num-microbatches",
            "1",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "num_microbatches=1 to be a multiple of pp=2" in out.stderr


# --- real ranks -----------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def one_thread():
    """The one-rank references run in this process, beside the ranks: one thread, like them
    (two threads on an oversubscribed 2-core box make a step ~30x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _reference_losses(cases):
    return {m: [s["loss"] for s in rank_main(cfg_for(m=m))["steps"]] for m in {m for _, m in cases}}


def _reference_grads(mc, m):
    model = LlamaForCausalLM(mc, seed=0)
    for x, y in BatchLoader(global_batch_size=GB, seq_len=T, seed=0).microbatches(1, 0, 1, m):
        (model(x, y) / m).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _pp_ranks(pp, cases, torch_cases, interleaved_mc=None, memory_cases=()):
    """Runs on every rank: trainer runs per case, grads vs torch's Schedule1F1B, and saved
    activations at a fixed micro-batch size of 2 rows (``memory_cases``: (schedule, M))."""
    import torch.nn.functional as F_
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from llmlab.parallel.pipeline_parallel import build_pipeline
    from llmlab.runtime.mesh import Mesh

    out = {"train": {}, "torch": {}, "interleaved_grads": None, "memory": {}}
    for schedule, m, v in cases:
        out["train"][(schedule, m, v)] = rank_main(cfg_for(pp, schedule, m, v))
    for schedule, m in memory_cases:
        r = rank_main(cfg_for(pp, schedule, m, steps=1, gb=2 * m))
        out["memory"][(schedule, m)] = (
            r["memory_bytes"]["activations_peak"],
            r["pipeline"]["peak_inflight_microbatches"],
        )

    for m in torch_cases:
        mesh = Mesh.build(pp=pp)
        micro = BatchLoader(global_batch_size=GB, seq_len=T, seed=0).microbatches(1, 0, 1, m)
        res = {}
        for kind in ("ours_gpipe", "ours_1f1b", "torch"):
            model = LlamaForCausalLM(get_preset("tiny"), seed=0)
            names = {id(p): n for n, p in model.named_parameters()}
            sched = "gpipe" if kind == "ours_gpipe" else "1f1b"
            runner = build_pipeline(model, mesh, strategy_configs(cfg_for(pp, sched, m)).pp)
            if kind == "torch":
                stage = PipelineStage(
                    runner.module.chunks[0],
                    mesh.coords["pp"],
                    pp,
                    torch.device("cpu"),
                    group=mesh.groups["pp"],
                )
                loss_fn = lambda out_, y_: F_.cross_entropy(out_.flatten(0, -2), y_.flatten())
                schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
                x = torch.cat([a for a, _ in micro])
                y = torch.cat([b for _, b in micro])
                if mesh.is_first_stage:
                    schedule.step(x)
                elif mesh.is_last_stage:
                    schedule.step(target=y)
                else:
                    schedule.step()
            else:
                runner.run(micro)
            res[kind] = {names[id(p)]: p.grad.clone() for p in runner.module.parameters()}
        out["torch"][m] = res
    if interleaved_mc is not None:  # pp*v stages of a deeper model, step-1 loss and grads
        mesh = Mesh.build(pp=pp)
        res = {}
        for m in (4, 8):
            model = LlamaForCausalLM(interleaved_mc, seed=0)
            names = {id(p): n for n, p in model.named_parameters()}
            runner = build_pipeline(model, mesh, strategy_configs(cfg_for(pp, "interleaved", m, 2)).pp)
            micro = BatchLoader(global_batch_size=GB, seq_len=T, seed=0).microbatches(1, 0, 1, m)
            loss = runner.run(micro)
            res[m] = (
                loss,
                {names[id(p)]: p.grad.clone() for p in runner.module.parameters()},
                runner.stats(),
            )
        out["interleaved_grads"] = res
    return out


def _check_losses(results, refs, pp):
    for (schedule, m, v), _ in results[0]["train"].items():
        got = [s["loss"] for s in results[0]["train"][(schedule, m, v)]["steps"]]
        want = refs[m]
        assert len(got) == STEPS
        for a, b in zip(got, want):
            assert abs(a - b) / abs(b) < 1e-4, (pp, schedule, m, got, want)


def _check_torch_grads(results, pp, m):
    for r in results:
        res = r["torch"][m]
        assert res["torch"].keys() == res["ours_1f1b"].keys() and res["torch"]
        for name, g in res["torch"].items():
            for kind in ("ours_1f1b", "ours_gpipe"):
                torch.testing.assert_close(
                    res[kind][name], g, rtol=1e-4, atol=1e-6, msg=f"{kind} {name} pp={pp} m={m}"
                )


def test_pp2_all_schedules_equal_one_rank_and_torch():
    cases = [(s, m, 1) for s, m in CASES_V1] + [("interleaved", 4, 2), ("interleaved", 8, 2)]
    memory_cases = [(s, m) for s in ("gpipe", "1f1b") for m in (2, 4)]
    results = llmlab.launch(_pp_ranks, 2, 2, cases, [4], None, memory_cases, backend="gloo")
    refs = _reference_losses([(s, m) for s, m, _ in cases])
    _check_losses(results, refs, 2)
    _check_torch_grads(results, 2, 4)
    # metrics as the trainer assembles them
    for schedule, m, v in cases:
        met = assemble_metrics(cfg_for(2, schedule, m, v), [r["train"][(schedule, m, v)] for r in results])
        pl = met["pipeline"]
        assert pl["schedule"] == schedule
        assert pl["bubble_fraction_theory"] == pytest.approx(ps.bubble_fraction_theory(schedule, 2, m, v))
        assert 0.0 < pl["bubble_fraction_measured"] < 1.0
        for rank, per in enumerate(pl["per_rank"]):
            tl = per["timeline"]
            assert len(tl) == STEPS
            ops = [e[0] for e in tl[-1]["events"]]
            assert ops.count("F") == ops.count("B") == m * v
            assert {"send", "recv"} <= set(ops)
            assert all(0 <= e[3] <= e[4] <= tl[-1]["span_s"] + 1e-9 for e in tl[-1]["events"])
        sends = [r["comm_bytes"]["send"] for r in met["ranks"]]
        hidden = get_preset("tiny").hidden_size
        # one activation per (mb, chunk boundary) forward plus its gradient back: GB*T*h*4 bytes each
        assert sum(sends) == (2 * v - 1) * 2 * STEPS * GB * T * hidden * 4
    # saved activations at a fixed micro-batch size: GPipe grows with M, 1F1B stops at p
    mem = [r["memory"] for r in results]
    g2, g4 = mem[0][("gpipe", 2)][0], mem[0][("gpipe", 4)][0]
    o2, o4 = mem[0][("1f1b", 2)][0], mem[0][("1f1b", 4)][0]
    assert g4 == pytest.approx(2 * g2, rel=0.05)  # rank 0 holds all M micro-batches
    assert o4 == pytest.approx(o2, rel=0.01) and o4 < 0.75 * g4  # rank 0 holds at most p = 2
    assert mem[0][("gpipe", 4)][1] == 4 and mem[0][("1f1b", 4)][1] == 2
    assert mem[1][("1f1b", 4)][1] == 1


def test_pp4_schedules_equal_one_rank_and_torch_and_interleaved_grads():
    mc8 = get_preset("tiny", num_hidden_layers=8)
    results = llmlab.launch(_pp_ranks, 4, 4, [(s, m, 1) for s, m in CASES_V1], [4], mc8, backend="gloo")
    _check_losses(results, _reference_losses(CASES_V1), 4)
    _check_torch_grads(results, 4, 4)
    for m in (4, 8):
        ref = _reference_grads(mc8, m)
        ref_loss = sum(
            llmlab.LlamaForCausalLM(mc8, seed=0)(x, y).item() / m
            for x, y in BatchLoader(global_batch_size=GB, seq_len=T, seed=0).microbatches(1, 0, 1, m)
        )
        names = set()
        for r, res in enumerate(results):
            loss, grads, stats = res["interleaved_grads"][m]
            assert (loss is None) == (r != 3)
            if loss is not None:
                assert loss == pytest.approx(ref_loss, rel=1e-5)
            for name, g in grads.items():
                torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6, msg=name)
            names |= grads.keys()
            assert stats["bubble_fraction_theory"] == pytest.approx(3 / (2 * m + 3))
        assert names == set(ref)  # every parameter lives on exactly one rank
