"""What a training step moves and holds, measured the same way for every system.

``CommCounter`` is a TorchDispatchMode that sees every c10d collective any system issues
(micscompile's, FSDP2's, DeepSpeed's, DDP's reducer: they all reach the dispatcher as
``c10d.*`` ops) and counts, per rank, the bytes the ring algorithm sends for it (docs/design.md:
(g-1)/g of the buffer for all-gather and reduce-scatter, twice that for all-reduce). Bytes
that cross nodes: under a ring in group order each rank sends to the next rank of the
group, so a rank's bytes cross nodes when that next rank is on another node (``k`` ranks
per node): a flat ring over two nodes of two sends 2 of its 4 hops across; the inter-node
stage of a hierarchical gather, all of them, but for 1/k of the data.

``LiveBytes`` (micscompile's ``OutsideArena``) counts the bytes of every tensor storage
ops create while it is active, until freed: active from building a system through one
step, its peak is what that system allocated at most (parameters copied, shards,
gradients, optimizer state, buffers, activations).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from micscompile.core.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, ring_wire_bytes
from micscompile.memory.arena import OutsideArena as LiveBytes  # noqa: F401 - re-exported for the benchmarks

# c10d op -> (kind, index of the argument holding the full buffer(s))
_OPS = {
    "allreduce_": (ALL_REDUCE, 0), "allreduce_coalesced_": (ALL_REDUCE, 0),
    "_allgather_base_": (ALL_GATHER, 0), "allgather_": (ALL_GATHER, 0),
    "allgather_into_tensor_coalesced_": (ALL_GATHER, 0), "allgather_coalesced_": (ALL_GATHER, 0),
    "_reduce_scatter_base_": (REDUCE_SCATTER, 1), "reduce_scatter_": (REDUCE_SCATTER, 1),
    "reduce_scatter_tensor_coalesced_": (REDUCE_SCATTER, 1),
    "broadcast_": (ALL_GATHER, 0),  # a pipelined ring broadcast: (g-1)/g of the buffer per rank
}


def _nbytes(arg) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(arg) if isinstance(t, torch.Tensor))


class CommCounter(TorchDispatchMode):
    """Bytes this rank sends, in total and across nodes, per collective kind, while active."""

    def __init__(self, gpus_per_node: int) -> None:
        super().__init__()
        self.k = gpus_per_node
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.inter_node_bytes: dict[str, int] = defaultdict(int)
        self._ranks: dict[int, list[int]] = {}

    def _group_ranks(self, args) -> list[int]:
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except RuntimeError:
                    continue  # a ReduceOp
                if id(pg) not in self._ranks:
                    self._ranks[id(pg)] = dist.get_process_group_ranks(pg)
                return self._ranks[id(pg)]
        raise RuntimeError("a c10d op without a process group")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d" and func._opname in _OPS:
            kind, i = _OPS[func._opname]
            ranks = self._group_ranks(args)
            g, me = len(ranks), ranks.index(dist.get_rank())
            wire = ring_wire_bytes(kind, _nbytes(args[i]), g) if g > 1 else 0
            self.calls[kind] += 1
            self.bytes[kind] += wire
            if ranks[(me + 1) % g] // self.k != ranks[me] // self.k:
                self.inter_node_bytes[kind] += wire
        return out

    def total(self) -> int:
        return sum(self.bytes.values())

    def total_inter_node(self) -> int:
        return sum(self.inter_node_bytes.values())


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def max_over_ranks(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)
