"""Flat buffers for ZeRO: parameters laid end to end, split into one contiguous shard per rank.

A :class:`FlatBucket` takes a list of parameters and makes them *views* into one flat tensor
``full`` (1-D, ``padded`` elements, the parameters' numel summed and rounded up to a multiple of
the data-parallel degree ``N``). Rank ``r`` owns elements ``[r*s, (r+1)*s)`` with ``s =
padded / N`` (the shard). That is the layout of DeepSpeed's ZeRO-1/2 partitions and of
Megatron's distributed-optimizer buckets (each bucket padded and split ``N`` ways), and of
PyTorch FSDP1's ``FlatParameter`` for ZeRO-3 (Rajbhandari et al. 2020, §5; Zhao et al. 2023, §3).

Two tricks make ZeRO-3 free memory for real:

* ``free()`` shrinks the storage of ``full`` to 0 bytes (``untyped_storage().resize_(0)``), and
  ``gather()`` grows it back and all-gathers the shards into it. Autograd keeps *views* of the
  weights for backward (``weight.t()``); they share the storage, so the memory is really gone
  between forward and backward, and they see the re-gathered values again (as in FSDP).
* every write into ``full`` goes through ``alias``, a second tensor on the same storage with its
  own version counter, so refilling the weights does not trip autograd's in-place check.

Shapes are 1-D element counts; ``dtype`` is the storage dtype of the parameters (fp32, or bf16
for mixed precision).
"""

from __future__ import annotations

import torch
from torch import nn

from llmlab.runtime.comm import Group


class FlatBucket:
    """Parameters ``params`` (list of ``(name, Parameter)``) flattened into one sharded buffer.

    After construction every parameter's ``.data`` is a view of ``full`` (cast to ``dtype``);
    parameter objects are kept, so tied weights stay tied. ``shard()`` is this rank's slice.
    Raises ``ValueError`` if ``params`` is empty.
    """

    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter]],
        world: int,
        rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if not params:
            raise ValueError(f"bucket {name!r} has no parameters")
        self.name, self.world, self.rank = name, world, rank
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.numels))]
        self.numel = sum(self.numels)
        self.padded = -(-self.numel // world) * world
        self.shard_numel = self.padded // world
        self.dtype, self.device = dtype, device
        self.full = torch.zeros(self.padded, dtype=dtype, device=device)
        self.alias: torch.Tensor = torch.empty(0, dtype=dtype, device=device).set_(
            self.full.untyped_storage(), 0, (self.padded,)
        )  # type: ignore[call-overload]
        with torch.no_grad():
            for p, o, n in zip(self.params, self.offsets, self.numels):
                self.full[o : o + n].copy_(p.detach().reshape(-1))
                p.data = self.full[o : o + n].view(p.shape)
        self.is_full = True
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.num_grads = sum(p.requires_grad for p in self.params)  # hooks expected per backward
        # Gradient buffers (which ones exist depends on the stage; see zero.py).
        self.grad_full: torch.Tensor | None = None  # full flat gradient (stage 1, staging)
        self.grad_shard: torch.Tensor | None = None  # this rank's reduced gradient (stages 2, 3)
        self.local_shard: torch.Tensor | None = None  # owned copy of the shard (stage 3)
        self.num_ready = 0
        self.group: Group = None  # the process group that reduces it (set by its wrapper)

    # --- layout ---------------------------------------------------------------------------
    @property
    def shard_range(self) -> tuple[int, int]:
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel

    def shard_view(self) -> torch.Tensor:
        """This rank's slice of ``full`` (a view; valid while the bucket is gathered)."""
        a, b = self.shard_range
        return self.alias[a:b]

    def nbytes(self) -> int:
        """Bytes of the whole (padded) flat parameter buffer."""
        return self.padded * self.full.element_size()

    def attach_grads(self, flat: torch.Tensor) -> None:
        """Make every parameter's ``.grad`` a view of ``flat`` (autograd accumulates in place)."""
        for p, o, n in zip(self.params, self.offsets, self.numels):
            if p.requires_grad:
                p.grad = flat[o : o + n].view(p.shape)

    def copy_grad_in(self, p: nn.Parameter, flat: torch.Tensor) -> None:
        """Copy ``p.grad`` into its place in ``flat``."""
        i = self.index[id(p)]
        assert p.grad is not None
        flat[self.offsets[i] : self.offsets[i] + self.numels[i]].copy_(p.grad.reshape(-1))

    # --- ZeRO-3: keep only the shard --------------------------------------------------------
    def make_local_shard(self) -> torch.Tensor:
        """Copy this rank's shard out of ``full`` into its own tensor and return it."""
        shard = self.local_shard = self.shard_view().clone()
        return shard

    def free(self) -> None:
        """Release the gathered parameters (storage resized to 0 bytes; views stay valid)."""
        if self.is_full:
            self.full.untyped_storage().resize_(0)
            self.is_full = False

    def allocate(self) -> None:
        """Re-allocate the storage of ``full`` (contents undefined until gathered)."""
        if not self.is_full:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
            self.is_full = True
