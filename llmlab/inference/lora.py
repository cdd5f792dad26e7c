"""Serving many LoRA adapters at once on one base model, each token with its own (vLLM multi-LoRA).

:func:`enable_lora` wraps every linear layer an adapter may target (q/k/v/o, gate/up/down) in a
:class:`MultiLoRALinear` holding ``max_loras + 1`` adapter *slots*: stacked ``A [S, R, in]`` and
``B [S, out, R]`` (``R = max_lora_rank``; a smaller adapter is zero-padded, its ``alpha / r``
folded into ``B``); slot 0 is all zeros, the base model. Before each step the engine tells the
:class:`LoRASlots` which slot every token of the flattened step uses; each layer then adds
``B[s] A[s] x`` to the rows of slot ``s``, one pair of small matmuls per adapter present in the
step (Punica's "segmented" multi-LoRA, Chen et al. 2023, without the custom kernel). Rows of
different adapters and of the base share one forward. The wrapped layers are no longer fused
(q/k/v and gate/up run as separate matmuls), the price of adding the adapters after each.
Under tensor-parallel serving the layers stay the parallel ones and each holds this rank's slices
of its slots (:class:`SlotAdapters` as the layer's ``served_lora``), split as training splits an
adapter (:mod:`llmlab.parallel.tp_lora`); rank 0 sends every load/unload and each step's token
slots to the other ranks (:mod:`llmlab.inference.tensor_parallel`).

:meth:`LoRASlots.load` checks an adapter against the base (its target modules exist, every
tensor's shape matches the layer, its rank fits ``max_lora_rank``) and raises ``ValueError``
naming the mismatch; ``max_loras`` adapters fit at once.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmlab.model.lora import TARGETS, load_peft_adapter
from llmlab.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear


Slice = tuple[int, int, int] | None  # (dim, index, parts) of the full tensor this rank holds


class SlotAdapters(nn.Module):
    """One layer's adapter slots: ``lora_A [S, R, in]``, ``lora_B [S, out, R]`` (``S =
    max_loras + 1``, ``R = max_lora_rank``; buffers, not trained here; alpha / r folded into B),
    or on a tensor-parallel layer this rank's slices of them (``a_slice``/``b_slice``: ``(dim,
    index, parts)`` of the full ``[R, in]``/``[out, R]``, split as training's adapters are,
    :mod:`llmlab.parallel.tp_lora`). ``in_features``/``out_features`` are the full layer's.
    Implements :class:`~llmlab.parallel.tensor_parallel.ServedLoRA`."""

    lora_A: torch.Tensor
    lora_B: torch.Tensor

    def __init__(
        self,
        local: tuple[int, int],
        full: tuple[int, int],
        like: torch.Tensor,
        slots: "LoRASlots",
        a_slice: Slice = None,
        b_slice: Slice = None,
    ) -> None:
        super().__init__()
        self.slots, self.a_slice, self.b_slice = slots, a_slice, b_slice
        self.out_features, self.in_features = full
        S, R = slots.max_loras + 1, slots.max_lora_rank
        (out_local, in_local), dt, dev = local, like.dtype, like.device
        self.register_buffer("lora_A", torch.zeros(S, R, in_local, dtype=dt, device=dev))
        self.register_buffer("lora_B", torch.zeros(S, out_local, R, dtype=dt, device=dev))

    def cut(self, which: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full adapter tensor (``which``: ``lora_A`` or ``lora_B``)."""
        spec = self.a_slice if which == "lora_A" else self.b_slice
        return t if spec is None else t.chunk(spec[2], spec[0])[spec[1]]

    def active(self) -> bool:
        """Whether a token of this step runs with an adapter (else the layer adds nothing)."""
        return self.slots.token_slots is not None and bool(self.slots.active)

    def down(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., in] -> [..., R]``: each token's ``x A_s^T`` (zeros for the base's tokens)."""
        flat = x.reshape(-1, x.shape[-1])
        z = flat.new_zeros(flat.shape[0], self.lora_A.shape[1])
        for s in self.slots.active if self.active() else ():
            rows = self.slots.rows[s]
            z[rows] = flat[rows] @ self.lora_A[s].T
        return z.view(*x.shape[:-1], -1)

    def up(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y + B_s z`` for each token's slot ``s``, in place on ``y [..., out]``."""
        flat_z, flat_y = z.reshape(-1, z.shape[-1]), y.view(-1, y.shape[-1])
        for s in self.slots.active if self.active() else ():
            rows = self.slots.rows[s]
            flat_y[rows] += flat_z[rows] @ self.lora_B[s].T
        return y


