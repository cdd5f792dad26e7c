"""torchrun across two hosts (network namespaces on this machine, else loopback addresses):
dp2 x tp2 and tp2 x pp2 give the one-rank losses and gradient norms; a host's ranks killed (or
hung) mid-run are restarted by torchrun and resume from the last checkpoint with the losses of an
uninterrupted run; bad input is refused by name before any rank works, and nothing is left."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import llmlab
from llmlab.runtime.elastic import check_interface_variables, check_restart_store, preflight, start_torchrun
from llmlab.runtime.hosts import Hosts, leftovers
from llmlab.training.config import TrainConfig

KW = dict(seed=2, global_batch_size=8, seq_len=32)
ARGS = ["train", "--seed", "2", "--global-batch-size", "8", "--seq-len", "32", "--no-progress"]
STEPS = 6


@pytest.fixture(scope="module")
def hosts():
    with Hosts(2) as h:
        yield h
    assert leftovers(h.prefix) == []


@pytest.fixture(scope="module")
def one_rank():
    m = llmlab.train(TrainConfig(steps=STEPS, **KW), progress=False)
    return {s["step"]: (s["loss"], s["grad_norm"]) for s in m["steps"]}


def _close(m, ref):
    """Every step of ``m``: loss and gradient norm within 1e-4 (relative) of one rank's."""
    got = {s["step"]: (s["loss"], s["grad_norm"]) for s in m["steps"]}
    assert got, "no steps"
    for step, (loss, norm) in got.items():
        assert abs(loss - ref[step][0]) <= 1e-4 * abs(ref[step][0]), (step, loss, ref[step])
        assert abs(norm - ref[step][1]) <= 1e-4 * abs(ref[step][1]), (step, norm, ref[step])
    return sorted(got)


def _run(hosts, tmp_path, layout, steps=STEPS, **kw):
    out = tmp_path / "m.json"
    job = start_torchrun(
        hosts,
        ARGS + ["--steps", str(steps), "--metrics-json", str(out), *layout],
        nproc_per_node=2,
        log_dir=tmp_path / "logs",
        **kw,
    )
    return job, out


