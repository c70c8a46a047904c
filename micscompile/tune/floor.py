"""Floors: what no lowering of a candidate prices below, read off the trace (``mc.autotune`` prices best first and
skips a candidate whose floor is above every step it must beat).

A unit's floor is the compute no Program lowered from the trace runs in less time: each operation's time as the
simulator prices it (``compute_time_s``: matmul FLOPs and bytes at the device's fitted rates, and its per-operation
overhead; the passes a Program is lowered with add operations and never remove one: the runtime's own rewrites,
such as folded transposes, run after pricing), and each tensor collective's time (blocking: the compute waits it
out). Recomputation, offload, packing and the data-parallel collectives only add.
A pipeline's floor puts its chunks' floors on the schedule (``cost_model.pipeline.pipeline_floor_s``), and on a 1F1B
or interleaved timeline each chunk's second hops after its last backward starts (``second_hop_floor_s``); a flat
plan's, once lowered, is its Program's (``cost_model.simulator.floor_s``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import numpy as np
import torch.fx

from micscompile.core import collectives as C
from micscompile.core.program import COLLECTIVE_OF_KIND, REGION_BWD, REGION_FWD, TENSOR_KIND, Action, Kind
from micscompile.cost_model.collective_time import ALL_REDUCE, REDUCE_SCATTER, collective_time_s
from micscompile.cost_model.node_cost import META_TIME_S, node_work
from micscompile.cost_model.simulator import compute_time_s, stream_floor_s
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.pipeline_split import grad_sum, node_block, param_units
from micscompile.passes.checkpoint import keep_rule, recomputed, segment_members
from micscompile.trace import META_BYTES, META_REGION, TrainGraph


def unit_floors(tg: TrainGraph, units: Sequence[str], cluster: Cluster, dtype: str, tensor_ranks: Sequence[int],
                sizes: int, checkpoint=False, every: int = 1, memo: dict | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) floor seconds of each unit (rows) at each of the trace's ``sizes`` evaluated micro-batch
    sizes (columns); the backward's with what ``checkpoint`` (every ``every`` blocks) recomputes there
    (``passes.checkpoint.recomputed`` on the trace: a pipeline chunk keeps no more than the whole graph does, so
    it recomputes no less). A trace with measured times (``tune.profile``) floors each operation at its own (an
    unmeasured one at 0: a measured run of operations prices only its measured ones). ``memo``: each node's floor,
    kept for another call on the same trace, cluster, dtype and ranks (another checkpointing)."""
    index = {u: i for i, u in enumerate(units)}
    floor = _node_floors(tg, cluster, dtype, tensor_ranks, sizes, {} if memo is None else memo)
    out = {REGION_FWD: np.zeros((len(units), sizes)), REGION_BWD: np.zeros((len(units), sizes))}
    for n in tg.gm.graph.nodes:
        region, i = n.meta.get(META_REGION), index.get(node_block(n, tg.blocks))
        if i is not None and region in out:
            out[region][i] += floor(n)
    if checkpoint:
        keep = keep_rule(checkpoint, tg)
        for forward in segment_members(tg.gm.graph, tg.blocks, every).values():
            for n in recomputed(forward, keep)[2]:
                if (i := index.get(node_block(n, tg.blocks))) is not None:
                    out[REGION_BWD][i] += floor(n)
    return out[REGION_FWD], out[REGION_BWD]


def _node_floors(tg: TrainGraph, cluster: Cluster, dtype: str, tensor_ranks: Sequence[int], sizes: int,
                 memo: dict):
    """A node's floor seconds (``unit_floors``), kept in ``memo``."""
    measured = any(META_TIME_S in n.meta for n in tg.gm.graph.nodes)

    def node_floor(n: torch.fx.Node):
        if n.target in TENSOR_KIND:
            # (a reduce-scatter's input: tp pieces like its output, as lowering.build counts it)
            nbytes = np.broadcast_to(n.meta.get(META_BYTES, 0) * (n.args[4] if n.target is C.tensor_reduce_scatter
                                                                   else 1), (sizes,))
            kind = COLLECTIVE_OF_KIND[TENSOR_KIND[n.target]]
            return np.array([collective_time_s(kind, float(b), tensor_ranks, cluster) for b in nbytes])
        if measured:
            return n.meta.get(META_TIME_S, 0.0)
        w = node_work(n)
        return compute_time_s(Action(Kind.COMPUTE, ops=w.ops, matmul_flops=w.matmul_flops, mem_bytes=w.mem_bytes),
                              cluster.gpu, dtype)

    def floor(n: torch.fx.Node):
        if n not in memo:
            memo[n] = node_floor(n)
        return memo[n]
    return floor


