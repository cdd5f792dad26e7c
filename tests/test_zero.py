"""ZeRO stages 1-3: same loss as one rank, same parameters as PyTorch's own ZeRO-1 and FSDP2,
and per-rank memory/communication equal to the ZeRO paper's figures (Rajbhandari et al. 2020, §5, §7).

Each launch runs several configurations one after the other on the same ranks (process start-up
dominates on a small CPU machine), so the whole file needs three launches (dp 2, dp 4, and one
through ``llmlab.train``).
"""

import pytest
import torch

import llmlab
from llmlab.model.config import get_preset
from llmlab.formulas.communication import zero_comm_bytes_per_step
from llmlab.formulas.memory import zero_model_state_bytes
from llmlab.parallel.zero import validate as validate_zero
from llmlab.training.config import TrainConfig, layout_mesh, model_config, strategy_configs, validate

STEPS = 4
PSI = get_preset("tiny").num_parameters()


def _max_diff(ours: dict, theirs: dict) -> dict:
    """``{name: (max |ours - theirs|, max |theirs|)}`` over parameters (both fp32, full shape)."""
    assert set(ours) == set(theirs), (sorted(ours), sorted(theirs))
    return {
        n: ((ours[n] - theirs[n].detach().float()).abs().max().item(), theirs[n].abs().max().item())
        for n in ours
    }