class MultiLoRALinear(SlotAdapters):
    """``base(x) + (B[s] A[s] x)`` for each token's slot ``s``. ``x [..., in] -> [..., out]``."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, slots: "LoRASlots") -> None:
        shape = (out_features, in_features)
        super().__init__(shape, shape, next(base.parameters()), slots)
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        return self.up(self.down(x), y) if self.active() else y


class LoRASlots:
    """The adapters loaded into a model (:func:`enable_lora`), by name, and the slot of each
    token of the current step (:meth:`set_tokens`)."""

    def __init__(self, max_loras: int, max_lora_rank: int) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(
                f"--max-loras and --max-lora-rank must be >= 1, got {max_loras}, {max_lora_rank}"
            )
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.layers: dict[str, SlotAdapters] = {}
        self.by_name: dict[str, tuple[int, int, str]] = {}  # name -> (lora id, slot, path)
        self._ids = itertools.count(1)
        self.token_slots: torch.Tensor | None = None
        self.active: list[int] = []
        self.rows: dict[int, torch.Tensor] = {}

    # --- adapters ------------------------------------------------------------------------------
    def _check(self, path: str | Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        r = int(config.get("r", 0))
        if not 1 <= r <= self.max_lora_rank:
            raise ValueError(f"adapter {path}: rank {r} is outside 1..--max-lora-rank {self.max_lora_rank}")
        targets = config.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else list(targets)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown:
            raise ValueError(
                f"adapter {path} targets {unknown}, which the base model has no "
                f"linear layer for (an adapter for another base?)"
            )
        for n, t in state.items():
            module, which = n.rsplit(".", 2)[0], n.rsplit(".", 2)[1]
            layer = self.layers.get(module)
            if layer is None:
                raise ValueError(
                    f"adapter {path}: no layer {module!r} in the base model (an adapter for another base?)"
                )
            want = (r, layer.in_features) if which == "lora_A" else (layer.out_features, r)
            if tuple(t.shape) != want:
                raise ValueError(
                    f"adapter {path}: {n} has shape {tuple(t.shape)}, the base model's "
                    f"layer needs {want} (an adapter for another base)"
                )

    @torch.no_grad()
    def load(self, name: str, path: str | Path) -> int:
        """Load the PEFT adapter in ``path`` as ``name`` into a free slot; returns its lora id
        (new for every load, so the prefix cache never mixes two loads). ``ValueError`` when the
        name is taken, no slot is free, or the adapter does not fit the base."""
        if name in self.by_name:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        used = {slot for _, slot, _ in self.by_name.values()}
        free = [s for s in range(1, self.max_loras + 1) if s not in used]
        if not free:
            raise ValueError(f"--max-loras {self.max_loras} adapters are loaded already; unload one")
        config, state = load_peft_adapter(path)
        self._check(path, config, state)
        slot, r = free[0], int(config["r"])
        scaling = float(config.get("lora_alpha", r)) / r
        for layer in self.layers.values():
            layer.lora_A[slot].zero_()
            layer.lora_B[slot].zero_()
        for n, t in state.items():
            module, which = n.rsplit(".", 2)[0], n.rsplit(".", 2)[1]
            layer = self.layers[module]
            if which == "lora_A":
                layer.lora_A[slot, :r] = layer.cut(which, t).to(layer.lora_A.dtype)
            else:
                layer.lora_B[slot, :, :r] = layer.cut(which, t.float() * scaling).to(layer.lora_B.dtype)
        lora_id = next(self._ids)
        self.by_name[name] = (lora_id, slot, str(path))
        return lora_id

    def unload(self, name: str) -> None:
        """Free the adapter ``name``'s slot; ``KeyError`` when none is loaded by that name."""
        if name not in self.by_name:
            raise KeyError(name)
        del self.by_name[name]

    def lora_id(self, name: str) -> int:
        """The id of the loaded adapter ``name``; ``KeyError`` when none is loaded."""
        return self.by_name[name][0]

    # --- the step ------------------------------------------------------------------------------
    def set_tokens(self, pairs: list[tuple[int, int]], device: torch.device) -> None:
        """``pairs``: ``(lora id, token count)`` of each sequence in the step's flattened order
        (0 = the base). A lora id no longer loaded is a ``KeyError``."""
        slot_of = {i: s for i, s, _ in self.by_name.values()} | {0: 0}
        self.set_slots([slot_of[i] for i, n in pairs for _ in range(n)], device)

    def set_slots(self, token_slots: list[int], device: torch.device) -> None:
        """Each token's slot (0 = the base), in the step's flattened order: what a
        tensor-parallel rank receives from rank 0 with the step."""
        slots = torch.tensor(token_slots, dtype=torch.long)
        self.active = sorted(set(token_slots) - {0})
        self.rows = {s: (slots == s).nonzero().flatten().to(device) for s in self.active}
        self.token_slots = slots


