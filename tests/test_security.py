"""Nothing that arrives over the network or from a checkpoint file is unpickled (issue 23).

The attacker tests play someone on the same node or network: one overwrites a rank's result in the
rendezvous store of a real launch with a pickle that would create a file; one hands over a
checkpoint whose shard is such a pickle, with a CRC32 and size in metadata.json that match.
"""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import llmlab
from llmlab.runtime.result_auth import ForgedValueError, _from_json, _sign, _to_json, _verified
from llmlab.training.checkpoint import CheckpointError, latest_checkpoint, verify
from llmlab.training.config import TrainConfig


class _Payload:
    """Unpickling this creates ``path``: the code an attacker's pickle runs on load."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


_ATTACKER = textwrap.dedent("""
    import datetime, sys, time
    from pathlib import Path
    import psutil
    import torch.distributed as dist

    victim, evil_file, done = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    proc = psutil.Process(victim)
    conns = getattr(proc, "net_connections", None) or proc.connections
    store, deadline = None, time.monotonic() + 120
    while store is None and time.monotonic() < deadline:   # scan the victim's listening ports
        for c in conns(kind="tcp"):
            if c.status == psutil.CONN_LISTEN:
                try:
                    store = dist.TCPStore(c.laddr.ip, c.laddr.port, is_master=False,
                                          timeout=datetime.timedelta(seconds=5))
                    break
                except Exception:
                    pass
        time.sleep(0.05)
    store.wait(["res/0"], datetime.timedelta(seconds=120))   # the genuine result is there
    store.set("res/0", evil_file.read_bytes())             # replace it with the crafted pickle
    done.write_text("overwritten")
