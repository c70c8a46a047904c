import copy
import gc

import pytest
import torch
from models import ConvNet, TiedLM, cls_loss, lm_loss
from torch import nn

import micscompile as mc
from micscompile.trace import (
    GC_THRESHOLDS,
    LOSS_FQN,
    META_BYTES,
    META_DTYPE,
    META_FLOPS,
    META_FQN,
    META_REGION,
    META_SHAPE,
    REGION_BWD,
    REGION_FWD,
    add_call,
    copy_graph,
    fewer_collections,
)


def _lm_graph(meta: bool = True):
    if meta:
        with torch.device("meta"):
            model = TiedLM()
    else:
        model = TiedLM()
    x = torch.zeros(4, 6, dtype=torch.long)
    return model, mc.trace(model, (x, x), lm_loss)


def test_meta_trace_records_fqn_region_and_costs():
    _, g = _lm_graph()
    nodes = [n for n in g.gm.graph.nodes if n.op == "call_function"]
    fqns = {n.meta[META_FQN] for n in nodes}
    assert {"emb", "blocks.0.fc1", "blocks.1.ln", "head", LOSS_FQN} <= fqns
    fwd_mm = [n for n in nodes if n.target == torch.ops.aten.addmm.default and n.meta[META_REGION] == REGION_FWD]
    assert [n.meta[META_FQN] for n in fwd_mm] == ["blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2"]
    # backward matmuls are attributed to the module whose forward they differentiate
    bwd = {n.meta[META_FQN] for n in nodes if n.target == torch.ops.aten.mm.default and n.meta[META_REGION] == REGION_BWD}
    assert {"head", "blocks.1.fc2", "blocks.0.fc1"} <= bwd
    fc1 = fwd_mm[0]  # (24 x 10) @ (10 x 30) + bias
    assert fc1.meta[META_FLOPS] == 2 * 24 * 10 * 30 + 24 * 30
    assert fc1.meta[META_SHAPE] == (24, 30) and fc1.meta[META_DTYPE] == torch.float32
    assert fc1.meta[META_BYTES] == 24 * 30 * 4


def test_tied_weight_is_one_placeholder_with_two_names():
    _, g = _lm_graph()
    assert g.param_aliases["emb.weight"] == ["emb.weight", "head.weight"]
    assert "head.weight" not in g.param_names
    outputs = next(n for n in g.gm.graph.nodes if n.op == "output").args[0]
    assert len(outputs) == 1 + len(g.trainable)


def test_a_module_reached_under_two_names_keeps_its_own_parameters():
    """A block reused by reference (here ``blocks.0`` is ``fc``): torch's reparametrization swaps its
    weights once per name and put a traced fake tensor back into the caller's model (found by the plan
    fuzzer: ``mc.compile`` then sharded zeros)."""
    class Reused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.head = nn.Linear(4, 4), nn.Linear(4, 2)
            self.blocks = nn.ModuleList([self.fc, self.fc])

        def forward(self, x):
            for block in self.blocks:
                x = torch.tanh(block(x))
            return self.head(x)

    model = Reused()
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters(remove_duplicate=False)}
    graph = mc.trace(model, (torch.randn(3, 4), torch.tensor([0, 1, 0])), cls_loss)
    assert graph.param_aliases["fc.weight"] == ["fc.weight", "blocks.0.weight", "blocks.1.weight"]
    for name, p in model.named_parameters(remove_duplicate=False):
        assert p is before[name][0] and torch.equal(p, before[name][1]), name


def test_real_and_meta_traces_are_the_same_graph():
    _, meta = _lm_graph(meta=True)
    _, real = _lm_graph(meta=False)
    assert meta.gm.code == real.gm.code


def test_buffers_are_placeholders_and_blocks_found():
    model = ConvNet()
    g = mc.trace(model, (torch.zeros(4, 3, 8), torch.zeros(4, dtype=torch.long)), cls_loss)
    assert g.buffer_names == ["norm.mean", "norm.inv_std"]
    assert g.blocks == ["norm", "conv1", "conv2", "fc"]
    placeholders = [n for n in g.gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(g.param_names) + 2 + 2


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4))
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.inner(x))


class Gate(nn.Module):
    def forward(self, x):
        return x if x.mean() > 0 else -x


def test_data_dependent_control_flow_names_module_op_and_line():
    with pytest.raises(mc.TraceError) as info:
        mc.trace(Branchy(), (torch.zeros(2, 4), torch.zeros(2, 4)), nn.functional.mse_loss)
    msg = str(info.value)
    assert "module 'gate' (Gate)" in msg
    assert "data-dependent control flow" in msg
    assert "aten." in msg and "test_trace.py" in msg