def _parallel_slots(module: ColumnParallelLinear | RowParallelLinear, slots: LoRASlots) -> SlotAdapters:
    """The adapter slots of a tensor-parallel layer, split as :mod:`llmlab.parallel.tp_lora` splits
    training's adapters: column-parallel (q/k/v, gate/up) ``A`` whole and ``B`` this rank's rows
    (a replicated kv head's rows on its ranks), row-parallel (o, down) ``A`` this rank's columns
    and ``B`` whole. The layers add them (:class:`~llmlab.parallel.tensor_parallel.ServedLoRA`)."""
    import torch.distributed as dist

    tp = dist.get_world_size(module.group) if dist.is_initialized() else 1
    r = dist.get_rank(module.group) if tp > 1 else 0
    w = module.weight
    full = (module.out_features, module.in_features)
    if isinstance(module, ColumnParallelLinear):
        parts = module.out_features // w.shape[0]
        return SlotAdapters((w.shape[0], w.shape[1]), full, w, slots, b_slice=(0, r // (tp // parts), parts))
    return SlotAdapters((w.shape[0], w.shape[1]), full, w, slots, a_slice=(1, r, tp))


def enable_lora(model: nn.Module, max_loras: int, max_lora_rank: int) -> LoRASlots:
    """Wrap ``model``'s decoder-layer target linear layers (:data:`llmlab.model.lora.TARGETS`) in
    :class:`MultiLoRALinear` and undo the projection fusion of the layers holding them (a
    tensor-parallel layer gets its slots' slices as its ``served_lora`` instead); returns
    the :class:`LoRASlots` to load adapters into and to set each step's token slots."""
    slots = LoRASlots(max_loras, max_lora_rank)
    for name, module in list(model.named_modules()):
        parent_name, _, leaf = name.rpartition(".")
        if (
            leaf not in TARGETS or isinstance(module, MultiLoRALinear) or not name.startswith("model.layers.")
        ):  # the decoder's, not a vision tower's
            continue
        w = getattr(module, "weight", None)
        if w is None:
            continue
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):  # tensor-parallel serving
            module.served_lora = slots.layers[name] = _parallel_slots(module, slots)
            continue
        out_f, in_f = w.shape
        parent = model.get_submodule(parent_name)
        for fused in ("fused_qkv", "fused_gate_up"):  # separate matmuls, adapters after each
            if hasattr(parent, fused):
                setattr(parent, fused, None)
        wrapped = MultiLoRALinear(module, in_f, out_f, slots)
        setattr(parent, leaf, wrapped)
        slots.layers[name] = wrapped
    return slots
