"""Tensor parallelism: layers vs the full matmul, blocks vs DTensor TP, the model vs one rank,
and measured bytes vs the formulas. Ranks are real gloo processes."""

import pytest
import torch

import llmlab
from llmlab import TrainConfig
from llmlab.model.config import get_preset
from llmlab.parallel.tp_plan import validate as validate_tp
from llmlab.runtime.mesh import Mesh
from llmlab.formulas.activations import llama_block_activation_bytes
from llmlab.formulas.communication import tp_block_comm_bytes, tp_replicated_kv_grad_bytes, tp_step_comm_bytes
from llmlab.parallel.records import model_record
from llmlab.parallel.tp_costs import tp_calculator
from llmlab.training.config import strategy_configs, validate


# --------------------------------------------------------------------------------------------
# Layout errors, before any rank starts
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tp=3), "tp=3 must divide num_attention_heads=4"),
        (dict(tp=8), "tp=8 must divide num_attention_heads=4"),
        (dict(tp=1, sequence_parallel=True), "--sequence-parallel needs --tp > 1"),
        (dict(tp=2, sequence_parallel=True, seq_len=33), "tp=2 must divide --seq-len 33"),
    ],
)
def test_bad_layouts_refused(kw, message):
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        validate(TrainConfig(**kw))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(
                num_attention_heads=8,
                num_key_value_heads=4,
                hidden_size=64,
                intermediate_size=192,
                vocab_size=256,
            ),
            None,
        ),
        (dict(num_attention_heads=8, num_key_value_heads=8, hidden_size=64), None),
        (
            dict(num_attention_heads=12, num_key_value_heads=6, hidden_size=96),
            "tp=4 must divide num_key_value_heads=6",
        ),
        (
            dict(num_attention_heads=12, num_key_value_heads=3, hidden_size=96),
            "tp=4 must be a multiple of num_key_value_heads=3",
        ),
        (dict(intermediate_size=190), "tp=4 must divide intermediate_size=190"),
        (dict(vocab_size=258), "tp=4 must divide vocab_size=258"),
    ],
)
def test_validate_layout_names_constraint(overrides, message):
    mc = get_preset("tiny", **overrides)
    cfg = strategy_configs(TrainConfig(tp=4)).tp
    if message is None:
        validate_tp(cfg, Mesh(tp=4), mc)
    else:
        with pytest.raises(ValueError, match=message):
            validate_tp(cfg, Mesh(tp=4), mc)


def test_calculator_scales_with_tp():
    rows = tp_calculator()  # Qwen3-8B-like block, batch 16, seq 4096, bf16
    assert [r["tp"] for r in rows] == [1, 2, 4, 8]
    base = rows[0]
    for r in rows[1:]:
        assert r["flops"] == pytest.approx(base["flops"] / r["tp"])
        # 4 all-reduces of b*s*h*2 bytes = 16*4096*4096*2*4
        assert r["comm_bytes"] == 16 * 4096 * 4096 * 2 * 4
        assert r["wire_bytes"] == pytest.approx(r["comm_bytes"] * 2 * (r["tp"] - 1) / r["tp"])
        assert r["activation_bytes"] < base["activation_bytes"]
    assert base["comm_bytes"] == base["wire_bytes"] == 0
    # the ratio that limits TP: communication per FLOP grows with tp
    assert rows[3]["comm_per_flop"] == pytest.approx(2 * rows[2]["comm_per_flop"] * (7 / 8) / (3 / 4))
    sp = tp_calculator(sequence_parallel=True)
    for a, b in zip(rows[1:], sp[1:]):  # SP shards what TP leaves replicated
        assert b["activation_bytes"] < a["activation_bytes"]
        assert b["activation_bytes_fused"] == pytest.approx(base["activation_bytes_fused"] / b["tp"])
        assert a["activation_bytes_fused"] > b["activation_bytes_fused"]


