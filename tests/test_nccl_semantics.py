"""NCCL's point-to-point semantics, reproduced on gloo CPU ranks, against the layers that use p2p.

gloo forgives three things NCCL does not: it returns one work handle per op of a
``batch_isend_irecv`` (NCCL: one handle for the whole coalesced batch), its sends complete
without the peer (NCCL: a send larger than its buffers completes only once the matching receive
is posted), and it matches messages by tag (NCCL: by posting order between two ranks).
:class:`NcclLike` replaces :mod:`llmlab.runtime.comm`'s p2p functions inside a rank with those
three rules, on top of real gloo transfers, so a layer that would hang or read an unfilled buffer
on a GPU node does so here.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import llmlab
from llmlab.runtime.launch import RankError


class NcclLike:
    """p2p with NCCL's rules. A posted receive leaves a file ``r<src>-<dst>-<k>`` (k-th receive
    from src, its tag inside); a send waits (up to ``timeout`` s) for the k-th receive of its
    peer and checks the tags match; a batch posts its receives and its real gloo ops, then waits
    for its sends' peers, and returns ONE handle whose ``wait()`` fills every receive buffer (until then the buffers
    hold NaN, as an unfinished NCCL receive holds whatever was there)."""

    def __init__(self, folder: str, timeout: float = 8.0):
        self.folder, self.timeout = folder, timeout
        self.me = dist.get_rank()
        self.nsend: dict[int, int] = {}
        self.nrecv: dict[int, int] = {}

    def _post_recv(self, src: int, tag: int) -> None:
        k = self.nrecv[src] = self.nrecv.get(src, 0) + 1
        path = os.path.join(self.folder, f"r{src}-{self.me}-{k}")
        with open(path + ".tmp", "w") as f:
            f.write(str(tag))
        os.replace(path + ".tmp", path)

    def _await_peer_recv(self, dst: int, tag: int) -> None:
        k = self.nsend[dst] = self.nsend.get(dst, 0) + 1
        path = os.path.join(self.folder, f"r{self.me}-{dst}-{k}")
        end = time.monotonic() + self.timeout
        while not os.path.exists(path):
            if time.monotonic() > end:
                raise TimeoutError(
                    f"circular wait: send #{k} from rank {self.me} to rank {dst} "
                    f"never met its receive (NCCL would hang here)"
                )
            time.sleep(0.005)
        got = int(open(path).read())
        if got != tag:
            raise RuntimeError(
                f"send #{k} {self.me}->{dst} (tag {tag}) meets receive tag {got}: "
                f"NCCL matches by order, the data would land in the wrong buffer"
            )

    def isend(self, t, dst, group=None):
        work = dist.isend(t.contiguous(), dst=dst, group=group)
        self._await_peer_recv(dst, 0)  # blocks like a large NCCL send on its stream
        return work

    def irecv(self, t, src, group=None):
        self._post_recv(src, 0)
        return dist.irecv(t, src=src, group=group)

    def batch_isend_irecv(self, ops, kind=None):
        for op in ops:
            if op.op is dist.irecv:
                self._post_recv(op.peer, op.tag)
        real, fills = [], []
        for op in ops:
            if op.op is dist.irecv:
                tmp = torch.empty_like(op.tensor)
                fills.append((op.tensor, tmp))
                op.tensor.fill_(float("nan"))
                real.append(dist.P2POp(dist.irecv, tmp, op.peer, op.group, op.tag))
            else:
                real.append(op)
        works = dist.batch_isend_irecv(real)
        for op in ops:  # the batch runs until every send has met its receive
            if op.op is dist.isend:
                self._await_peer_recv(op.peer, op.tag)
        return [_OneHandle(works, fills)]


class _OneHandle:
    def __init__(self, works, fills):
        self.works, self.fills = works, fills

    def wait(self):
        for w in self.works:
            w.wait()
        for dst, tmp in self.fills:
            dst.copy_(tmp)
        self.fills = []
        return True


def _install(folder):
    from llmlab.runtime import comm

    layer = NcclLike(os.path.join(folder, "p2p"))
    os.makedirs(layer.folder, exist_ok=True)
    for name in ("isend", "irecv", "batch_isend_irecv"):
        setattr(comm, name, getattr(layer, name))


# --- ring all-reduce ----------------------------------------------------------------------------
def _ring_rank(folder, n):
    from llmlab.parallel.data_parallel import ring_all_reduce

    _install(folder)
    r = dist.get_rank()
    t = torch.arange(n, dtype=torch.float32) * (r + 1)
    ring_all_reduce(t)
    return t


def test_ring_all_reduce_under_nccl_rules(tmp_path):
    """Separate isend/irecv per ring step: every rank blocks in its send, none posts its receive."""
    res = llmlab.launch(_ring_rank, 3, str(tmp_path), 10, backend="gloo", timeout=120)
    want = torch.arange(10, dtype=torch.float32) * 6
    for t in res:
        torch.testing.assert_close(t, want)


# --- pipeline runner ----------------------------------------------------------------------------
def _pp_rank(folder, cases):
    from llmlab.data import BatchLoader
    from llmlab.model.config import get_preset
    from llmlab.model.llama import LlamaForCausalLM
    from llmlab.parallel.pipeline_parallel import build_pipeline
    from llmlab.runtime.mesh import Mesh
    from llmlab.training.config import TrainConfig, strategy_configs

    _install(folder)
    out = {}
    for schedule, m, v in cases:
        mc = get_preset("tiny", num_hidden_layers=4)
        model = LlamaForCausalLM(mc, seed=0)
        names = {id(p): n for n, p in model.named_parameters()}
        cfg = TrainConfig(
            pp=2,
            pp_schedule=schedule,
            num_microbatches=m,
            virtual_stages=v,
            global_batch_size=m,
            seq_len=8,
            device="cpu",
        )
        runner = build_pipeline(model, Mesh.build(pp=2), strategy_configs(cfg).pp)
        micro = BatchLoader(global_batch_size=m, seq_len=8, seed=0).microbatches(1, 0, 1, m)
        loss = runner.run(micro)
        out[(schedule, m, v)] = (loss, {names[id(p)]: p.grad.clone() for p in runner.module.parameters()})
    return out


def test_pipeline_under_nccl_rules_equals_one_rank(tmp_path):
    """One handle per batch (a batch starting with a send must still wait for its receive),
    blocking sends (interleaved M=4 on 2 ranks deadlocked) and order matching."""
    from llmlab.data import BatchLoader
    from llmlab.model.config import get_preset
    from llmlab.model.llama import LlamaForCausalLM

    cases = [("1f1b", 4, 1), ("interleaved", 4, 2)]
    res = llmlab.launch(_pp_rank, 2, str(tmp_path), cases, backend="gloo", timeout=300)
    mc = get_preset("tiny", num_hidden_layers=4)
    for case in cases:
        m = case[1]
        model = LlamaForCausalLM(mc, seed=0)
        ref_loss = 0.0
        for x, y in BatchLoader(global_batch_size=m, seq_len=8, seed=0).microbatches(1, 0, 1, m):
            loss = model(x, y) / m
            loss.backward()
            ref_loss += loss.item()
        ref = {n: p.grad for n, p in model.named_parameters()}
        assert res[1][case][0] == pytest.approx(ref_loss, rel=1e-5), case
        seen = set()
        for r in res:
            for name, g in r[case][1].items():
                torch.testing.assert_close(g, ref[name], rtol=1e-4, atol=1e-6, msg=f"{case} {name}")
                seen.add(name)
        assert seen == set(ref)


def test_the_nccl_rules_catch_a_circular_wait(tmp_path):
    """The layer itself: two ranks that both send before they receive hang, and are told so."""
    with pytest.raises(RankError, match="circular wait"):
        llmlab.launch(_crossed_rank, 2, str(tmp_path), backend="gloo", timeout=120, log_dir=tmp_path / "logs")


def _crossed_rank(folder):
    from llmlab.runtime import comm

    _install(folder)
    r = dist.get_rank()
    t, buf = torch.ones(4), torch.empty(4)
    comm.isend(t, 1 - r).wait()
    comm.irecv(buf, 1 - r).wait()


# --- ring attention (context parallelism) -------------------------------------------------------
def _ring_attention_rank(folder, S):
    import torch.nn.functional as F

    from llmlab.parallel.context_parallel import token_indices
    from llmlab.parallel.ring_attention import ring_attention

    _install(folder)
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, h, S, 8, generator=g) for h in (2, 2, 2, 2))
    idx = token_indices(S, n, r, "ring")
    ql, kl, vl = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, dist.group.WORLD, list(range(n)))
    out.backward(do[:, :, idx])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref.backward(do)
    return max(
        (a - b[:, :, idx]).abs().max().item()
        for a, b in ((out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad))
    )


def test_ring_attention_under_nccl_rules(tmp_path):
    """Backward passes the key/value gradients on around the ring: sent in a batch of their own
    after the step's compute, every rank blocked in that send while its receiver had not yet
    posted the next step's batch, around the whole ring."""
    for err in llmlab.launch(_ring_attention_rank, 3, str(tmp_path), 12, backend="gloo", timeout=120):
        assert err < 1e-5
