"""The checks of the lab 05, 06, 08 and 09 exercises fail, in plain words, on realistic wrong answers.

(The generic tests in tests/test_exercises.py run every registered reference solution and expect
it to pass.) Communication exercises run on real gloo ranks, 3 of them, with tensors of 10 elements.
"""

import pytest
import torch
import torch.nn.functional as F

from llmlab import check, exercises
from llmlab.check import ExerciseFailed
from llmlab.runtime import comm


# --- lab 05: ZeRO ----------------------------------------------------------------------------------
def _zero2_sum_not_mean(flat_grad, rank, world):
    per = -(-flat_grad.numel() // world)
    out = torch.empty(per)
    comm.reduce_scatter_tensor(out, F.pad(flat_grad, (0, per * world - flat_grad.numel())))
    start, end = exercises.shard_range(flat_grad.numel(), world, rank)
    return out[: end - start]  # forgot to divide by world


def _zero2_no_reduce(flat_grad, rank, world):
    start, end = exercises.shard_range(flat_grad.numel(), world, rank)
    return flat_grad[start:end]  # kept the local gradient only


def _zero2_floor_shards(flat_grad, rank, world):
    per = flat_grad.numel() // world  # off by one: no padding
    out = torch.empty(per)
    comm.reduce_scatter_tensor(out, flat_grad[: per * world].contiguous())
    return out / world


def _zero1_no_all_gather(flat_param, grad_shard, rank, world, lr):
    start, end = exercises.shard_range(flat_param.numel(), world, rank)
    p = flat_param.clone()
    p[start:end] -= lr * grad_shard  # the other shards stay stale
    return p


def _zero1_sign_flipped(flat_param, grad_shard, rank, world, lr):
    return exercises.zero1_update(flat_param, -grad_shard, rank, world, lr)


# --- lab 06: paged KV cache ------------------------------------------------------------------------
def _slots_contiguous(block_table, positions, block_size):
    return list(positions)  # as if the cache were contiguous


def _slots_block_plus_offset(block_table, positions, block_size):
    return [block_table[p // block_size] + p % block_size for p in positions]  # forgot * block_size


def _hashes_with_partial_block(token_ids, block_size):
    from llmlab.inference.block_manager import chain_hash

    hashes, parent = [], None
    for i in range(0, len(token_ids), block_size):  # includes the partly filled last block
        parent = chain_hash(parent, token_ids[i : i + block_size])
        hashes.append(parent)
    return hashes


def _hashes_not_chained(token_ids, block_size):
    from llmlab.inference.block_manager import chain_hash

    return [
        chain_hash(None, token_ids[i * block_size : (i + 1) * block_size])
        for i in range(len(token_ids) // block_size)
    ]


# --- lab 08: 3D parallelism ------------------------------------------------------------------------
def _groups_pp_fastest(dp, tp, pp):
    # rank order with pp fastest (not Megatron's): groups have the right sizes, wrong members
    def rank(d, t, p):
        return (t * dp + d) * pp + p

    return {
        "tp": [[rank(d, t, p) for t in range(tp)] for p in range(pp) for d in range(dp)],
        "dp": [[rank(d, t, p) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "pp": [[rank(d, t, p) for p in range(pp)] for d in range(dp) for t in range(tp)],
    }


def _groups_tp_dp_swapped(dp, tp, pp):
    g = exercises.parallel_groups(dp, tp, pp)
    return {"tp": g["dp"], "dp": g["tp"], "pp": g["pp"]}


def _layout_ignores_pp(num_params, num_gpus, gpu_bytes, gpus_per_node=8):
    for tp in (1, 2, 4, 8):  # divides only by tp: 70B never fits
        if num_gpus % tp == 0 and 16 * num_params / tp <= gpu_bytes:
            return num_gpus // tp, tp, 1
    raise ValueError("does not fit")


def _layout_most_model_parallel(num_params, num_gpus, gpu_bytes, gpus_per_node=8):
    tp = min(8, num_gpus)  # always the biggest TP: fits, but wastes dp
    return num_gpus // tp, tp, 1


def test_parallel_groups_reference_equals_the_real_mesh():
    import llmlab
    from llmlab.runtime.mesh import Mesh

    def groups(dp, tp, pp):
        return Mesh.build(dp=dp, tp=tp, pp=pp).ranks

    ref = exercises.parallel_groups(2, 1, 2)
    for rank, ranks in enumerate(llmlab.launch(groups, 4, 2, 1, 2, backend="gloo")):
        for kind in ("tp", "dp", "pp"):
            assert ranks[kind] in ref[kind], (rank, kind, ranks[kind], ref[kind])
            assert rank in ranks[kind]


# --- lab 09: kernels -------------------------------------------------------------------------------
def _layer_norm_stats(x, weight, eps=1e-5):
    xc = x.float() - x.float().mean(-1, keepdim=True)  # LayerNorm, not RMSNorm
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    return (xc * rstd[:, None] * weight).to(x.dtype), rstd


def _rms_eps_outside_sqrt(x, weight, eps=1e-5):
    rstd = 1 / (x.float().pow(2).mean(-1).sqrt() + eps)
    return (x.float() * rstd[:, None] * weight).to(x.dtype), rstd


def _tiles_skip_diagonal(q_tile, block_m, block_n, seq_len):
    visit = list(range(q_tile * block_m // block_n))  # stops before the diagonal tile
    return {"visit": visit, "masked": []}


def _tiles_mask_only_same_index(q_tile, block_m, block_n, seq_len):
    ref = exercises.causal_k_tiles(q_tile, block_m, block_n, seq_len)
    return {
        "visit": ref["visit"],
        "masked": [j for j in ref["visit"] if j == q_tile],
    }  # assumes block_m == block_n


def _quantize_per_tensor(x):
    s = (x.abs().max() / 127).clamp(min=1e-12)  # one scale for every token
    return torch.round(x / s).clamp(-127, 127).to(torch.int8), s.expand(x.shape[0], 1)


def _quantize_zero_row_nan(x):
    s = x.abs().amax(1, keepdim=True) / 127  # no clamp: an all-zero row gets scale 0
    return torch.round(x / s).clamp(-127, 127).to(torch.int8), s


def _quantize_truncated(x):
    s = x.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return (x / s).to(torch.int8), s  # truncates instead of rounding


def test_causal_k_tiles_reference_gives_exact_causal_attention():
    # visiting only the reference's tiles, masking only its masked ones, equals full causal attention
    from llmlab.kernels.reference import attention_reference

    T, D, bm, bn = 13, 4, 4, 3
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, T, D, generator=g) for _ in range(3))
    want = attention_reference(q, k, v)[0, 0]
    out = torch.empty(T, D)
    for i in range(-(-T // bm)):
        rows = torch.arange(i * bm, min((i + 1) * bm, T))
        m, l, acc = torch.full((len(rows),), float("-inf")), torch.zeros(len(rows)), torch.zeros(len(rows), D)
        tiles = exercises.causal_k_tiles(i, bm, bn, T)
        for j in tiles["visit"]:
            cols = torch.arange(j * bn, min((j + 1) * bn, T))
            s = q[0, 0, rows] @ k[0, 0, cols].T / D**0.5
            if j in tiles["masked"]:
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            else:
                assert (cols[None, :] <= rows[:, None]).all()  # an unmasked tile is wholly visible
            m, l, acc = exercises.online_softmax_update(m, l, acc, s, v[0, 0, cols])
        out[rows] = acc / l[:, None]
    assert torch.allclose(out, want, atol=1e-5)


WRONG = [
    ("zero2_grad_shard", _zero2_sum_not_mean, ["rank 0's shard [0:4)", "divide by world"]),
    ("zero2_grad_shard", _zero2_no_reduce, ["rank 0's shard", "reduced over all ranks"]),
    ("zero2_grad_shard", _zero2_floor_shards, ["rank 0 should return its shard [0:4)", "shape [4]"]),
    (
        "zero1_update",
        _zero1_no_all_gather,
        ["rank 0's updated parameters", "owned by rank 1", "all-gather the shards of the others"],
    ),
    ("zero1_update", _zero1_sign_flipped, ["first wrong element 0 (owned by rank 0)", "p - lr * grad_shard"]),
    (
        "slot_mapping",
        _slots_contiguous,
        ["position 0 with block_table [3]", "physical block 3", "look the logical block up in block_table"],
    ),
    (
        "slot_mapping",
        _slots_block_plus_offset,
        ["position 0 with block_table [3]", "offset 0", "physical_block * block_size"],
    ),
    (
        "prefix_block_hashes",
        _hashes_with_partial_block,
        ["a prompt of 10 tokens, block_size 4", "number of hashes", "only full blocks"],
    ),
    (
        "parallel_groups",
        _groups_pp_fastest,
        ["the tp groups of dp2 x tp2 x pp1", "rank = (pp_index * dp + dp_index)"],
    ),
    (
        "parallel_groups",
        _groups_tp_dp_swapped,
        ["the tp groups of dp2 x tp2 x pp1", "these are the dp groups"],
    ),
    (
        "pick_layout",
        _layout_ignores_pp,
        [
            "70B parameters on 16 GPUs of 80 GB: a layout fits",
            "got:      'ValueError: does not fit'",
            "tp8 x pp2",
        ],
    ),
    (
        "pick_layout",
        _layout_most_model_parallel,
        [
            "the layout for 8B parameters on 8 GPUs of 56 GB",
            "dp1 x tp8 x pp1 needs 16.0 GB",
            "take the largest dp",
        ],
    ),
    (
        "rms_norm_forward",
        _layer_norm_stats,
        ["rstd, one fp32 value per row, row 0", "RMSNorm does not subtract the mean"],
    ),
    ("rms_norm_forward", _rms_eps_outside_sqrt, ["row 2", "eps goes inside the square root"]),
    (
        "causal_k_tiles",
        _tiles_skip_diagonal,
        ["query tile 0 (queries 0..3) with block_m 4", "key tiles visited", "tiles 0 .. 3 // block_n"],
    ),
    (
        "causal_k_tiles",
        _tiles_mask_only_same_index,
        [
            "query tile 0 (queries 0..3) with block_m 4, block_n 2",
            "need the causal mask",
            "after the tile's first query (0)",
        ],
    ),
    ("quantize_per_token", _quantize_per_tensor, ["sx for row 0", "one scale for the whole tensor"]),
    ("quantize_per_token", _quantize_zero_row_nan, ["sx for row 3 (all zeros)", "clamp the row maximum"]),
    ("quantize_per_token", _quantize_truncated, ["qx row 0", "round to nearest"]),
    ("prefix_block_hashes", _hashes_not_chained, ["hash of block 1 (tokens", "chain it with the previous"]),
]


@pytest.mark.parametrize("name,wrong,words", WRONG, ids=[f"{n}-{w.__name__}" for n, w, _ in WRONG])
def test_wrong_answer_is_explained(name, wrong, words):
    with pytest.raises(ExerciseFailed) as info:
        getattr(check, name)(wrong)
    msg = str(info.value)
    for w in words + ["expected:", "got:", "hint:"]:
        assert w in msg, (w, msg)
