"""Lower once per plan structure, price every partition size and micro-batch size from it.

What ``mc.autotune`` runs per candidate. A plan's *structure* is what changes the rewritten
graph: checkpointing, offload and whether parameters are gathered at all (p = 1 without a cast
gathers nothing); a pipeline is lowered chunk by chunk, once per chunk shape (``chunk_keys``) and
structure, whatever its depth, and a chunk of many repeated blocks is priced from three shorter ones
(``depth``). Within one structure:

* the micro-batch size b changes only the numbers on the nodes: the trace is evaluated at
  every searched b at once (``TrainGraph.at_batch(sizes)``: every batch-dependent byte and
  FLOP count a numpy array over the sizes), lowered once, and ``at_index`` picks one size's
  Program out of it;
* the partition size p changes only the buckets' sizes and groups: ``for_partition`` puts the
  layouts, groups, hierarchical choice and replication all-reduces (second hops) of p into the Program
  lowered for another p (tests: equal to lowering p directly).

Each candidate then costs one ``lowering.flat.apply_prefetch`` and one simulation. Predictions
equal ``mc.simulate(trace.at_batch(b), plan, cluster, prefetch=[pf], scaling=False)`` (tests).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from micscompile.core.errors import InputError
from micscompile.core.pipeline_schedule import Op, PipeSchedule, make_schedule
from micscompile.core.plan import Plan, ResolvedPlan
from micscompile.core.program import Action, Kind, Prefetch, Program
from micscompile.cost_model.collective_time import ALL_GATHER, REDUCE_SCATTER
from micscompile.cost_model.pipeline import (
    chunk_prices,
    memory_neutral,
    pipeline_floor_s,
    pipeline_peak_bytes,
    second_hops_end_s,
)
from micscompile.cost_model.simulator import (
    Prediction,
    accumulate_time_s,
    floor_s,
    simulate_program,
    stream_floor_s,
)
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.build import boundary_actions, build_program, with_second_hops
from micscompile.lowering.flat import LoweredFlat, apply_prefetch, hierarchical_buckets
from micscompile.lowering.groups import planned_groups
from micscompile.lowering.pipeline import LoweredPipeline
from micscompile.lowering.pipeline_split import (
    PipelineSplit,
    Transfer,
    cut_points,
    forward_units,
    in_flight,
    split,
    unit_costs,
    unit_params,
    unit_state,
)
from micscompile.lowering.predict import model_buffer_bytes
from micscompile.lowering.tensor_split import tensor_split
from micscompile.passes.context import make_context
from micscompile.passes.manager import build_pass_list, run_passes
from micscompile.trace import META_BYTES, META_FLOPS, META_SHAPE, TrainGraph
from micscompile.tune.chunk_keys import ChunkKeys
from micscompile.tune.depth import OffLine, exact_line, on_line, shortened
from micscompile.tune.floor import backward_phase_floors, second_hop_floor_s, unit_floors, unit_grad_numel

_PER_SIZE = ("flops", "matmul_flops", "mem_bytes", "activation_bytes", "activation_peak_bytes")
"""The Action fields that depend on the micro-batch size."""


def _pick(value, i: int):
    return int(value[i]) if isinstance(value, np.ndarray) else value


def at_index(program: Program, i: int) -> Program:
    """The Program of the ``i``-th micro-batch size of a Program lowered over several."""
    def one(a: Action) -> Action:
        if a.kind is not Kind.COMPUTE:  # (a tensor collective's bytes follow the batch)
            return a._replace(tensor_bytes=_pick(a.tensor_bytes, i)) if isinstance(a.tensor_bytes, np.ndarray) else a
        return a._replace(**{f: _pick(getattr(a, f), i) for f in _PER_SIZE})
    return dataclasses.replace(program, micro_step=[one(a) for a in program.micro_step])


def for_partition(program: Program, trace: TrainGraph, rp: ResolvedPlan, cluster: Cluster, layouts=None) -> Program:
    """``program`` (lowered for another partition size > 1) as ``rp`` lowers it: the layouts (``trace``'s
    under ``rp``, unless given), groups, bucket sizes, hierarchical choice ("auto": the cost model's on
    ``cluster``) and boundary of ``rp``."""
    layouts = layouts or make_context(trace, rp).layouts
    groups = planned_groups(rp)
    hier = hierarchical_buckets(rp, layouts, cluster, groups)

    def one(a: Action) -> Action:
        if a.kind in (Kind.ALL_GATHER, Kind.ALL_GATHER_NEXT):
            return a._replace(tensor_bytes=layouts[a.bucket].full_bytes, hierarchical=a.bucket in hier)
        if a.kind in (Kind.REDUCE_SCATTER, Kind.ALL_REDUCE, Kind.PACK):
            return a._replace(tensor_bytes=layouts[a.bucket].grad_bytes,
                              hierarchical=a.kind is Kind.REDUCE_SCATTER and a.bucket in hier)
        return a

    micro_step = with_second_hops(rp, layouts, [one(a) for a in program.micro_step])
    return Program(0, rp, layouts, groups, micro_step, boundary_actions(rp, layouts, micro_step), cluster,
                   pricer=simulate_program)


def _split_at(sp: PipelineSplit, i: int) -> PipelineSplit:
    """The split's transfers at the ``i``-th micro-batch size."""
    def sizes(ts: tuple[Transfer, ...]) -> tuple[Transfer, ...]:
        return tuple(dataclasses.replace(t, shape=tuple(_pick(d, i) for d in t.shape)) for t in ts)
    stages = tuple(dataclasses.replace(st, recv_act=sizes(st.recv_act), recv_grad=sizes(st.recv_grad),
                                       send_act=sizes(st.send_act), send_grad=sizes(st.send_grad))
                   for st in sp.stages)
    return dataclasses.replace(sp, stages=stages)