def run_configs(configs, fsdp2_steps=0, zero_optimizer_steps=0):
    """Inside a rank: train each TrainConfig with the trainer's Engine; return losses, bytes.

    Optionally also train the same model with PyTorch FSDP2 (``fully_shard`` per layer) and with
    DDP + ``ZeroRedundancyOptimizer``, returning their full parameters after k steps.
    """
    import torch.distributed as dist
    from llmlab.data import BatchLoader
    from llmlab.metrics.memory import optimizer_state_bytes, param_bytes
    from llmlab.runtime import comm
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.trainer import Engine, global_loss, make_optimizer

    out, fulls = [], {}
    mesh = Mesh.build(dp=configs[0].dp)
    for cfg in configs:
        torch.manual_seed(cfg.seed)
        engine = Engine(cfg, mesh, torch.device("cpu"))
        loader = BatchLoader(global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        comm.COUNTER.reset()
        losses = []
        for step in range(1, cfg.steps + 1):
            micro = loader.microbatches(step, mesh.coords["dp"], mesh.dp, cfg.num_microbatches)
            losses.append(global_loss(engine.train_step(micro), mesh, torch.device("cpu")))
        rec = {
            "losses": losses,
            "comm": comm.COUNTER.snapshot(),
            "memory": {
                "params": param_bytes(engine.parameters()),
                "grads": engine.grad_bytes,
                "optimizer_states": optimizer_state_bytes(engine.optimizer),
            },
        }
        if cfg.zero:
            full = engine.wrapper.full_state_dict()
            if (cfg.zero, cfg.dtype) not in fulls:
                fulls[(cfg.zero, cfg.dtype)] = full
            rec["events"] = [(e["op"], e["unit"], e["phase"]) for e in engine.wrapper.events[:40]]
        out.append(rec)

    cfg = configs[0]
    mc = model_config(cfg)
    if fsdp2_steps:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = llmlab.LlamaForCausalLM(mc, seed=cfg.seed)
        dmesh = init_device_mesh("cpu", (mesh.dp,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        opt = make_optimizer(model.parameters(), cfg)
        loader = BatchLoader(global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        for step in range(1, fsdp2_steps + 1):
            ((x, y),) = loader.microbatches(step, mesh.coords["dp"], mesh.dp, 1)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        out.append(
            {
                "fsdp2": _max_diff(
                    fulls[(3, "fp32")], {n: p.full_tensor() for n, p in model.named_parameters()}
                )
            }
        )
    if zero_optimizer_steps:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(llmlab.LlamaForCausalLM(mc, seed=cfg.seed))
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            lr=cfg.lr,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.0,
        )
        loader = BatchLoader(global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        for step in range(1, zero_optimizer_steps + 1):
            ((x, y),) = loader.microbatches(step, mesh.coords["dp"], mesh.dp, 1)
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        out.append({"zero_redundancy": _max_diff(fulls[(1, "fp32")], dict(model.module.named_parameters()))})
    if fulls:
        init = llmlab.LlamaForCausalLM(mc, seed=cfg.seed)
        out.append(
            {
                "moved": {
                    f"{z}/{d}": max((f[n] - p).abs().max().item() for n, p in init.named_parameters())
                    for (z, d), f in fulls.items()
                }
            }
        )
    if dist.is_initialized():
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def reference():
    """One rank, no ZeRO (fp32), and one rank with bf16 compute + fp32 masters (N = 1)."""
    return {
        "fp32": run_configs([TrainConfig(steps=STEPS)])[0],
        "bf16": run_configs([TrainConfig(steps=STEPS, zero=1, dtype="bf16")])[0],
    }


def assert_same_loss(losses, ref, rtol=1e-4):
    assert len(losses) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(losses, ref), 1):
        assert abs(a - b) / abs(b) < rtol, f"step {step}: {a} vs {b}"


def assert_formula(memory, stage, dp, dtype):
    f = zero_model_state_bytes(PSI, stage, dp, dtype)
    for k in ("params", "grads", "optimizer_states"):
        assert abs(memory[k] - f[k]) / f[k] < 0.05, (
            f"stage {stage} dp {dp} {dtype} {k}: {memory[k]} vs {f[k]}"
        )


@pytest.fixture(scope="module")
def dp2():
    cfgs = [TrainConfig(dp=2, zero=z, steps=STEPS) for z in (1, 2, 3)]
    cfgs += [TrainConfig(dp=2, zero=z, steps=STEPS, dtype="bf16") for z in (1, 2, 3)]
    cfgs += [
        TrainConfig(dp=2, zero=2, steps=STEPS, cpu_offload=True),
        TrainConfig(dp=2, zero=3, steps=STEPS, num_microbatches=2),
    ]
    return llmlab.launch(run_configs, 2, cfgs, fsdp2_steps=STEPS, zero_optimizer_steps=STEPS, backend="gloo")


@pytest.fixture(scope="module")
def dp4():
    cfgs = [TrainConfig(dp=4, zero=z, steps=STEPS) for z in (1, 2, 3)]
    return llmlab.launch(run_configs, 4, cfgs, backend="gloo")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_loss_equals_one_rank_dp2_dp4(stage, reference, dp2, dp4):
    assert_same_loss(dp2[0][stage - 1]["losses"], reference["fp32"]["losses"])
    assert_same_loss(dp4[0][stage - 1]["losses"], reference["fp32"]["losses"])


def test_cpu_offload_and_microbatches_same_loss(reference, dp2):
    assert_same_loss(dp2[0][6]["losses"], reference["fp32"]["losses"])  # zero 2 + cpu offload
    assert_same_loss(dp2[0][7]["losses"], reference["fp32"]["losses"])  # zero 3, 2 micro-batches


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_mixed_precision_tracks_one_rank(stage, reference, dp2):
    # bf16 gradients are summed in a different order on 2 ranks: close, not bitwise.
    assert_same_loss(dp2[0][3 + stage - 1]["losses"], reference["bf16"]["losses"], rtol=2e-3)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_matches_paper_fp32(stage, dp2, dp4):
    for res, dp in ((dp2, 2), (dp4, 4)):
        for rank in res:
            assert_formula(rank[stage - 1]["memory"], stage, dp, "fp32")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_memory_matches_paper_mixed_precision(stage, dp2):
    for rank in dp2:
        assert_formula(rank[3 + stage - 1]["memory"], stage, 2, "bf16")


def test_reference_memory_is_unsharded(reference):
    assert_formula(reference["fp32"]["memory"], 0, 1, "fp32")
    assert_formula(reference["bf16"]["memory"], 1, 1, "bf16")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_communication_per_step(stage, dp2, dp4):
    """Stages 1-2 move about 2Ψ per step (reduce-scatter + all-gather), stage 3 about 3Ψ."""
    for res in (dp2, dp4):
        c = res[0][stage - 1]["comm"]
        per_step = (c["reduce_scatter"] + c["all_gather"]) / STEPS
        want = zero_comm_bytes_per_step(PSI, stage)["payload"]
        assert abs(per_step - sum(want.values())) / sum(want.values()) < 0.01
        assert c["all_reduce"] == 0
        expected_ag = 2 if stage == 3 else 1
        assert abs(c["all_gather"] / STEPS - expected_ag * 4 * PSI) / (4 * PSI) < 0.01
    bf = dp2[0][3 + stage - 1]["comm"]  # bf16: half the bytes
    want = sum(zero_comm_bytes_per_step(PSI, stage, dtype="bf16")["payload"].values())
    assert abs((bf["reduce_scatter"] + bf["all_gather"]) / STEPS - want) < 0.01 * want


def test_stage3_sequence_gathers_before_use(dp2):
    ev = dp2[0][2]["events"]
    fwd = [u for op, u, ph in ev if op == "all_gather" and ph == "forward"]
    assert fwd[:3] == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    bwd = [u for op, u, ph in ev if op == "all_gather" and ph == "backward"]
    assert bwd[:2] == ["lm_head", "model.norm"]
    rs = [u for op, u, ph in ev if op == "reduce_scatter"]
    assert rs[0] == "lm_head"


def test_stage3_equals_fsdp2_and_stage1_equals_zero_redundancy_optimizer(dp2):
    """Parameters after k = STEPS steps: ours vs PyTorch's FSDP2 and ZeroRedundancyOptimizer."""
    for rank in dp2:
        fsdp2, zro, moved = rank[-3]["fsdp2"], rank[-2]["zero_redundancy"], rank[-1]["moved"]
        assert (
            len(fsdp2)
            == len(zro)
            == len(dict(llmlab.LlamaForCausalLM(get_preset("tiny")).named_parameters()))
        )
        for n, (diff, scale) in fsdp2.items():
            assert diff <= 1e-5 + 1e-4 * scale, f"stage 3 vs FSDP2: {n} differs by {diff}"
        for n, (diff, scale) in zro.items():
            assert diff <= 1e-5 + 1e-4 * scale, f"stage 1 vs ZeroRedundancyOptimizer: {n} differs by {diff}"
        assert min(moved.values()) > 1e-3  # every configuration really trained


def test_train_cli_path_bf16_stage3():
    """Through llmlab.train (the `llmlab train --dp 2 --zero 3 --dtype bf16` path) with offload."""
    m = llmlab.train(TrainConfig(dp=2, zero=3, steps=2, dtype="bf16", cpu_offload=True), progress=False)
    for r in m["ranks"]:
        assert_formula(r["memory_bytes"], 3, 2, "bf16")
        assert r["comm_bytes"]["all_gather"] > 0 and r["comm_bytes"]["all_reduce"] == 0
    assert m["steps"][1]["loss"] < m["steps"][0]["loss"]


def test_layout_refusals():
    mc = get_preset("tiny")

    def check(cfg, mc):
        validate_zero(strategy_configs(cfg).zero, layout_mesh(cfg), mc)

    with pytest.raises(ValueError, match="--cpu-offload .* needs --zero"):
        check(TrainConfig(cpu_offload=True), mc)
    for kw in (dict(tp=2), dict(pp=2), dict(dp=4, ep=2)):  # composes: accepted
        check(TrainConfig(dp=kw.pop("dp", 2), zero=3, **kw), mc)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        check(TrainConfig(dp=2, zero=3), mc.replace(tie_word_embeddings=True))
    validate(TrainConfig(dp=2, zero=3, save_model="/tmp/x"))  # gathered by training/export.py
    validate(TrainConfig(dp=2, zero=2, dtype="bf16", cpu_offload=True))  # accepted


def test_formula_reproduces_paper_example():
    """ZeRO §5, Ψ = 7.5 B, N = 64, mixed precision: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB."""
    got = [zero_model_state_bytes(7.5e9, s, 64, "bf16")["total"] / 1e9 for s in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]
    # the seed's 8B model in fp32: 32 + 32 + 64 GB on one GPU
    f = zero_model_state_bytes(8e9, 0, 1, "fp32")
    assert (f["params"], f["grads"], f["optimizer_states"]) == (32e9, 32e9, 64e9)


def _fp16_skips(configs):
    """Inside a rank: for each config, ``(losses, skipped)`` per step, and the fp16 mean of a
    gradient of 10000 on every rank by :func:`mean_over_ranks`, divided before and after the sum."""
    from llmlab.data import BatchLoader
    from llmlab.parallel.grad_reduce import mean_over_ranks
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.trainer import Engine, global_loss

    mesh = Mesh.build(dp=configs[0].dp)
    out = []
    for cfg in configs:
        engine = Engine(cfg, mesh, torch.device("cpu"))
        loader = BatchLoader(global_batch_size=cfg.global_batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
        rec = {"losses": [], "skipped": []}
        for step in range(1, cfg.steps + 1):
            micro = loader.microbatches(step, mesh.coords["dp"], mesh.dp, cfg.num_microbatches)
            rec["losses"].append(global_loss(engine.train_step(micro, step), mesh, torch.device("cpu")))
            rec["skipped"].append(engine.last["skipped"])
        out.append(rec)
    g = torch.full((8,), 10000.0, dtype=torch.float16)
    group = mesh.groups.get("dp")
    out.append(
        {
            "pre": mean_over_ranks(g, group).tolist(),
            "post": mean_over_ranks(g, group, predivide=False).tolist(),
        }
    )
    # partial gradients (the TP rule): +40000 on ranks 0-3, -40000 on 4-7, true sum 0 (a plain
    # fp16 all-reduce over gloo returns +-inf here: its running sum passes 65504)
    from llmlab.parallel.grad_reduce import all_reduce_sum_

    part = torch.full((8,), 4e4 if mesh.rank < 4 else -4e4, dtype=torch.float16)
    out[-1]["partial_sum"] = all_reduce_sum_(part, group).tolist()
    return out


def test_fp16_zero_at_dp8_skips_exactly_the_steps_ddp_skips():
    """Each bucket is divided by N before its reduce-scatter (as DDP divides before its
    all-reduce), so at dp 8 the fp16 sum cannot overflow where no rank's gradient does. Before,
    ZeRO summed first and skipped step 1, which DDP does not, and its losses left DDP's."""
    kw = dict(dp=8, dtype="fp16", global_batch_size=8, seq_len=32, steps=3)
    ddp, *zeros, demo = llmlab.launch(
        _fp16_skips, 8, [TrainConfig(zero=z, **kw) for z in (0, 1, 2, 3)], backend="gloo"
    )[0]
    assert ddp["skipped"][0] is False, ddp
    for stage, z in enumerate(zeros, 1):
        assert z["skipped"] == ddp["skipped"], (stage, z["skipped"], ddp["skipped"])
        assert_same_loss_n(z["losses"], ddp["losses"], rtol=1e-3)
    assert all(abs(v - 1e4) < 10 for v in demo["pre"]), demo  # 8 x 1250, summed in fp16: finite
    assert all(v == float("inf") for v in demo["post"])  # 8 x 10000 > 65504: inf, / 8 still inf
    assert demo["partial_sum"] == [0.0] * 8  # fp16 partial gradients summed in fp32: no inf on the way


def assert_same_loss_n(losses, ref, rtol):
    assert len(losses) == len(ref)
    for step, (a, b) in enumerate(zip(losses, ref), 1):
        assert abs(a - b) / abs(b) < rtol, f"step {step}: {a} vs {b}"