# --------------------------------------------------------------------------------------------
# Layers against the full matmul
# --------------------------------------------------------------------------------------------
def _layers_rank():
    from llmlab.parallel.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        vocab_parallel_cross_entropy,
    )
    from llmlab.runtime import comm
    from llmlab.runtime.mesh import Mesh

    mesh = Mesh.build(tp=2)
    group, r = mesh.groups["tp"], mesh.coords["tp"]
    torch.manual_seed(0)  # same full weights and inputs on every rank
    col, row = torch.nn.Linear(8, 6, bias=True), torch.nn.Linear(6, 4, bias=True)
    emb = torch.nn.Embedding(10, 4)
    x = torch.randn(3, 5, 8, requires_grad=True)
    ids = torch.randint(0, 10, (3, 5))
    labels = torch.randint(0, 6, (3, 5))
    labels[0, 0] = -100
    out = {}
    # Full reference: Y = row(col(x)), embedding, cross-entropy over col's 6 outputs.
    ref = row(col(x))
    ref.sum().backward()
    ref_ce = torch.nn.functional.cross_entropy(col(x).flatten(0, 1), labels.flatten(), ignore_index=-100)
    logits_ref = col(x).detach().requires_grad_(True)
    torch.nn.functional.cross_entropy(
        logits_ref.flatten(0, 1), labels.flatten(), ignore_index=-100
    ).backward()
    # Column then row (Megatron f ... g): one all-reduce forward, one backward.
    c = ColumnParallelLinear.from_linear(col, group)
    rw = RowParallelLinear.from_linear(row, group)
    x2 = x.detach().clone().requires_grad_(True)
    comm.COUNTER.reset()
    y = rw(c(x2))
    fwd = dict(comm.COUNTER.calls)
    y.sum().backward()
    out["pair"] = (
        (y - ref).abs().max().item(),
        (x2.grad - x.grad).abs().max().item(),
        (c.weight.grad - col.weight.grad.chunk(2, 0)[r]).abs().max().item(),
        (c.bias.grad - col.bias.grad.chunk(2, 0)[r]).abs().max().item(),
        (rw.weight.grad - row.weight.grad.chunk(2, 1)[r]).abs().max().item(),
        (rw.bias.grad - row.bias.grad).abs().max().item(),
        fwd,
        dict(comm.COUNTER.calls),
    )
    # gather_output and input_is_parallel=False paths.
    cg = ColumnParallelLinear.from_linear(col, group, gather_output=True)
    rf = RowParallelLinear.from_linear(row, group, input_is_parallel=False)
    out["gathered"] = (cg(x) - col(x)).abs().max().item()
    out["row_full_input"] = (rf(col(x)) - row(col(x))).abs().max().item()
    # Vocab-parallel embedding.
    ve = VocabParallelEmbedding.from_embedding(emb, group)
    out["embedding"] = (ve(ids) - emb(ids)).abs().max().item()
    # Vocab-parallel cross-entropy: never gathers the logits.
    shard = logits_ref.detach().chunk(2, -1)[r].clone().requires_grad_(True)
    comm.COUNTER.reset()
    loss = vocab_parallel_cross_entropy(shard, labels, group)
    loss.backward()
    out["ce"] = (
        abs(loss.item() - ref_ce.item()),
        (shard.grad - logits_ref.grad.chunk(2, -1)[r]).abs().max().item(),
        comm.COUNTER.snapshot()["all_reduce"],
        comm.COUNTER.snapshot()["all_gather"],
    )
    return out


def test_layers_equal_full_matmul():
    res = llmlab.launch(_layers_rank, 2, backend="gloo")
    for out in res:
        *errs, fwd, total = out["pair"]
        assert max(errs) < 1e-5, errs
        assert fwd == {"all_reduce": 1} and total == {"all_reduce": 2}
        assert out["gathered"] < 1e-6 and out["row_full_input"] < 1e-6
        assert out["embedding"] == 0.0
        dloss, dgrad, ar_bytes, ag_bytes = out["ce"]
        assert dloss < 1e-6 and dgrad < 1e-7
        assert ag_bytes == 0 and ar_bytes == 15 * 4 * 3  # max, then (target, sum-exp), per token