def _structure(rp: ResolvedPlan) -> tuple:
    """What a lowering (a flat graph's or a pipeline chunk's) depends on besides the graph (a zero-bubble
    schedule's backward split in two among it): not the partition size or the optimizer states' sharding
    where anything is gathered (``for_partition`` lays the buckets out again), the micro-batch size
    (``at_index``) or the pipeline's depth."""
    plan, gathers = rp.plan, rp.partition_size > 1
    return (plan.checkpoint, plan.checkpoint_every, plan.offload_activations, not gathers,
            None if gathers else rp.optimizer_shards, plan.weight_split)


def split_over_sizes(trace: TrainGraph, tp: int, sequence_parallel: bool, sizes: Sequence[int],
                     at_batch: Callable[[int], TrainGraph] | None = None) -> TrainGraph | None:
    """``trace`` (symbolic batch) tensor-split and evaluated at every size of ``sizes``, all at least 2 (what
    ``at_batch(sizes)`` is for t = 1): split at the two smallest, each byte, FLOP and shape count taken as the line
    through the two (a transformer's are affine in the batch: the split divides dims other than the batch, or the
    tokens b * s by t; a batch of 1 is not on the line, its dims of size 1 split and view differently). None
    where the two splits differ node for node, or a count is not affine on integers (then each size is split
    on its own). Tested: node for node each size's own split (test_autotune.py)."""
    if not trace.batch_symbols or len(sizes) < 2 or min(sizes) < 2:
        return None
    b1, b2 = sorted(sizes)[:2]
    one, two = (tensor_split((at_batch or trace.at_batch)(b), tp, sequence_parallel) for b in (b1, b2))
    first, second = list(one.gm.graph.nodes), list(two.gm.graph.nodes)
    if len(first) != len(second) or any(x.target != y.target for x, y in zip(first, second)):
        return None
    at = np.array(sizes, dtype=np.int64)

    def line(v1, v2):
        return v1 if not isinstance(v1, int) or v1 == v2 else exact_line(v1, v2, b1, b2, at)

    try:
        for x, y in zip(first, second):
            for key in (META_BYTES, META_FLOPS):
                if key in x.meta:
                    x.meta[key] = line(x.meta[key], y.meta[key])
            if x.meta.get(META_SHAPE) is not None:
                x.meta[META_SHAPE] = tuple(line(d1, d2) for d1, d2 in zip(x.meta[META_SHAPE], y.meta[META_SHAPE]))
    except ValueError:
        return None
    return dataclasses.replace(one, batch_symbols=trace.batch_symbols)