""")


def _rank0_returns_rank1_waits(done):
    if dist.get_rank() == 1:  # keeps the launch open until the attacker has struck
        deadline = time.monotonic() + 120
        while not Path(done).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    return f"genuine result of rank {dist.get_rank()}"


def test_a_forged_result_in_the_store_of_a_real_launch_is_rejected_unexecuted(tmp_path):
    created = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps(_Payload(created)))
    done = tmp_path / "done"
    attacker = subprocess.Popen(
        [sys.executable, "-c", _ATTACKER, str(os.getpid()), str(evil), str(done)],
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    try:
        with pytest.raises(ForgedValueError) as info:
            llmlab.launch(_rank0_returns_rank1_waits, 2, str(done), backend="gloo", timeout=150)
        assert attacker.wait(30) == 0
    finally:
        attacker.kill()
        attacker.wait()
    assert done.read_text() == "overwritten"  # the attack really happened...
    assert not created.exists()  # ...and none of it ran
    assert info.value.rank == 0 and info.value.key == "res/0"
    assert "rank 0" in str(info.value) and "'res/0'" in str(info.value) and "forged" in str(info.value)


def test_values_are_bound_to_their_key_and_secret():
    secret = b"k" * 32
    blob = _sign(secret, "res/1", b"body")
    assert _verified(secret, 1, "res/1", blob) == b"body"
    with pytest.raises(ForgedValueError, match="'res/0'"):  # rank 1's genuine value moved to res/0
        _verified(secret, 0, "res/0", blob)
    with pytest.raises(ForgedValueError):
        _verified(b"x" * 32, 1, "res/1", blob)
    with pytest.raises(ForgedValueError, match="shorter than the tag"):
        _verified(secret, 1, "res/1", b"short")


def test_torchrun_json_encoding_round_trips_exactly_and_refuses_the_rest():
    v = {"a": [1, 2.5, None, True], (1, "x"): ("t", {3: "int key"}), "nan": float("inf")}
    assert _from_json(json.loads(json.dumps(_to_json(v)))) == v
    with pytest.raises(TypeError, match="Tensor"):
        _to_json([torch.zeros(1)])
    with pytest.raises(ValueError):
        _from_json({"__reduce__": ["os.system", "touch x"]})


def test_under_torchrun_results_are_json_without_a_secret_and_authenticated_pickles_with_one(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent("""
        import os
        import torch, torch.distributed as dist
        import llmlab

        def tensor_result():
            return torch.full((2,), float(dist.get_rank()))

        dist.init_process_group("gloo")  # both launches join this group (none re-initialises it)
        try:
            llmlab.launch(tensor_result, 2)
        except TypeError as e:
            assert "rank 0" in str(e) and "rank 1" in str(e) and "LLMLAB_SECRET" in str(e), e
            print("REFUSED", flush=True)
        os.environ["LLMLAB_SECRET"] = "same-on-every-node"
        out = llmlab.launch(tensor_result, 2)
        assert [t.tolist() for t in out] == [[0.0, 0.0], [1.0, 1.0]], out
        print("PICKLED", flush=True)
        dist.destroy_process_group()
    """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMLAB_SECRET")}
    env.update(PYTHONPATH=os.getcwd(), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("REFUSED") == 2 and proc.stdout.count("PICKLED") == 2


def _crc32(data: bytes) -> int:
    return zlib.crc32(data)


def test_a_checkpoint_shard_that_is_a_pickle_is_refused_by_resume_without_running(tmp_path):
    ckpt = tmp_path / "ckpt"
    kw = dict(seed=3, global_batch_size=4, seq_len=16)
    llmlab.train(TrainConfig(steps=2, checkpoint_dir=str(ckpt), checkpoint_every=1, **kw), progress=False)
    created = tmp_path / "pwned"
    step2 = ckpt / "step_00000002"
    meta = json.loads((step2 / "metadata.json").read_text())
    (shard_name,) = meta["files"]
    evil = pickle.dumps(_Payload(created))
    (step2 / shard_name).write_bytes(evil)  # the shard is now a pickle...
    meta["files"][shard_name].update(crc32=_crc32(evil), bytes=len(evil))  # ...that matches its metadata
    (step2 / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=f"{shard_name}: refused, not a safetensors file"):
        verify(step2)
    # the same pickle under the older format's name, listed as such: refused by its name
    old = ckpt / "step_00000003"
    old.mkdir()
    (old / "rank00000.pt").write_bytes(evil)
    (old / "metadata.json").write_text(
        json.dumps(
            meta
            | {
                "step": 3,
                "files": {"rank00000.pt": {"crc32": _crc32(evil), "bytes": len(evil), "tensors": {}}},
            }
        )
    )
    with pytest.raises(CheckpointError, match="rank00000.pt: refused"):
        verify(old)
    msgs = []
    assert latest_checkpoint(ckpt, log=msgs.append)[0].name == "step_00000001"
    assert any("step_00000003" in m and "refused" in m for m in msgs)
    assert any(shard_name in m and "refused" in m for m in msgs)
    # --resume skips both and continues from the newest good checkpoint, step 1
    resumed = llmlab.train(TrainConfig(steps=3, checkpoint_dir=str(ckpt), resume=True, **kw), progress=False)
    assert [s["step"] for s in resumed["steps"]] == [2, 3]
    assert not created.exists()


# --------------------------------------------------------------------------------------------
# No object collective, no unpickling of received bytes, anywhere in the package
# --------------------------------------------------------------------------------------------
def test_no_module_unpickles_what_a_peer_or_a_file_sends():
    """``*_object*`` collectives unpickle what a peer sends, ``torch.load`` and ``pickle.loads``
    what a file or socket holds. The only ``loads`` allowed are the launcher's, after its HMAC
    check, and the tensor-parallel worker's of its arguments, which its parent sent it over the
    fork server's local pipe (as the launcher sends a rank its function)."""
    import re
    from pathlib import Path

    root = Path(__file__).parents[1] / "llmlab"
    banned = re.compile(
        r"\b(broadcast_object_list|all_gather_object|gather_object|scatter_object_list|"
        r"send_object_list|recv_object_list|torch\.load|pickle\.load)\s*\("
    )
    allowed = {
        ("runtime/launch.py", "cloudpickle.loads"),
        ("inference/tensor_parallel.py", "cloudpickle.loads(payload)"),
    }
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"pickle\.loads\(", code) and not any(
                rel == f and pat in code for f, pat in allowed
            ):
                found.append(f"{rel}:{n}: {line.strip()}")
            if banned.search(code):
                found.append(f"{rel}:{n}: {line.strip()}")
    assert found == []


def test_broadcast_message_carries_data_and_tensors_and_refuses_bad_headers():
    import torch
    from llmlab.runtime.messages import _flatten, _dtype

    msg = {
        "op": "step",
        "rows": [1, 2],
        "dtype": torch.bfloat16,
        "batch": {"ids": torch.arange(5), "mask": torch.ones(2, 3, dtype=torch.bool), "p": True},
    }
    out = llmlab.launch(_roundtrip, 2, msg, backend="gloo")
    for got in out:
        assert got["op"] == "step" and got["rows"] == [1, 2] and got["dtype"] == torch.bfloat16
        assert torch.equal(got["batch"]["ids"], torch.arange(5)) and got["batch"]["p"] is True
        assert got["batch"]["mask"].dtype == torch.bool and got["batch"]["mask"].shape == (2, 3)
    with pytest.raises(TypeError, match="cannot send a object"):
        _flatten({"x": object()}, [])
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        _dtype("complex64")


def _roundtrip(msg):
    import torch.distributed as dist
    from llmlab.runtime.messages import broadcast_message

    return broadcast_message(msg if dist.get_rank() == 0 else None, src=0)
