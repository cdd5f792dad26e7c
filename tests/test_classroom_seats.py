"""How a node is shared among learners (llmlab.classroom.seats), on inventories of nodes we do not have."""

import pytest

from llmlab.classroom.seats import SeatAllocator, plan_room, ranks_per_learner
from llmlab.lab_sizes import LAB_SIZES


def _node(gpus: int, cores: int, ram_gib: int = 512) -> dict:
    return {
        "cpu_cores": cores,
        "usable_cores": list(range(cores)),
        "memory_bytes": ram_gib << 30,
        "gpus": [{"index": i, "memory_bytes": 80 << 30} for i in range(gpus)],
    }


def test_a_learner_gets_as_many_devices_as_the_largest_lab_needs():
    need, lab = ranks_per_learner()
    assert (need, lab) == (max(s.get("min_ranks", 1) for s in LAB_SIZES.values()), "08_3d_parallelism")
    assert ranks_per_learner(["06_paged_kv_cache", "02_tensor_parallel"]) == (2, "02_tensor_parallel")
    with pytest.raises(KeyError, match="no lab named 99_x"):
        ranks_per_learner(["99_x"])


def test_an_8_gpu_node_seats_disjoint_gpus_and_cores(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = plan_room(_node(8, 64))  # every lab: lab 08 needs 4 ranks -> 2 learners
    assert (plan.learners, plan.gpus_per_learner, plan.cores_per_learner) == (2, 4, 32)
    assert [s.gpus for s in plan.seats] == [("0", "1", "2", "3"), ("4", "5", "6", "7")]
    assert plan.seats[1].environment(True)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert plan.seats[0].mem_bytes == 256 << 30
    plan = plan_room(_node(8, 64), labs=["01_data_parallel", "02_tensor_parallel"])  # 2 ranks
    assert plan.learners == 4 and plan.cores_per_learner == 16
    gpus = [g for s in plan.seats for g in s.gpus]
    cores = [c for s in plan.seats for c in s.cores]
    assert sorted(gpus) == [str(i) for i in range(8)] and len(set(cores)) == len(cores) == 64
    assert "8 GPUs / 2 per learner, lab 01_data_parallel needs 2 ranks" in plan.describe()


def test_gpu_ids_follow_the_hubs_own_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the hub itself was given GPUs 4-7
    plan = plan_room(_node(4, 16), gpus_per_learner=2)
    assert [s.gpus for s in plan.seats] == [("4", "5"), ("6", "7")]


def test_a_cpu_node_seats_cores_and_a_small_one_seats_one_learner(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plan = plan_room(_node(0, 64, ram_gib=256))
    assert (plan.learners, plan.cores_per_learner) == (16, 4)
    assert plan.seats[3].cores == (12, 13, 14, 15) and "CUDA_VISIBLE_DEVICES" not in plan.seats[
        3
    ].environment(False)
    assert plan.seats[3].environment(False)["OMP_NUM_THREADS"] == "4"
    small = plan_room(_node(0, 2))
    assert small.learners == 1 and small.seats[0].cores == (0, 1)
    assert plan_room(_node(0, 2), cores_per_learner=1).learners == 2


def test_impossible_plans_are_refused_by_name(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(ValueError, match="4 GPUs per learner but this node has 2"):
        plan_room(_node(2, 16), gpus_per_learner=4)
    one = plan_room(_node(1, 16))  # fewer GPUs than lab 08 wants: one learner gets them
    assert one.learners == 1 and one.seats[0].gpus == ("0",) and one.seats[0].cores == tuple(range(16))
    with pytest.raises(ValueError, match="cores_per_learner must be >= 1"):
        plan_room(_node(0, 16), cores_per_learner=0)


def test_the_allocator_never_shares_a_seat(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seats = SeatAllocator(plan_room(_node(0, 4), cores_per_learner=2))
    a, b = seats.take("alice"), seats.take("bob")
    assert {a.index, b.index} == {0, 1} and seats.take("alice") == a
    with pytest.raises(RuntimeError, match="the room is full: all 2 seats"):
        seats.take("carol")
    seats.release("bob")
    assert seats.take("carol") == b