# --------------------------------------------------------------------------------------------
# An MLP and an attention block against PyTorch's DTensor tensor parallel
# --------------------------------------------------------------------------------------------
def _dtensor_rank(tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from llmlab.model.llama import LlamaForCausalLM
    from llmlab.parallel.tensor_parallel import ParallelAttention, ParallelMLP
    from llmlab.runtime.mesh import Mesh

    mc = get_preset("tiny", num_hidden_layers=1)
    mesh = Mesh.build(tp=tp)
    group = mesh.groups["tp"]
    dmesh = init_device_mesh("cpu", (tp,))
    ours = LlamaForCausalLM(mc, seed=0).model.layers[0]
    theirs = LlamaForCausalLM(mc, seed=0).model.layers[0]
    full = LlamaForCausalLM(mc, seed=0).model.layers[0]
    ours_attn, ours_mlp = ParallelAttention(ours.self_attn, group), ParallelMLP(ours.mlp, group)
    parallelize_module(
        theirs.mlp,
        dmesh,
        {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()},
    )
    parallelize_module(
        theirs.self_attn,
        dmesh,
        {
            "q_proj": ColwiseParallel(),
            "k_proj": ColwiseParallel(),
            "v_proj": ColwiseParallel(),
            "o_proj": RowwiseParallel(),
        },
    )
    theirs.self_attn.num_heads //= tp
    theirs.self_attn.num_kv_heads //= tp
    cos, sin = LlamaForCausalLM(mc, seed=None).rotary(16, "cpu", torch.float32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, mc.hidden_size, generator=g)
    errs = {}
    for name, o_mod, t_mod, f_mod, call in [
        ("mlp", ours_mlp, theirs.mlp, full.mlp, lambda m, v: m(v)),
        ("attn", ours_attn, theirs.self_attn, full.self_attn, lambda m, v: m(v, cos, sin)),
    ]:
        xs = [x.clone().requires_grad_(True) for _ in range(3)]
        outs = [call(m, v) for m, v in zip((o_mod, t_mod, f_mod), xs)]
        for o in outs:
            o.pow(2).sum().backward()
        errs[name + ".out_vs_dtensor"] = (outs[0] - outs[1]).abs().max().item()
        errs[name + ".out_vs_full"] = (outs[0] - outs[2]).abs().max().item()
        errs[name + ".dx_vs_dtensor"] = (xs[0].grad - xs[1].grad).abs().max().item()
        errs[name + ".dx_vs_full"] = (xs[0].grad - xs[2].grad).abs().max().item()
        tp_params = dict(t_mod.named_parameters())
        for pname, p in o_mod.named_parameters():
            theirs_grad = tp_params[pname].grad.to_local()
            errs[f"{name}.{pname}.grad_vs_dtensor"] = (p.grad - theirs_grad).abs().max().item()
            assert p.grad.shape == theirs_grad.shape and p.grad.abs().max() > 0
    return errs


def test_blocks_equal_dtensor_tensor_parallel():
    res = llmlab.launch(_dtensor_rank, 2, 2, backend="gloo")
    for errs in res:
        assert len(errs) == 8 + 3 + 4
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, bad


# --------------------------------------------------------------------------------------------
# Measured bytes per collective and saved activations per block, beside the formulas
# --------------------------------------------------------------------------------------------
def _block_rank(tp, sp):
    from llmlab.parallel.tp_costs import measure_block
    from llmlab.runtime.mesh import Mesh

    r = measure_block(get_preset("tiny"), Mesh.build(tp=tp), sp, batch=2, seq_len=32)
    return r["forward"], r["backward"], r["activation_bytes"], r["output"], r["input_grad"]


@pytest.mark.parametrize("tp, sp", [(2, False), (2, True), (4, True)])
def test_block_bytes_match_formulas(tp, sp):
    mc = get_preset("tiny")
    b, s, h = 2, 32, mc.hidden_size
    ref = _block_rank(1, False)
    res = llmlab.launch(_block_rank, tp, tp, sp, backend="gloo")
    expect = tp_block_comm_bytes(b, s, h, tp, sp)
    for rank, (fwd, bwd, act, out, dx) in enumerate(res):
        for phase, events in (("forward", fwd), ("backward", bwd)):
            kinds = {
                k: (sum(1 for e in events if e[0] == k), {n for e_k, n in events if e_k == k})
                for k, _ in events
            }
            assert kinds == {k: (n, {x}) for k, (n, x) in expect[phase].items()}, (phase, events)
        # the count of the tensors this block saves (formulas/activations.py lists them), against
        # the bytes the saved-tensor hooks see: a change in what the block saves shows up here
        assert act == llama_block_activation_bytes(
            b, s, h, mc.intermediate_size, mc.num_attention_heads, tp, sp
        )
        want_out, want_dx = ref[3], ref[4]
        if sp:
            want_out, want_dx = want_out.chunk(tp, 1)[rank], want_dx.chunk(tp, 1)[rank]
        assert torch.allclose(out, want_out, atol=1e-5) and torch.allclose(dx, want_dx, atol=1e-5)
    # activations: tp shards only the attention/MLP part; SP shards the rest too.
    assert ref[2] == llama_block_activation_bytes(b, s, h, mc.intermediate_size, mc.num_attention_heads, 1)
    assert res[0][2] < ref[2]


# --------------------------------------------------------------------------------------------
# The model: the same loss at every step as one rank
# --------------------------------------------------------------------------------------------
SMALL = dict(steps=10, global_batch_size=4, seq_len=32)


@pytest.fixture(scope="module")
def one_rank():
    """The single-device run, in this process (the trainer's own rank function on a 1x mesh;
    one intra-op thread, which is much faster than two on a loaded 2-core machine)."""
    from llmlab.training.trainer import rank_main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = rank_main(TrainConfig(**SMALL))
    finally:
        torch.set_num_threads(threads)
    return {"steps": out["steps"], "ranks": [out]}


@pytest.mark.parametrize("tp, sp", [(2, False), (2, True), (4, False), (4, True)])
def test_loss_equals_one_rank(one_rank, tp, sp):
    m = llmlab.train(TrainConfig(tp=tp, sequence_parallel=sp, **SMALL), progress=False)
    ref = [s["loss"] for s in one_rank["steps"]]
    got = [s["loss"] for s in m["steps"]]
    assert len(got) == 10
    for a, b in zip(ref, got):
        assert abs(a - b) / abs(a) < 1e-4, (ref, got)
    assert ref[-1] < ref[0] - 0.5  # it trains
    ranks = m["ranks"]
    # parameters are sharded (norms replicated): well under the full model on every rank
    full_params = one_rank["ranks"][0]["memory_bytes"]["params"]
    for rk in ranks:
        assert rk["memory_bytes"]["params"] < full_params / tp * 1.1
    c = ranks[0]["comm_bytes"]
    mc = get_preset("tiny")
    kv = tp_replicated_kv_grad_bytes(
        mc.num_hidden_layers, mc.hidden_size, mc.head_dim, mc.num_key_value_heads, tp
    )
    per_step = tp_step_comm_bytes(
        SMALL["global_batch_size"],
        SMALL["seq_len"],
        mc.hidden_size,
        mc.num_hidden_layers,
        tp,
        sp,
        replicated_grad_bytes=kv,
    )
    assert {k: c[k] for k in per_step} == {k: SMALL["steps"] * v for k, v in per_step.items()}
    assert (kv > 0) == (tp > mc.num_key_value_heads)


# --------------------------------------------------------------------------------------------
# Every gradient of the sharded model equals the full model's slice (biases, tied embeddings,
# replicated kv heads, SP norm/bias finalizers)
# --------------------------------------------------------------------------------------------
def _full_grads_rank(tp):
    from llmlab.model.llama import LlamaForCausalLM
    from llmlab.parallel.tensor_parallel import ParallelAttention, RowParallelLinear, VocabParallelEmbedding
    from llmlab.parallel.tp_plan import apply_tensor_parallel
    from llmlab.runtime.mesh import Mesh

    mc = get_preset(
        "tiny",
        num_hidden_layers=2,
        tie_word_embeddings=True,
        attention_bias=True,
        o_proj_bias=True,
        mlp_bias=True,
    )
    mesh = Mesh.build(tp=tp)
    r = mesh.coords["tp"]
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g)
    y[0, :3] = -100
    full = LlamaForCausalLM(mc, seed=0)
    with torch.no_grad():  # non-zero biases so that their slicing matters
        for n, p in full.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ref_loss = full(x, y)
    ref_loss.backward()
    result = {}
    for sp in (False, True):
        m = LlamaForCausalLM(mc, seed=None)
        m.load_state_dict(full.state_dict())
        apply_tensor_parallel(m, mesh, sp)
        loss = m(x, y)
        loss.backward()
        for f in model_record(m).grad_finalizers:
            f()
        modules = dict(m.named_modules())
        fp = dict(full.named_parameters())
        worst, checked = 0.0, 0
        for n, p in m.named_parameters():
            owner_name, leaf = n.rsplit(".", 1)
            owner, ref = modules[owner_name], fp[n].grad
            if isinstance(owner, VocabParallelEmbedding):
                ref = ref[owner.vocab_start : owner.vocab_end]
            elif isinstance(owner, RowParallelLinear) and leaf == "weight":
                ref = ref.chunk(tp, 1)[r]
            elif p.shape != ref.shape:  # column-parallel weight or bias
                attn = modules[owner_name.rsplit(".", 1)[0]]
                kv = isinstance(attn, ParallelAttention) and owner_name.endswith(("k_proj", "v_proj"))
                ref = ref.chunk(attn.kv_num_shards, 0)[attn.kv_shard] if kv else ref.chunk(tp, 0)[r]
            worst = max(worst, ((p.grad - ref).abs().max() / ref.abs().max()).item())
            checked += 1
        result[sp] = (abs(loss.item() - ref_loss.item()), worst, checked)
    return result, _lora_grads(mc, mesh, x, y)