class Nonzero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)[x.nonzero()[:, 0]]


def test_op_without_static_shape_is_named():
    with pytest.raises(mc.TraceError, match=r"module '<root>' \(Nonzero\) at op aten\.nonzero"):
        mc.trace(Nonzero(), (torch.zeros(2, 4), torch.zeros(2, 4)), nn.functional.mse_loss)


def test_batchnorm_running_stats_are_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(mc.TraceError, match=r"module '1' writes in place to buffer '1\.(running_mean|num_batches_tracked)'"):
        mc.trace(model, (torch.zeros(3, 4), torch.zeros(3, 4)), nn.functional.mse_loss)


def test_non_scalar_loss_is_refused():
    with pytest.raises(mc.TraceError, match="scalar"):
        mc.trace(nn.Linear(4, 4), (torch.zeros(3, 4), torch.zeros(3, 4)), lambda o, y: (o - y) ** 2)


def test_in_place_ops_on_activations_are_fine():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.drop = nn.Dropout(0.0)

        def forward(self, x):
            h = self.fc(x) * 2
            h += 1.0  # mul's output is not needed by its backward: legal in eager
            return torch.relu_(self.drop(h))

    mc.trace(InPlace(), (torch.zeros(2, 4), torch.zeros(2, 4)), nn.functional.mse_loss)


def test_loss_fn_reading_a_parameter_sees_the_traced_one():
    model = nn.Linear(4, 4)
    model.temp = nn.Parameter(torch.tensor(2.0))
    g = mc.trace(model, (torch.zeros(2, 4), torch.zeros(2, 4)), lambda o, y: nn.functional.mse_loss(o * model.temp, y))
    assert not [n for n in g.gm.graph.nodes if n.op == "get_attr"]  # no frozen constant
    assert "temp" in g.trainable and "temp" not in g.unused_params


def test_meta_parameters_without_an_initialiser_are_refused():
    from micscompile.runtime.materialize import check_initializable

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2))
    with pytest.raises(ValueError, match=r"module '1' \(MultiheadAttention\) .* no reset_parameters"):
        check_initializable(model, None)
    check_initializable(model, lambda m: None)  # an explicit init_fn takes responsibility


def test_our_graph_copies_and_calls_are_torch_fxs_node_for_node():
    """``copy_graph`` / ``copy_node`` / ``add_call`` skip torch.fx's pytree check of a call's arguments (a tenth of the
    search: docs/autotune.md) and make the nodes ``copy.deepcopy`` / ``Graph.call_function`` make: names, targets,
    arguments, users in order, meta, the code."""
    x = torch.zeros(4, 6, dtype=torch.long)
    with torch.device("meta"):
        model = TiedLM()
    g = mc.trace(model, (x, x), lm_loss, symbolic_batch=True).gm.graph
    ours, theirs = copy_graph(g), copy.deepcopy(g)
    ours.lint()
    assert ours.python_code("self").src == theirs.python_code("self").src
    for a, b in zip(ours.nodes, theirs.nodes, strict=True):
        assert (a.name, a.op, a.target, a.type, a.meta) == (b.name, b.op, b.target, b.type, b.meta)
        assert [u.name for u in a.users] == [u.name for u in b.users]
        assert [str(i) for i in a.all_input_nodes] == [str(i) for i in b.all_input_nodes]
    made = []
    for add in (lambda gr, *a: add_call(gr, *a), lambda gr, *a: gr.call_function(*a)):
        gr = torch.fx.Graph()
        p = gr.placeholder("x")
        total = add(gr, torch.ops.aten.sum.dim_IntList, (p, [0]), {"keepdim": True})
        gr.output(add(gr, torch.ops.aten.mul.Tensor, (total, p)))
        gr.lint()
        made.append((gr.python_code("self").src, [u.name for u in p.users]))
    assert made[0] == made[1]


def test_fewer_collections_sets_the_thresholds_inside_and_restores_them():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # (Python's defaults; whatever an earlier test left)
    try:
        with fewer_collections():
            assert gc.get_threshold() == GC_THRESHOLDS and gc.get_freeze_count() > 0
            with fewer_collections():  # (nested: the outer freeze is left to the outer exit)
                pass
            assert gc.get_threshold() == GC_THRESHOLDS and gc.get_freeze_count() > 0
        assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)