@pytest.mark.parametrize(
    "layout",
    [["--dp", "2", "--tp", "2"], ["--tp", "2", "--pp", "2", "--num-microbatches", "2"]],
    ids=["dp2xtp2", "tp2xpp2"],
)
def test_two_hosts_give_the_one_rank_losses_and_grad_norms(hosts, one_rank, tmp_path, layout):
    job, out = _run(hosts, tmp_path, layout, steps=4)
    assert job.wait(240) == [0, 0], job.output(0)[-3000:] + job.output(1)[-3000:]
    m = json.loads(out.read_text())
    assert _close(m, one_rank) == [1, 2, 3, 4]
    assert m["config"]["world_size"] == 4 and len(m["ranks"]) == 4
    # ranks 0-1 on host 0, 2-3 on host 1: tensor parallelism stays inside a host
    assert [r["coords"]["tp"] for r in m["ranks"]] == [0, 1, 0, 1]


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_lost_or_hung_host_is_restarted_and_resumes_exactly(hosts, one_rank, tmp_path, fault):
    ckpt = tmp_path / "ckpt"
    # a hung host is noticed by the collectives' timeout (LLMLAB_PG_TIMEOUT), then handled alike
    env = dict(os.environ, LLMLAB_PG_TIMEOUT="15")
    job, out = _run(
        hosts,
        tmp_path,
        ["--dp", "2", "--tp", "2", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--resume"],
        max_restarts=1,
        env=env,
    )
    deadline = time.monotonic() + 180
    while not (ckpt / "step_00000002").exists():
        assert time.monotonic() < deadline and all(p.poll() is None for p in job.procs), job.output(0)
        time.sleep(0.05)
    assert hosts.signal(1, getattr(signal, fault), "LOCAL_RANK") == 2  # host 1's two ranks
    assert job.wait(300) == [0, 0], job.output(0)[-3000:] + job.output(1)[-3000:]
    m = json.loads(out.read_text())  # the restarted run's steps: from the checkpoint on
    steps = _close(m, one_rank)
    assert steps[-1] == STEPS and 3 <= steps[0] <= STEPS - 1
    if fault == "SIGKILL":  # host 1's agent saw its ranks die
        assert "exitcode: -9" in job.output(1), job.output(1)[-3000:]
    else:  # host 0's ranks gave up waiting for the hung ones
        assert "Timed out waiting 15000ms" in job.output(0), job.output(0)[-3000:]
    assert hosts.pids(0) == [] and hosts.pids(1) == []  # torchrun and every rank are gone


def test_wrong_interface_name_is_a_clear_error_before_any_rank_works(hosts, tmp_path):
    job = start_torchrun(
        hosts, ARGS + ["--steps", "2", "--dp", "2"], nproc_per_node=1, log_dir=tmp_path, interface="nosuch0"
    )
    codes = job.wait(120)
    assert codes[0] != 0 and codes[1] != 0
    for i in range(2):  # each host's rank says why, in llmlab's words, before joining
        assert (
            f"llmlab train: error: GLOO_SOCKET_IFNAME=nosuch0: host {hosts.names[i] if hosts.mode == 'netns' else ''}"
            in job.output(i)
        ), job.output(i)[-2000:]
        assert "Traceback" not in job.output(i).split("llmlab train: error")[0]
    assert hosts.pids(0) == [] and hosts.pids(1) == []


def test_bad_endpoints_are_refused_before_any_agent_starts(hosts, tmp_path):
    # the rendezvous port in use on host 0
    busy = hosts.popen(
        0,
        [
            sys.executable,
            "-c",
            "import socket,sys,time; s=socket.socket(); "
            "s.bind(('0.0.0.0',0)); s.listen(1); print(s.getsockname()[1], flush=True); "
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    port = int(busy.stdout.readline())
    try:
        with pytest.raises(ValueError, match=f"rendezvous port {port} is in use on host 0"):
            start_torchrun(hosts, ARGS, nproc_per_node=1, log_dir=tmp_path, port=port)
    finally:
        busy.kill()
        busy.wait()
    assert not list(tmp_path.glob("host*.log"))  # no agent was started
    if hosts.mode != "netns":
        return
    hosts.disconnect(1)  # host 1 unplugged: it cannot reach host 0
    try:
        with pytest.raises(ValueError, match=r"host 1 \(10\.211\.0\.2\) cannot reach the rendezvous"):
            preflight(hosts, timeout=1)
    finally:
        hosts.disconnect(1, connected=True)
    assert preflight(hosts) > 0


def test_interface_and_restart_checks_name_the_variable_and_the_fix(monkeypatch):
    ifaces = {"lo": "127.0.0.1", "eth0": "10.0.0.5"}
    two_nodes = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    check_interface_variables(two_nodes | {"GLOO_SOCKET_IFNAME": "eth0"}, "gloo", ifaces)
    with pytest.raises(
        ValueError, match=r"GLOO_SOCKET_IFNAME=eth1: host .* no interface 'eth1'.*eth0 10\.0\.0\.5"
    ):
        check_interface_variables(two_nodes | {"GLOO_SOCKET_IFNAME": "eth1"}, "gloo", ifaces)
    with pytest.raises(ValueError, match="is loopback .* spans 2 nodes"):
        check_interface_variables(two_nodes | {"GLOO_SOCKET_IFNAME": "lo"}, "gloo", ifaces)
    # every node on this machine (rank 0 reached on loopback): loopback is right
    check_interface_variables(
        two_nodes | {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.2"}, "gloo", ifaces
    )
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    with pytest.raises(ValueError, match="resolves to 127.0.1.1.*set GLOO_SOCKET_IFNAME"):
        check_interface_variables(two_nodes, "gloo", ifaces)
    with pytest.raises(ValueError, match="NCCL_SOCKET_IFNAME=ib"):
        check_interface_variables({"NCCL_SOCKET_IFNAME": "ib"}, "nccl", ifaces)
    check_interface_variables({"NCCL_SOCKET_IFNAME": "eth"}, "nccl", ifaces)  # a prefix
    check_restart_store({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"})
    check_restart_store({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"})
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        check_restart_store({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"})


def test_doctor_nodes_lists_both_hosts_with_measured_links_and_fails_a_bad_checkpoint_dir(hosts, tmp_path):
    out = tmp_path / "doctor.json"
    job = start_torchrun(
        hosts,
        ["doctor", "--nodes", "--checkpoint-dir", str(tmp_path / "ckpt"), "--json", str(out)],
        nproc_per_node=2,
        log_dir=tmp_path / "a",
    )
    assert job.wait(180) == [0, 0], job.output(0)[-3000:]
    rows = json.loads(out.read_text())
    assert all(r["result"] == "PASS" for r in rows)
    where = {(r["check"], r["where"]) for r in rows}
    assert {
        ("inventory", "node0"),
        ("inventory", "node1"),
        ("rendezvous", "node1"),
        ("all-reduce inside node", "node0"),
        ("all-reduce inside node", "node1"),
        ("all-reduce between nodes", "node0-node1"),
        ("checkpoint dir", "all nodes"),
    } <= where
    links = [r for r in rows if r["check"].startswith("all-reduce")]
    assert all(r["busbw_GBps"] > 0 and r["latency_ms"] > 0 for r in links)
    if hosts.mode == "netns":  # each node's own address (loopback hosts all use lo's 127.0.0.1)
        assert hosts.addresses[1] in next(r["detail"] for r in rows if r["where"] == "node1")
    table = job.output(0)
    assert "all-reduce between nodes  node0-node1  PASS" in table and f"{len(rows)} PASS, 0 FAIL" in table
    assert not list((tmp_path / "ckpt").iterdir())  # the probe files are removed again
    (tmp_path / "file").write_text("not a folder")
    job = start_torchrun(
        hosts,
        ["doctor", "--nodes", "--checkpoint-dir", str(tmp_path / "file" / "d")],
        nproc_per_node=1,
        log_dir=tmp_path / "b",
    )
    assert job.wait(180) == [1, 1]
    table = job.output(0)
    assert "checkpoint dir" in table and "node0 cannot write there" in table and "1 FAIL" in table
    assert "fix: use a directory on a filesystem every node mounts" in table
