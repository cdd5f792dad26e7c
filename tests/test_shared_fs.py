"""Multi-node checkpoints need one directory shared by every rank: checked before training."""

import llmlab


def _probe(root):
    import torch.distributed as dist

    from llmlab.runtime.shared_fs import check_shared_directory

    out = []
    check_shared_directory(f"{root}/shared")  # one directory for both ranks
    out.append("shared: ok")
    try:  # the same path on two nodes' local disks: emulated by a per-rank folder
        check_shared_directory(f"{root}/node{dist.get_rank()}")
        out.append("local: ok")
    except RuntimeError as e:
        out.append(str(e))
    return out


def test_a_checkpoint_dir_not_shared_by_all_ranks_is_refused_by_name(tmp_path):
    res = llmlab.launch(_probe, 2, str(tmp_path), backend="gloo", timeout=120)
    for r in res:
        assert r[0] == "shared: ok"
        assert "is not shared by every rank: ranks [1]" in r[1] and "NFS" in r[1]
    assert not list((tmp_path / "shared").iterdir())  # the probe file is removed