@dataclass(frozen=True)
class OverMemory:
    """What ``Pricer.predict`` returns, given a ``capacity``, for a pipeline whose planned peak (its chunks' prices on
    its schedule, ``cost_model.pipeline.pipeline_peak_bytes``: the prediction's own) is above it: not simulated."""

    peak_bytes: int


def _lower(tg: TrainGraph, rp: ResolvedPlan) -> Program:
    """``tg`` lowered under ``rp`` with every gather at its use (distance 0: ``apply_prefetch`` moves them), as
    ``lower_flat`` lowers it, without its search, checks and fingerprint (``mc.compile`` makes them; each pass
    here is the one it runs, unlinted)."""
    ctx = make_context(tg, rp, prefetch=Prefetch(distance=0))
    graph, _ = run_passes(tg.graph_copy(), ctx, build_pass_list(rp.plan), lint=False, counts=False)
    return build_program(graph, rp, ctx.layouts, planned_groups(rp), 0)


class Pricer:
    """Predictions for any plan and micro-batch size in ``sizes`` from one symbolic-batch trace."""

    def __init__(self, trace: TrainGraph, cluster: Cluster, sizes: Sequence[int], *, evaluated: TrainGraph | None = None,
                 **costs) -> None:
        """``evaluated``: ``trace`` already evaluated at ``sizes`` (a tensor split over them, ``_tensor``)."""
        self.cluster, self.costs = cluster, costs
        self.source = trace
        self._tensor_pricers: dict[tuple, Pricer] = {}
        self._concrete: dict[int, TrainGraph] = {}
        self.sizes = list(sizes)
        self.trace = evaluated or (trace.at_batch(self.sizes) if trace.batch_symbols else trace)
        if evaluated is None and not trace.batch_symbols and self.sizes != [trace.batch_size]:
            raise InputError(f"a trace of micro-batch size {trace.batch_size} prices only that size; trace with "
                             "mc.trace(..., symbolic_batch=True) to search micro-batch sizes")
        self.buffer_bytes = model_buffer_bytes(self.trace)
        self._bases: dict[tuple, object] = {}
        self._sized_cache: dict[tuple, Program] = {}
        self._layouts: dict[tuple, tuple] = {}
        self._flops: dict[int, int] = {}
        self._stages: dict = {}
        self._cut_cache: dict[tuple, tuple[int, ...]] = {}
        self._schedules: dict[tuple, object] = {}
        self._units = None
        self._unit_floors: dict[tuple, tuple] = {}
        self._phases: dict[tuple, tuple] = {}
        self._node_floors: dict[tuple, dict] = {}  # (each node's floor per dtype and tensor ranks: unit_floors' memo)
        self._floor_cache: dict[tuple, float] = {}
        self._numel = None
        self._streams: dict[tuple, float] = {}

    def graph_flops(self, b: int) -> int:
        """FLOPs of one micro-batch of size ``b`` as traced (no recomputation)."""
        if b not in self._flops:
            i = self._index(b)
            self._flops[b] = sum(_pick(n.meta.get(META_FLOPS, 0), i) for n in self.trace.gm.graph.nodes)
        return self._flops[b]

    def _index(self, b: int) -> int:
        return self.sizes.index(b)

    def _base_flat(self, rp: ResolvedPlan) -> Program:
        """The structure's Program at distance 0, lowered over every size (cached)."""
        key = _structure(rp)
        if key not in self._bases:
            self._bases[key] = _lower(self.trace, rp)
        return self._bases[key]

    def _sized(self, program: Program, tg: TrainGraph, rp: ResolvedPlan, i: int) -> Program:
        """``program`` (a structure's, at distance 0) for ``rp`` at the ``i``-th size (cached: many
        candidates differ only in the micro-batch count and the prefetch)."""
        key = (id(program), rp.partition_size, rp.replicas, rp.plan.hierarchical, rp.optimizer_shards, i)
        if key not in self._sized_cache:
            if rp.partition_size > 1:
                out = for_partition(program, tg, rp, self.cluster, self._layouts_of(tg, rp))
            else:
                micro_step = with_second_hops(rp, program.layouts, program.micro_step)
                out = dataclasses.replace(program, plan=rp, groups=planned_groups(rp), cluster=self.cluster,
                                          micro_step=micro_step,
                                          boundary=boundary_actions(rp, program.layouts, micro_step))
            self._sized_cache[key] = at_index(out, i)
        return dataclasses.replace(self._sized_cache[key], plan=rp)

    def _layouts_of(self, tg: TrainGraph, rp: ResolvedPlan) -> tuple:
        """``tg``'s bucket layouts under ``rp`` (cached per partition size, optimizer shards, bucket size and dtypes)."""
        key = (id(tg), rp.partition_size, rp.optimizer_shards, rp.bucket_bytes, rp.plan.param_dtype,
               rp.plan.reduce_dtype)
        if key not in self._layouts:
            self._layouts[key] = make_context(tg, rp).layouts
        return self._layouts[key]

    def flat(self, plan: Plan, b: int, prefetch: Prefetch, above: float = math.inf) -> Prediction | float:
        """What ``mc.simulate`` predicts for ``plan`` (S = 1) at micro-batch size ``b`` with ``prefetch``; its
        Program's floor (``simulator.floor_s``) instead where that is above ``above``."""
        rp = plan.resolve(self.cluster.world_size, self.cluster.gpus_per_node)
        program = apply_prefetch(self._sized(self._base_flat(rp), self.trace, rp, self._index(b)), prefetch)
        if above < math.inf and not self.costs and (low := floor_s(program, self.cluster)) > above:
            return low
        return simulate_program(program, self.cluster, buffer_bytes=self.buffer_bytes, record=False, **self.costs)

    def floor(self, plan: Plan, b: int, prefetch: Prefetch | None = None, timeline: bool = True) -> float:
        """A lower bound of ``predict(plan, b, prefetch).step_time_s`` (None: of every prefetch) from the trace
        alone (``tune.floor``): a flat plan's micro-steps of its units' floors or of its collectives, a pipeline's
        chunks' floors on its schedule at its cut points (cached). ``timeline=False``: a pipeline's without its
        schedule's timeline, its busiest rank's work alone (``pipeline_floor_s``: lower, in a fraction of the time;
        ``mc.autotune`` orders by it and runs the timeline only for a candidate it does not rule out)."""
        if plan.tensor_parallel_size != self.source.tensor_parallel:
            return self._tensor(plan, b).floor(plan, b, prefetch, timeline)
        # (one per what the floor reads: not offload, whose transfers it leaves out, nor the hierarchical choice, whose
        # cheaper side it takes; of the prefetch, a flat plan's buckets it keeps live, a pipeline's nothing)
        flat = plan.pipeline_stages == 1
        key = (plan.replace(offload_activations=False, hierarchical="auto"), b,
               (prefetch and prefetch.keep_live) if flat else None, timeline or flat)
        if key not in self._floor_cache:
            self._floor_cache[key] = self._floor(plan, b, prefetch, timeline)
        return self._floor_cache[key]

    def _floor(self, plan: Plan, b: int, prefetch: Prefetch | None, timeline: bool = True) -> float:
        rp = plan.resolve(self.cluster.world_size, self.cluster.gpus_per_node)
        i = self._index(b)
        dtype = self.costs.get("compute_dtype") or str(plan.param_dtype).removeprefix("torch.")  # (the simulator's)
        fwd, bwd = self._floors_of(rp, dtype, plan.checkpoint, plan.checkpoint_every)
        if rp.stages == 1:  # (and where sharded, on the partition group's stream each micro-step: every bucket
            # gathered in the forward and again in the backward, but for those ``prefetch.keep_live`` keeps (the
            # largest, unless known), and 2hop's reduce-scatters)
            comm = self._shard_stream(rp, None if prefetch is None else prefetch.keep_live) \
                if rp.partition_size > 1 else 0.0
            return rp.micro_batches * max(float(fwd[:, i].sum() + bwd[:, i].sum()), comm)
        starts = self._cuts(rp, i)
        cuts = list(zip(starts, (*starts[1:], len(fwd))))

        def chunks(unit_s: np.ndarray) -> list[float]:
            return [float(unit_s[a:e, i].sum()) for a, e in cuts]

        # each micro-batch's backward (W where split) adds its gradients into the chunk's accumulators: at least the
        # chunk's trainable elements over p, in one bucket at least (simulator.accumulate_time_s)
        numel = self._grad_numel()
        acc = [accumulate_time_s(float(numel[a:e].sum()) / rp.partition_size, self.cluster.gpu, 1)
               if numel[a:e].sum() else 0.0 for a, e in cuts]
        back = [s + x for s, x in zip(chunks(bwd), acc)]

        hops = None  # (each chunk's second hops over the replicas, after its last backward)
        if rp.second_hop_in_backward:
            replicas = planned_groups(rp)["replicate"].ranks
            hops = [second_hop_floor_s(float(numel[a:e].sum()), plan.reduce_dtype.itemsize, rp.partition_size,
                                       replicas, rp.optimizer_shards, self.cluster) for a, e in cuts]
        # a bound on any order of the rank's work
        low = pipeline_floor_s(rp.stages, rp.micro_batches, chunks(fwd), back, split_backward=plan.weight_split,
                               v_shape=plan.pipeline_schedule == "zb-v", hops_s=hops)
        if not timeline or plan.pipeline_schedule == "zb-h1":  # (ZB-H1's W deferrals: chosen from the chunks' prices)
            return low
        sched = self._schedule(plan.pipeline_schedule, rp.stages, rp.micro_batches, plan.chunks)
        ranks = [sched.chunks_of(r) for r in range(rp.stages)]
        if plan.weight_split:
            # the schedule's timeline on what is surely each chunk's B and surely its W (floor.backward_phase_floors)
            to_b, to_w = self._phase_floors(rp, dtype)
            run = sched.simulate(chunks(fwd), [float(to_b[a:e, a, i].sum()) for a, e in cuts], 0.0,
                                 [float(to_w[a:e, a, i].sum()) + x for (a, e), x in zip(cuts, acc)])
            ends = second_hops_end_s(run, ranks, Op.WEIGHT, hops, hops) if hops else ()
            return max(low, run.makespan_s, *ends)
        # the schedule's own timeline, which no longer compute makes longer, and each rank's second hops on it
        run = sched.simulate(chunks(fwd), back)
        ends = second_hops_end_s(run, ranks, Op.BACKWARD, hops, hops) if hops else ()
        return max(low, run.makespan_s, *ends)

    def _shard_stream(self, rp: ResolvedPlan, kept: int | None) -> float:
        """A sharded flat plan's floor of its partition group's stream each micro-step (``_floor``), ``kept`` buckets
        kept live (None: all) (cached: it depends on neither the micro-batch size nor the count)."""
        layouts = self._layouts_of(self.trace, rp)
        key = (id(layouts), rp.plan.grad_sync, kept)  # (the layouts: per partition size, so the shard group too)
        if key not in self._streams:
            shard = planned_groups(rp)["shard"].ranks
            gathers = sorted(stream_floor_s(ALL_GATHER, lay.full_bytes, shard, self.cluster) for lay in layouts)
            kept = len(gathers) if kept is None else kept
            self._streams[key] = sum(gathers) + sum(gathers[:len(gathers) - kept]) + (sum(
                stream_floor_s(REDUCE_SCATTER, lay.grad_bytes, shard, self.cluster) for lay in layouts)
                if rp.plan.grad_sync == "2hop" else 0.0)
        return self._streams[key]

    def _grad_numel(self) -> np.ndarray:
        """``floor.unit_grad_numel`` of this Pricer's trace, once."""
        if self._numel is None:
            self._numel = unit_grad_numel(self.trace, self._unit_analysis()[0])
        return self._numel

    def _floors_of(self, rp: ResolvedPlan, dtype: str, *how) -> tuple[np.ndarray, np.ndarray]:
        """``floor.unit_floors`` of this Pricer's trace (cached per dtype and checkpointing)."""
        key = (dtype, *how)
        if key not in self._unit_floors:
            ranks, memo = self._node_floor_memo(rp, dtype)
            self._unit_floors[key] = unit_floors(self.trace, self._unit_analysis()[0], self.cluster, dtype, ranks,
                                                 len(self.sizes), *how, memo=memo)
        return self._unit_floors[key]

    def _phase_floors(self, rp: ResolvedPlan, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """``floor.backward_phase_floors`` of this Pricer's trace (cached per dtype)."""
        ranks, memo = self._node_floor_memo(rp, dtype)
        key = (dtype, tuple(ranks))
        if key not in self._phases:
            self._phases[key] = backward_phase_floors(self.trace, self._unit_analysis()[0], self.cluster, dtype, ranks,
                                                      len(self.sizes), memo=memo)
        return self._phases[key]

    def _node_floor_memo(self, rp: ResolvedPlan, dtype: str) -> tuple[list[int], dict]:
        """(the tensor group's ranks, each node's floor at ``dtype`` on them so far): what ``unit_floors`` and
        ``backward_phase_floors`` share."""
        ranks = planned_groups(rp)["tensor"].ranks if rp.tensor > 1 else [0]
        return ranks, self._node_floors.setdefault((dtype, tuple(ranks)), {})

    def _schedule(self, *how) -> PipeSchedule:
        """``make_schedule(*how)`` for its timeline (cached: the receives as NCCL posts them change nothing priced)."""
        if how not in self._schedules:
            self._schedules[how] = make_schedule(*how, nccl=False)
        return self._schedules[how]

    def _unit_analysis(self) -> tuple:
        """(units, seconds per size, saved bytes per size, states by t, chunk keys), once."""
        if self._units is None:
            units = forward_units(self.trace)
            seconds, _, saved = unit_costs(self.trace, units, self.cluster.gpu, 1)
            self._units = units, seconds, saved, {}, ChunkKeys(self.trace, units), unit_params(self.trace, units)
        return self._units

    def _cuts(self, rp: ResolvedPlan, i: int) -> tuple[int, ...]:
        """Where ``lowering.pipeline_split`` cuts ``rp`` at the ``i``-th size (its balance, per size)."""
        units, seconds, saved, states, _, params = self._unit_analysis()
        plan, t = rp.plan, rp.partition_size
        key = (rp.stages, plan.chunks, plan.pipeline_schedule, rp.micro_batches, t, i)
        if key not in self._cut_cache:  # (the same for every checkpointing, offload and prefetch choice)
            flight = in_flight(rp)
            cut = (rp.stages * plan.chunks, flight, t, i)  # (what cut_points reads: schedules share it)
            if cut not in self._cut_cache:
                if t not in states:
                    states[t] = unit_state(self.trace, units, t)
                self._cut_cache[cut] = cut_points(
                    rp, [float(s[i]) if isinstance(s, np.ndarray) else s for s in seconds], states[t],
                    [_pick(a, i) for a in saved], self.cluster.gpu, params, flight)
            self._cut_cache[key] = self._cut_cache[cut]
        return self._cut_cache[key]

    def _stages_of(self, rp: ResolvedPlan, starts: tuple[int, ...], chunks: Sequence[int]) -> list[tuple]:
        """(key, split graph) of each chunk of ``chunks`` in the cut at ``starts``: only the chunks of a new shape
        are split for real (at once)."""
        # a chunk without a key (chunk_keys: it may differ from others) is known by its cut alone
        every = self._unit_analysis()[4].of(starts)
        keys = {c: every[c] if every[c] is not None else ("cut", starts, c) for c in chunks}
        new = {}
        for c in chunks:
            if keys[c] not in self._stages:
                new.setdefault(keys[c], c)
        if new:
            sp = split(self.trace, rp, self.cluster.gpu, starts=starts, only=set(new.values()),
                       unit_seconds=self._unit_analysis()[1])
            for key, c in new.items():
                self._stages[key] = sp.stages[c]
        return [(keys[c], self._stages[keys[c]]) for c in chunks]

    def _lowered(self, rp: ResolvedPlan, key, st, i: int, prefetch: Prefetch, made: dict) -> LoweredFlat:
        """The chunk of ``key`` (split graph ``st``) lowered under ``rp``'s structure (once), sized for ``rp`` at
        the ``i``-th size and prefetched (once per candidate: ``made``)."""
        key = (_structure(rp), key)
        if key not in self._bases:
            self._bases[key] = _lower(st.graph, rp), st.graph
        if key not in made:
            base, graph = self._bases[key]
            made[key] = LoweredFlat(apply_prefetch(self._sized(base, graph, rp, i), prefetch), (), prefetch)
        return made[key]

    def _on_line(self, rp: ResolvedPlan, starts: tuple[int, ...], c: int, i: int, prefetch: Prefetch, made: dict,
                 priced: dict) -> tuple[LoweredFlat, object] | None:
        """Chunk ``c`` priced from three shorter chunks of its shape (``depth``): a stand-in LoweredFlat whose
        price ``priced`` holds, and the split graph of one of them (its transfers are the chunk's); None where
        the chunk is short, cannot be cut shorter, or its prices are off the line (it is then lowered whole)."""
        line = shortened(starts, c, self._unit_analysis()[4].signatures)
        if line is None:
            return None
        k, cuts = line
        short = [(self._lowered(rp, key, st, i, prefetch, made), st)
                 for cut in cuts for key, st in self._stages_of(rp, cut, [c])]
        prices = chunk_prices([lf.program for lf, _ in short], priced, self.cluster, self.costs)
        try:
            price = on_line(prices, k)
        except OffLine:
            return None
        stand = dataclasses.replace(short[0][0], program=dataclasses.replace(short[0][0].program))
        priced[id(stand.program)] = price
        return stand, short[0][1]

    def pipeline(self, plan: Plan, b: int, prefetch: Prefetch, capacity: int | None = None) -> Prediction | OverMemory:
        """What ``mc.simulate`` predicts for the pipelined ``plan`` at micro-batch size ``b``: each chunk
        shape (``chunk_keys``) lowered once per structure and priced once per candidate; a chunk of more than
        ``depth.DEPTH[-1]`` repeated blocks priced from three shorter ones. Its planned peak instead where that is
        above ``capacity`` (bytes: its schedule's timeline is not simulated)."""
        rp = plan.resolve(self.cluster.world_size, self.cluster.gpus_per_node)
        i = self._index(b)
        starts = self._cuts(rp, i)
        made: dict = {}  # (each chunk shape's Program for this candidate)
        priced: dict = {}  # (their prices: ZB-H1's deferral prices the chunks, as lower_pipeline's; the prediction reuses them)
        chunks, stages, whole, lines = [], [], [], {}  # (lines: each shape's, once; None where it has none)
        for c, key in enumerate(self._unit_analysis()[4].of(starts)):
            if key is not None and key not in lines:
                lines[key] = self._on_line(rp, starts, c, i, prefetch, made, priced)
            got = lines.get(key)
            if got is None:
                whole.append(c)
            chunks.append(got[0] if got else None)  # (the others: lowered whole, below)
            stages.append(dataclasses.replace(got[1], chunk=c) if got else None)
        for c, (key, st) in zip(whole, self._stages_of(rp, starts, whole)):
            chunks[c] = self._lowered(rp, key, st, i, prefetch, made)
            stages[c] = dataclasses.replace(st, chunk=c)
        sp = PipelineSplit(tuple(stages), (), starts, (), {})
        sched = memory_neutral(rp, self._schedule(plan.pipeline_schedule, rp.stages, rp.micro_batches,
                                                  plan.chunks),
                               [c.program for c in chunks], self.cluster, priced=priced, nccl=False, **self.costs)
        if capacity is not None:
            peak = pipeline_peak_bytes(sched, chunk_prices([c.program for c in chunks], priced, self.cluster, self.costs))
            if peak > capacity:
                return OverMemory(peak)
        pp = LoweredPipeline(rp, _split_at(sp, i), sched, chunks, 0, self.cluster)
        return pp.predict(self.cluster, record=False, priced=priced, **self.costs)

    def _tensor(self, plan: Plan, b: int) -> Pricer:
        """The Pricer of ``plan``'s tensor split (cached): the trace each tensor rank runs
        (``lowering.tensor_split``, which splits a concrete trace). A symbolic one is split at its two smallest
        searched sizes and evaluated at every size from them (``split_over_sizes``): one Pricer, lowered once per
        structure for all of them, as for t = 1; where the two do not line up, one Pricer per size."""
        t, sp = plan.tensor_parallel_size, plan.sequence_parallel
        if (t, sp) not in self._tensor_pricers:
            sizes = [n for n in self.sizes if n > 1]
            split = split_over_sizes(self.source, t, sp, sizes, self._at_batch)
            self._tensor_pricers[t, sp] = split and Pricer(split, self.cluster, sizes, evaluated=split, **self.costs)
        if b > 1 and self._tensor_pricers[t, sp] is not None:
            return self._tensor_pricers[t, sp]
        if (t, sp, b) not in self._tensor_pricers:
            tg = self._at_batch(b) if self.source.batch_symbols else self.source
            self._tensor_pricers[t, sp, b] = Pricer(tensor_split(tg, t, sp), self.cluster, [b], **self.costs)
        return self._tensor_pricers[t, sp, b]

    def _at_batch(self, b: int) -> TrainGraph:
        """``self.source.at_batch(b)``, once per size (every tensor split of the search starts from the same ones;
        a split reads it and builds its own graph)."""
        if b not in self._concrete:
            self._concrete[b] = self.source.at_batch(b)
        return self._concrete[b]

    def predict(self, plan: Plan, b: int, prefetch: Prefetch, above: float = math.inf,
                capacity: int | None = None) -> Prediction | float | OverMemory:
        """What ``mc.simulate`` predicts; where a floor found on the way is above ``above``, that floor (a float)
        instead (``mc.autotune``: the candidate cannot beat what it must); a pipeline whose planned peak is above
        ``capacity`` bytes, ``OverMemory`` (it cannot run)."""
        if plan.tensor_parallel_size != self.source.tensor_parallel:  # (a Pricer of the split trace prices it)
            return self._tensor(plan, b).predict(plan, b, prefetch, above, capacity)
        if plan.pipeline_stages > 1:
            return self.pipeline(plan, b, prefetch, capacity)
        return self.flat(plan, b, prefetch, above)