def _lora_grads(mc, mesh, x, y):
    """LoRA on every q/k/v/o/gate/up/down (llmlab.parallel.tp_lora), with non-zero B: this rank's
    A/B are the full ones' slices, their gradients (after the finalizers) the full gradients'
    slices, and the global gradient norm (duplicates counted once) the full one."""
    from llmlab.model.llama import LlamaForCausalLM
    from llmlab.model.lora import TARGETS, apply_lora, lora_state
    from llmlab.parallel import tp_lora
    from llmlab.parallel.records import param_record
    from llmlab.parallel.tp_plan import apply_tensor_parallel
    from llmlab.training.checkpoint import slice_spec
    from llmlab.training.grad_norm import global_grad_norm

    tp, r = mesh.tp, mesh.coords["tp"]

    def cut(full, local):
        spec = slice_spec(local.shape, full.shape, r, tp)
        return full if spec is None else full.chunk(spec[2], spec[0])[spec[1]]

    full = LlamaForCausalLM(mc, seed=0)
    apply_lora(full, list(TARGETS), 4, 8.0, seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in lora_state(full).items():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ref_loss = full(x, y)
    ref_loss.backward()
    ref = lora_state(full)
    ref_norm = torch.stack([p.grad.norm() for p in ref.values()]).norm().item()
    result = {}
    for sp in (False, True):
        m = apply_tensor_parallel(LlamaForCausalLM(mc, seed=0), mesh, sp)
        names = tp_lora.apply_lora(m, list(TARGETS), 4, 8.0, 3, mesh.groups["tp"])
        ours = lora_state(m)
        init_ok = all(torch.equal(p, cut(ref[n], p)) for n, p in ours.items() if "lora_A" in n)
        with torch.no_grad():
            for n, p in ours.items():
                p.copy_(cut(ref[n], p))
        loss = m(x, y)
        loss.backward()
        for f in model_record(m).grad_finalizers:
            f()
        worst = max(
            ((p.grad - cut(ref[n].grad, p)).abs().max() / ref[n].grad.abs().max()).item()
            for n, p in ours.items()
        )
        frozen = all(not p.requires_grad for n, p in m.named_parameters() if n not in ours)
        pieces = [(p.grad, not param_record(p).tp_duplicate) for p in ours.values()]
        norm, _ = global_grad_norm(pieces, torch.device("cpu"))
        result[sp] = (
            abs(loss.item() - ref_loss.item()),
            worst,
            len(names),
            init_ok,
            frozen,
            abs(norm / ref_norm - 1),
        )
    return result


def test_every_gradient_equals_full_model_slice():
    res = llmlab.launch(_full_grads_rank, 4, 4, backend="gloo")  # tp 4 > 2 kv heads: replicated
    for out, lora in res:
        for sp, (dloss, worst, checked) in out.items():
            assert dloss < 1e-5 and worst < 1e-4, (sp, dloss, worst)
            assert checked == 1 + 2 * 16 + 1  # tied embedding, 16 per layer, final norm
        for sp, (dloss, worst, adapted, init_ok, frozen, dnorm) in lora.items():
            assert dloss < 1e-5 and worst < 1e-4 and dnorm < 1e-5, (sp, dloss, worst, dnorm)
            assert adapted == 2 * 7 and init_ok and frozen