def backward_phase_floors(tg: TrainGraph, units: Sequence[str], cluster: Cluster, dtype: str,
                          tensor_ranks: Sequence[int], sizes: int, memo: dict | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
    """(to B, to W): where a zero-bubble chunk's backward is split (``passes.weight_split``), the floor seconds of
    what is surely in its B and surely in its W, by unit and chunk start. ``to_b[k, a]``: the backward operations of
    unit k (at each size) that reach a unit below a; ``to_w[k, a]``: those that reach none (getitems left out).

    Why. A lowered chunk outputs its loss and sends alone (``insert_collectives``: the gradients go into buckets), and
    its B is what its backward's outputs, the gradients it sends down, are computed from (with releases and the
    pieces of B's multi-output operations). A backward operation of a chunk starting at unit a that reaches a unit
    below a does so through a value crossing that cut, which the chunk sends: it is in B. One that reaches no unit
    below a is an ancestor of no send: it is in W, but a getitem (a piece of a B operation goes with B). The first
    chunk (a = 0) sends nothing: its B computes nothing. A parameter's gradient summed over units (a tied weight's)
    is no path (each chunk sums its part, into the buckets) and its sums are in neither; nor is recomputation (a
    bound may leave out what it does not know)."""
    index = {u: i for i, u in enumerate(units)}
    floor = _node_floors(tg, cluster, dtype, tensor_ranks, sizes, {} if memo is None else memo)
    n_units = len(units)
    # a parameter's gradient summed from several units (a tied weight's) is not a path: the split sums each chunk's
    # part in the chunk (``pipeline_split._grad_parts``) and the sums go to the buckets, in W
    output = next(n for n in reversed(tg.gm.graph.nodes) if n.op == "output")
    sums = {a for g in output.args[0][1:] if isinstance(g, torch.fx.Node) for a in grad_sum(g)[1]}
    lowest: dict[torch.fx.Node, float] = {}  # (the lowest unit a backward operation reaches, itself included)
    by_b = np.zeros((n_units, n_units, sizes))
    by_w = np.zeros((n_units, n_units, sizes))
    for n in reversed(tg.gm.graph.nodes):
        if n.meta.get(META_REGION) != REGION_BWD or n.op != "call_function" or n in sums:
            continue
        k = index.get(node_block(n, tg.blocks))
        low = min((lowest[u] for u in n.users if u in lowest), default=math.inf)
        lowest[n] = low if k is None else min(low, k)
        if k is not None:
            by_b[k, int(lowest[n])] += floor(n)
            if n.target is not operator.getitem:
                by_w[k, int(lowest[n])] += floor(n)
    # to_b[k, a] = sum over r < a of by_b[k, r]; to_w[k, a] = sum over r >= a of by_w[k, r]
    zeros = np.zeros((n_units, 1, sizes))
    to_b = np.concatenate([zeros, np.cumsum(by_b, axis=1)], axis=1)
    to_w = np.concatenate([np.cumsum(by_w[:, ::-1], axis=1)[:, ::-1], zeros], axis=1)
    return to_b, to_w


def unit_grad_numel(tg: TrainGraph, units: Sequence[str]) -> np.ndarray:
    """The trainable elements each unit holds (a tied parameter at its own block's unit only): what a chunk of
    those units reduces over the replicas at least."""
    out, unit = np.zeros(len(units)), param_units(tg, units)
    for name in tg.trainable:
        if (i := unit.get(name)) is not None:
            out[i] += tg.param_shapes[name].numel()
    return out


def second_hop_floor_s(numel: float, itemsize: int, partition: int, replicas: Sequence[int], optimizer_shards: int,
                       cluster: Cluster) -> float:
    """The least time a rank's links hold the second hops of ``numel`` gradient elements sharded over ``partition``
    ranks, in buckets of ``itemsize``-byte elements, over ``replicas``: each bucket's shard all-reduced by itself (or
    reduce-scattered, with the optimizer states over the ``optimizer_shards`` replicas: ``Program.collective_of``),
    and a collective's time is concave in its bytes from 0 (the least of affine times, ``collective_time_s``), so
    the buckets take no less than their sum at once."""
    kind = REDUCE_SCATTER if optimizer_shards > 1 else ALL_REDUCE
    return stream_floor_s(kind, numel / partition * itemsize, replicas, cluster)
