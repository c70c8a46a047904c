"""insert_collectives and the schedule on FX graphs written node by node (no tracer involved).

The graph: ``y = x @ w0 @ w1 @ ... @ w{L-1}``, ``loss = y.sum()``, and its backward written
out by hand. The first layer's weight is not read in backward (``x`` needs no gradient), so
a layer chain of L weights has L forward use intervals and L - 1 backward ones.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.fx
from torch import nn

import micscompile as mc
from micscompile.core import collectives as C
from micscompile.core.program import REGION_BWD, REGION_FWD
from micscompile.lowering.flat import lower_flat
from micscompile.lowering.groups import planned_groups
from micscompile.passes.context import make_context
from micscompile.passes.insert_collectives import insert_collectives_pass
from micscompile.trace import LOSS_FQN, META_BYTES, META_FQN, META_REGION, TrainGraph

aten = torch.ops.aten
H, BATCH = 8, 4


def chain_trace(layers: int) -> TrainGraph:
    g = torch.fx.Graph()
    weights = [g.placeholder(f"w{i}") for i in range(layers)]
    x = g.placeholder("x")

    def op(target, args, fqn, region):
        node = g.call_function(target, args)
        node.meta.update({META_FQN: fqn, META_REGION: region, META_BYTES: BATCH * H * 4})
        return node

    acts = [x]
    for i, w in enumerate(weights):
        acts.append(op(aten.mm.default, (acts[-1], w), f"l{i}", REGION_FWD))
    loss = op(aten.sum.default, (acts[-1],), LOSS_FQN, REGION_FWD)
    grad_y = op(aten.ones_like.default, (acts[-1],), LOSS_FQN, REGION_BWD)
    grads = [None] * layers
    for i in reversed(range(layers)):
        grads[i] = op(aten.mm.default, (op(aten.t.default, (acts[i],), f"l{i}", REGION_BWD), grad_y), f"l{i}", REGION_BWD)
        if i > 0:  # the input needs no gradient: w0 is not read in backward
            grad_y = op(aten.mm.default, (grad_y, op(aten.t.default, (weights[i],), f"l{i}", REGION_BWD)),
                        f"l{i}", REGION_BWD)
    g.output((loss, *grads))
    names = [f"l{i}.weight" for i in range(layers)]
    return TrainGraph(
        gm=torch.fx.GraphModule(nn.Module(), g), param_names=names, param_aliases={n: [n] for n in names},
        param_shapes={n: torch.Size([H, H]) for n in names}, param_dtypes={n: torch.float32 for n in names},
        trainable=names, buffer_names=[], input_specs=[(torch.Size([BATCH, H]), torch.float32)],
        num_model_inputs=1, blocks=[f"l{i}" for i in range(layers)],
    )


def rewrite(tg: TrainGraph, p: int, prefetch: mc.Prefetch | None = None) -> torch.fx.Graph:
    ctx = make_context(tg, mc.Plan(partition_size=p).resolve(4), prefetch=prefetch or mc.Prefetch())
    graph = insert_collectives_pass(tg.graph_copy(), ctx)
    graph.lint()
    return graph


def collective_counts(graph: torch.fx.Graph) -> Counter:
    counts = Counter()
    for n in graph.nodes:
        if n.target is C.collective_wait:
            counts["wait " + n.args[1].target.__name__] += 1
        elif n.op == "call_function" and n.target.__module__ == C.__name__:
            counts[n.target.__name__] += 1
    return counts


@pytest.mark.parametrize("layers", [1, 2, 5])
def test_counts_of_gathers_waits_releases_and_reductions(layers):
    graph = rewrite(chain_trace(layers), p=2)
    uses = 2 * layers - 1  # forward intervals + backward ones (w0 has none)
    assert collective_counts(graph) == Counter({
        "all_gather_issue": uses, "wait all_gather_issue": uses, "release": uses,
        "reduce_scatter_issue": layers, "wait reduce_scatter_issue": layers,
        "accumulate": layers, "second_hop": layers,  # n = 4, p = 2: two replicas
    })
    # every read of a gathered weight sits between the wait and the release of its gather
    order = {n: i for i, n in enumerate(graph.nodes)}
    for wait in (n for n in graph.nodes if n.target is C.collective_wait and n.args[1].target is C.all_gather_issue):
        views = list(wait.users)
        release = next(u for v in views for u in v.users if u.target is C.release)
        readers = [u for v in views for u in v.users if u is not release]
        assert readers and all(order[wait] < order[r] < order[release] for r in readers)


def test_keep_live_and_across_micro_steps_on_the_chain():
    tg = chain_trace(4)
    kept = collective_counts(rewrite(tg, 2, mc.Prefetch(1, keep_live=1)))
    assert kept["all_gather_issue"] == 6 and kept["release"] == 6  # the last layer: one gather for both uses
    rp = mc.Plan(partition_size=2, micro_batches=3).resolve(4)
    across = collective_counts(insert_collectives_pass(
        tg.graph_copy(), make_context(tg, rp, prefetch=mc.Prefetch(2, across_micro_steps=True))))
    assert across["all_gather_carried"] == 2 and across["all_gather_next"] == 2
    assert across["all_gather_issue"] == 7 - 2


def test_partition_size_one_is_a_no_op_for_gathers():
    """p = 1: every rank holds whole parameters, the compute is untouched and nothing is gathered;
    gradients are added into the accumulators instead of reduced, then all-reduced over the replicas."""
    tg = chain_trace(3)
    graph = rewrite(tg, p=1)
    assert collective_counts(graph) == Counter({"accumulate_local": 1, "second_hop": 1})  # one 25 MiB bucket
    compute = Counter(n.target for n in graph.nodes if n.op == "call_function" and n.target.__module__ != C.__name__
                      and n.target.__name__ != "unpack_param")
    assert compute == Counter(n.target for n in tg.gm.graph.nodes if n.op == "call_function")


def test_budget_below_the_largest_gathered_bucket_is_refused():
    """Gathered at its use, one layer's weight is all that is live: H * H fp32 values."""
    tg = chain_trace(3)
    rp = mc.Plan(partition_size=2, memory_budget_bytes=H * H * 4).resolve(4)
    assert lower_flat(tg, rp, None, planned_groups(rp)).program.peak_gathered_bytes == H * H * 4
    rp = mc.Plan(partition_size=2, memory_budget_bytes=H * H * 4 - 1).resolve(4)
    with pytest.raises(mc.PlanError, match=f"below {H * H * 4:,} bytes"):
        lower_flat(tg, rp, None, planned_groups(rp))
