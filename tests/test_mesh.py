"""Mesh: Megatron rank order, group membership, and real collectives on each group."""

import pytest
import torch

import llmlab
from llmlab.runtime import comm
from llmlab.runtime.mesh import Mesh, check_degrees


def _mesh_info(dp, tp, pp, ep):
    mesh = Mesh.build(dp=dp, tp=tp, pp=pp, ep=ep)
    sums = {}
    for name in ("dp", "tp", "pp", "ep", "edp"):
        t = torch.tensor([float(mesh.rank)])
        comm.all_reduce(t, group=mesh.groups.get(name))
        sums[name] = t.item()
    return mesh.coords, {k: list(v) for k, v in mesh.ranks.items()}, sums


def test_dp2_tp2_pp2_layout_and_groups():
    out = llmlab.launch(_mesh_info, 8, 2, 2, 2, 2, backend="gloo")
    for rank, (coords, ranks, sums) in enumerate(out):
        # Megatron order: tp fastest, then dp, then pp.
        assert rank == coords["pp"] * 4 + coords["dp"] * 2 + coords["tp"]
        assert ranks["tp"] == [rank - coords["tp"], rank - coords["tp"] + 1]
        assert ranks["pp"] == [rank % 4, rank % 4 + 4]
        assert ranks["dp"] == [coords["pp"] * 4 + coords["tp"], coords["pp"] * 4 + 2 + coords["tp"]]
        assert ranks["ep"] == ranks["dp"]  # ep == dp: one EP group spanning the DP ranks
        assert ranks["edp"] == [rank]
        for name in ("dp", "tp", "pp", "ep", "edp"):
            assert sums[name] == float(sum(ranks[name])), name


def test_expert_groups_are_carved_out_of_data_parallel_ranks():
    out = llmlab.launch(_mesh_info, 4, 4, 1, 1, 2, backend="gloo")
    for rank, (coords, ranks, sums) in enumerate(out):
        assert coords["dp"] == rank and coords["ep"] == rank % 2
        assert ranks["ep"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert ranks["edp"] == [rank % 2, rank % 2 + 2]
        assert sums["edp"] == float(sum(ranks["edp"]))


def test_bad_degrees_name_the_constraint():
    with pytest.raises(ValueError, match=r"dp\*tp\*pp = 2\*2\*1 = 4 must equal the world size 8"):
        check_degrees(8, dp=2, tp=2, pp=1)
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        check_degrees(4, dp=4, ep=3)
    with pytest.raises(ValueError, match="tp=0 must be a positive integer"):
        check_degrees(4, dp=4, tp=0)


def test_single_process_mesh_is_trivial():
    mesh = Mesh.build()
    assert mesh.coords == {"dp": 0, "tp": 0, "pp": 0, "ep": 0, "cp": 0}
    assert mesh.is_first_stage and mesh.is_last_stage and mesh.next_stage_rank is None
    t = torch.ones(3)
    assert comm.all_reduce(t, group=None) is None and t.tolist() == [1.0, 1.0, 1.0]
