"""torch.compile on both ends: Inductor-generated compute between communication points
(``Plan.codegen="inductor"``) and the Dynamo frontend (``mc.backend``).

Hand graphs check the region split and the reuse of identical regions in one process; one
4-rank gloo launch checks parity with single-process eager for the spine's models (with
Inductor, through Dynamo, and both) and the refusals: a graph break names its source line, a
loss that is not a scalar and a recompile are refused, each on every rank before any collective.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator

import pytest
import torch
import torch.fx
from dist_cases import Case, run_case
from harness import assert_parity, launch, run_cases
from models import MODELS, Branchy, ConvNet, TiedLM, lm_loss

import micscompile as mc
from micscompile.cli.parity import LOW_PRECISION_TOLERANCE, TOLERANCE
from micscompile.runtime.codegen import compile_regions, find_regions

WORLD = 4


def _comm_point(x):
    """Stands in for a collective: not an ATen op, so it bounds regions."""
    return x


torch.fx.wrap("_comm_point")


def _hand_graph() -> torch.fx.GraphModule:
    """Two identical 'layers' (matmul, gelu, add) each behind a communication point, with a
    multi-output op whose getitem sits after the next communication point."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    h = x
    for _ in range(2):
        wv = g.call_function(_comm_point, (w,))
        mm = g.call_function(torch.ops.aten.mm.default, (h, wv))
        act = g.call_function(torch.ops.aten.gelu.default, (mm,))
        h = g.call_function(torch.ops.aten.add.Tensor, (act, h))
    split = g.call_function(torch.ops.aten.split.Tensor, (h, 2))
    g.call_function(_comm_point, (x,))
    first = g.call_function(operator.getitem, (split, 0))
    g.output((g.call_function(torch.ops.aten.sum.default, (first,)),))
    return _with_vals(torch.fx.GraphModule(torch.nn.Module(), g))


def _with_vals(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """node.meta["val"] on every node, as a trace leaves it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(torch.empty(4, 4)) for _ in range(2)))
    return gm


def test_regions_stop_at_communication_points_and_keep_getitems_with_their_op():
    gm = _hand_graph()
    runs = find_regions(gm.graph)
    ops = [[getattr(n.target, "__name__", "") for n in r] for r in runs]
    assert ops == [["mm.default", "gelu.default", "add.Tensor"],
                   ["mm.default", "gelu.default", "add.Tensor", "split.Tensor"], ["getitem", "sum.default"]]
    regions = compile_regions(gm, torch.device("cpu"))
    # the getitem moved next to split; the second layer's region differs from the first (split)
    assert [r.ops for r in regions] == [3, 5, 1]
    assert [r.first for r in regions] == [runs[0][0].name, runs[1][0].name, "sum_default"]
    gm2 = _hand_graph()
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(gm(x, w)[0], gm2(x, w)[0])


def test_an_op_whose_outputs_are_read_as_one_tuple_runs_eagerly_outside_every_region():
    """A region's outputs are tensors: a multi-output op read whole (not through getitems; a pipeline's
    zero-bubble cut did this to SDPA's (out, logsumexp)) stays out of the regions, and the graph computes as
    before (Inductor refused it: "output spec mismatch")."""
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    h = g.call_function(torch.ops.aten.mm.default, (x, w))
    parts = g.call_function(torch.ops.aten.split.Tensor, (h, 2, 1))
    whole = g.call_function(torch.ops.aten.cat.default, (parts, 1))
    g.output((g.call_function(torch.ops.aten.gelu.default, (whole,)),))
    gm = _with_vals(torch.fx.GraphModule(torch.nn.Module(), g))
    x_, w_ = torch.randn(4, 4), torch.randn(4, 4)
    want = gm(x_, w_)[0]
    assert all(parts not in run for run in find_regions(gm.graph))
    compile_regions(gm, torch.device("cpu"))
    torch.testing.assert_close(gm(x_, w_)[0], want)


def test_identical_layers_compile_once():
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    h = x
    for _ in range(3):
        wv = g.call_function(_comm_point, (w,))
        h = g.call_function(torch.ops.aten.gelu.default, (g.call_function(torch.ops.aten.mm.default, (h, wv)),))
    g.output((h,))
    gm = _with_vals(torch.fx.GraphModule(torch.nn.Module(), g))
    x_, w_ = torch.randn(4, 4), torch.randn(4, 4) / 4
    want = gm(x_, w_)[0]
    regions = compile_regions(gm, torch.device("cpu"))
    assert [r.reused_from for r in regions] == [None, 0, 0]
    assert regions[0].compile_s > 0 and regions[1].compile_s == regions[2].compile_s == 0
    assert sum(n.op == "call_module" for n in gm.graph.nodes) == 3
    torch.testing.assert_close(gm(x_, w_)[0], want)
    # compiled for contiguous inputs: a strided one (a sliced batch) is laid out as compiled first
    x_t = torch.randn(4, 4).t()
    torch.testing.assert_close(gm(x_t, w_)[0], _three_layers_eager(x_t, w_))
    report = mc.CodegenReport(regions)
    assert "reuses #0" in str(report) and len(report.compiled) == 1


def _three_layers_eager(x, w):
    for _ in range(3):
        x = torch.ops.aten.gelu.default(x @ w)
    return x


def test_backend_refuses_pipelines_and_takes_only_plans():
    with pytest.raises(mc.CaptureError, match="pipeline_stages=1 plans for now"):
        mc.backend(mc.Plan(pipeline_stages=2), optimizer=torch.optim.SGD)
    with pytest.raises(TypeError, match="plan must be a micscompile.Plan"):
        mc.backend({"partition_size": 2}, optimizer=torch.optim.SGD)


def test_plan_refuses_an_unknown_codegen():
    with pytest.raises(mc.PlanError, match="codegen must be 'auto', 'eager' or 'inductor'"):
        mc.Plan(codegen="triton")
    mc.Plan(codegen="inductor", param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)  # mixed precision compiles


def test_regions_never_record_inductors_own_cuda_graphs(monkeypatch):
    """A region records no CUDA graph of its own (``TORCHINDUCTOR_CUDAGRAPHS=1`` would), which would be replayed
    inside the step's capture (``Plan.cuda_graph``); one compile thread unless the environment sets them."""
    from micscompile.runtime.codegen import inductor_options

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    assert inductor_options() == {"compile_threads": 1, "triton.cudagraphs": False}
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
    assert inductor_options() == {"triton.cudagraphs": False}


def test_a_region_given_an_input_of_another_dtype_than_traced_reads_it_as_traced():
    """The meta kernels the trace runs give ``native_layer_norm``'s mean and rstd the accumulation dtype (float32
    for a bf16 input, as CUDA does); the CPU's kernel keeps bf16. A region compiled for the trace's float32 read
    the CPU's bf16 statistics as garbage (non-finite layer-norm gradients: why Inductor ran fp32 plans only)."""
    g = torch.fx.Graph()
    x, mean, rstd, w = (g.placeholder(n) for n in ("x", "mean", "rstd", "w"))
    centred = g.call_function(torch.ops.aten.sub.Tensor, (x, mean))
    g.output((g.call_function(torch.ops.aten.mul.Tensor, (g.call_function(torch.ops.aten.mul.Tensor, (centred, rstd)),
                                                           w)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    bf16, f32 = torch.bfloat16, torch.float32
    mode = FakeTensorMode()
    FakeTensorProp(gm, mode).propagate(*(mode.from_tensor(torch.empty(4, n, dtype=d))
                                         for n, d in ((8, bf16), (1, f32), (1, f32), (8, bf16))))
    torch.manual_seed(0)
    args = [torch.randn(4, 8, dtype=bf16), torch.randn(4, 1, dtype=bf16), torch.rand(4, 1, dtype=bf16) + 0.5,
            torch.randn(4, 8, dtype=bf16)]  # the statistics in bf16, as the CPU's layer norm leaves them
    expected = gm(*(a.to(f32) if a.shape[1] == 1 else a for a in args))[0]
    compile_regions(gm, torch.device("cpu"))
    got = gm(*args)[0]
    assert got.dtype == expected.dtype and torch.allclose(got.float(), expected.float(), atol=2e-2), (got, expected)


# ---- 4 ranks ------------------------------------------------------------------------------------

ONE_AHEAD = mc.Prefetch(distance=1)
"""Both blocks scheduled alike (the default schedule may keep only the last one live), so the second
block's regions are the first's: compiled once."""
CASES = [
    Case("tied_lm", 2, 3, "sgd", codegen="inductor", prefetch=ONE_AHEAD),
    Case("tied_lm", 4, 1, "adamw", codegen="inductor"),
    Case("convnet", 4, 4, "adamw", codegen="inductor"),
    Case("convnet", 1, 3, "sgd", codegen="inductor"),
    Case("quirky", 2, 3, "adamw", codegen="inductor"),
    Case("tied_lm", 2, 3, "sgd", codegen="inductor", checkpoint=True, prefetch=ONE_AHEAD),
    # mixed precision: the CPU's layer norm keeps bf16 statistics where the trace's meta kernel said float32.
    # SGD: AdamW's first steps are lr * sign(g), so a near-zero gradient whose sign rounding flips moves its value
    # 2 lr, which puts the tied LM's ln.bias 0.20 from the reference (the bf16 references' own floor, eager against
    # float64, is 0.20 there too); the covering design's judge measures that floor (benchmarks/fuzz_plans.py)
    Case("tied_lm", 2, 3, "sgd", codegen="inductor", prefetch=ONE_AHEAD, param_dtype=torch.bfloat16),
    Case("convnet", 4, 1, "adamw", codegen="inductor", param_dtype=torch.float16, reduce_dtype=torch.float16),
    Case("tied_lm", 2, 3, "sgd", dynamo=True),
    Case("convnet", 4, 1, "adamw", dynamo=True),
    Case("quirky", 2, 3, "sgd", dynamo=True),
    Case("tied_lm", 4, 1, "sgd", dynamo=True, codegen="inductor"),
]
# the same plans compiled by mc.compile from the module: the Dynamo frontend must give the same step
DYNAMO_TWINS = {c: dataclasses.replace(c, dynamo=False) for c in CASES if c.dynamo}
BREAK_LINE = next(i for i, line in enumerate(inspect.getsourcelines(Branchy.forward)[0])
                  if "h.mean() > 0" in line) + inspect.getsourcelines(Branchy.forward)[1]


def _refused(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "NO EXCEPTION"


def refusals(rank: int, world: int) -> dict[str, str]:
    """Each must fail on every rank before any collective (the cases after them prove it)."""
    _, _, make_batches = MODELS["convnet"]
    x, y = make_batches(1, 4)[0]
    opt = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    plan = mc.Plan(partition_size=2)
    out = {}
    torch._dynamo.reset()
    model = Branchy()
    out["graph_break"] = _refused(lambda: torch.compile(
        lambda x, y: torch.nn.functional.cross_entropy(model(x), y), backend=mc.backend(plan, optimizer=opt))(x, y))
    torch._dynamo.reset()
    model = ConvNet()
    out["static_micro_batches"] = _refused(lambda: torch.compile(
        lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
        backend=mc.backend(mc.Plan(partition_size=2, micro_batches=2), optimizer=opt))(x, y))
    torch._dynamo.reset()
    out["not_a_loss"] = _refused(lambda: torch.compile(ConvNet(), backend=mc.backend(plan, optimizer=opt))(x))
    return out


def recompile(rank: int, world: int) -> str:
    """A step trained through Dynamo, then a batch of another shape: Dynamo compiles again, refused."""
    _, _, make_batches = MODELS["convnet"]
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ConvNet()
    run = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(model(x), y),
                        backend=mc.backend(mc.Plan(partition_size=2), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1)))
    run(*make_batches(1, 4)[0])
    return _refused(lambda: run(*make_batches(1, 8)[0]))


def run_all(rank: int, world: int) -> dict:
    results = run_cases(rank, world, refusals, run_case, CASES + list(DYNAMO_TWINS.values()))
    results["recompile"] = recompile(rank, world)
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(run_all, WORLD, timeout_s=540)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parity_with_single_process_eager(results, case: Case):
    """fp32 within TOLERANCE; mixed precision against the eager 16-bit reference (``train_reference_mixed``)
    within LOW_PRECISION_TOLERANCE: Inductor's fused kernels keep their intermediates in float32 where eager
    rounds each op's output to 16 bits."""
    tolerance = LOW_PRECISION_TOLERANCE if case.mixed else TOLERANCE
    assert_parity(results, case, tolerance)
    for rank, res in enumerate(results):
        assert res[case]["own_shard_err"] <= tolerance, (rank, res[case]["own_shard_err"])


@pytest.mark.multiproc
@pytest.mark.parametrize("case", [c for c in CASES if c.codegen == "inductor"], ids=lambda c: c.id)
def test_inductor_runs_the_compute_and_compiles_each_distinct_region_once(results, case: Case):
    for rank, res in enumerate(results):
        regions = res[case]["codegen"]
        compiled = [r for r in regions if r[0]]
        assert compiled, rank
        firsts = {}
        for _, reused_from, key, seconds, _ in compiled:
            if reused_from is None:
                assert key not in firsts and seconds > 0, (rank, key)
                firsts[key] = seconds
            else:
                assert key in firsts and seconds == 0, (rank, key)
        if case.model == "tied_lm":  # its two blocks: the second one's regions reuse the first's
            assert any(r[1] is not None for r in compiled), rank
        # and the compiled regions are what runs: no ATen op that computes is left in the step's graph
        assert res[case]["eager_ops_left"] == [], (rank, res[case]["eager_ops_left"])


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(DYNAMO_TWINS), ids=lambda c: c.id)
def test_dynamo_frontend_compiles_the_step_mc_compile_does(results, case: Case):
    """Dynamo's graph, replayed through the trace, gives the same buckets (the model's blocks, found
    from the nodes' module stacks), the same collectives and bytes, and bitwise the same losses."""
    twin = DYNAMO_TWINS[case]
    for rank, res in enumerate(results):
        ours, theirs = res[case], res[twin]
        assert ours["layouts"] == theirs["layouts"] and len(ours["layouts"]) > 1, rank
        assert ours["calls"] == theirs["calls"] and ours["measured"] == theirs["measured"], rank
        if case.codegen == "eager":
            assert ours["losses"] == theirs["losses"], rank
    # the same actions in the same order (the compute labels differ: Dynamo's graph holds the loss,
    # whose nodes belong to no module, "<root>", where mc.compile's trace marks them "<loss>")
    actions = [[line.split()[:2] for line in res["program"].splitlines()] for res in (results[0][case], results[0][twin])]
    assert actions[0] == actions[1]


@pytest.mark.multiproc
def test_eager_plans_compile_no_region(results):
    """The Dynamo cases without codegen="inductor" run the rewritten graph op by op."""
    for case in CASES:
        if case.codegen == "eager":
            assert all(res[case]["codegen"] is None for res in results)


@pytest.mark.multiproc
def test_a_graph_break_is_refused_naming_its_source_line(results):
    for rank, res in enumerate(results):
        msg = res["bad_inputs"]["graph_break"]
        assert "GraphBreakError: graph break at" in msg, (rank, msg)
        assert f"models.py:{BREAK_LINE}" in msg and "h.mean() > 0" in msg, (rank, msg)


@pytest.mark.multiproc
def test_a_callable_that_does_not_return_the_loss_is_refused(results):
    for rank, res in enumerate(results):
        msg = res["bad_inputs"]["not_a_loss"]
        assert "CaptureError" in msg and "must return the scalar loss" in msg and "(4, 5)" in msg, (rank, msg)


@pytest.mark.multiproc
def test_a_recompile_is_refused(results):
    for rank, res in enumerate(results):
        msg = res["recompile"]
        assert "CaptureError" in msg and "compiled this callable a second time" in msg, (rank, msg)


@pytest.mark.multiproc
def test_micro_batches_need_a_graph_dynamic_in_the_batch(results):
    """A graph Dynamo specialized to the call's batch could bake its size in (a loss divided by
    x.shape[0]); replayed per micro-batch it would be silently wrong, so it is refused."""
    for rank, res in enumerate(results):
        msg = res["bad_inputs"]["static_micro_batches"]
        assert "CaptureError" in msg and "dynamic=True" in msg and "batch of 4" in msg, (rank, msg)


@pytest.mark.multiproc
def test_regions_compiled_before_come_from_inductors_cache(results):
    """tied_lm at p=4 s=1 through Dynamo has the regions of the same plan compiled by mc.compile
    earlier in the launch: Inductor's FX graph cache serves every one (no second codegen)."""
    if not torch._inductor.config.fx_graph_cache:
        pytest.skip("Inductor's FX graph cache is disabled here (TORCHINDUCTOR_FX_GRAPH_CACHE=0)")
    case = next(c for c in CASES if c.dynamo and c.codegen == "inductor")
    assert any(c.codegen == "inductor" and not c.dynamo and (c.model, c.p, c.s) == (case.model, case.p, case.s)
               for c in CASES[:CASES.index(case)])
    for rank, res in enumerate(results):
        fresh = [r for r in res[case]["codegen"] if r[0] and r[1] is None]
        assert fresh and all(r[4] for r in fresh), (rank, [r[4] for r in fresh])


class _Scaled(torch.nn.Module):
    """A linear layer with a float attribute (Dynamo lifts it into the graph with dynamic=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)
        self.temperature = 1.5

    def forward(self, x):
        return self.fc(x) * self.temperature


def _first_error(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "NO EXCEPTION"


@pytest.mark.parametrize("batch, refused", [(6, True), (4, False)])
def test_a_batch_symbol_shared_with_another_dimension_is_refused(batch, refused):
    """Duck sizing gives equal sizes one symbol: with 6 sequences of 6 tokens, setting the batch
    symbol to the micro-batch size would change the sequence length too. Refused before any process
    group is needed; with 4 sequences the check passes and compile asks for torch.distributed."""
    torch._dynamo.reset()
    model = TiedLM()
    backend = mc.backend(mc.Plan(micro_batches=2), optimizer=torch.optim.SGD)
    run = torch.compile(lambda x, y: lm_loss(model(x), y), backend=backend, dynamic=True)
    msg = _first_error(run, *MODELS["tied_lm"][2](1, batch)[0])
    if refused:
        assert "CaptureError" in msg and "mark_dynamic" in msg, msg
    else:
        assert "needs torch.distributed initialized" in msg, msg


def test_a_lifted_module_attribute_that_changes_is_refused():
    torch._dynamo.reset()
    model = _Scaled()
    backend = mc.backend(mc.Plan(), optimizer=torch.optim.SGD)
    run = torch.compile(lambda x, y: torch.nn.functional.cross_entropy(model(x), y), backend=backend, dynamic=True)
    x, y = torch.randn(4, 6), torch.randint(3, (4,))
    assert "needs torch.distributed initialized" in _first_error(run, x, y)  # captured; no process group here
    model.temperature = 2.0
    msg = _first_error(run, x, y)
    assert "CaptureError" in msg and "changed from 1.5 to 2.0" in msg, msg


def test_auto_codegen_is_the_cost_models_choice():
    """Plan.codegen="auto" (the default): Inductor only where fusing the elementwise runs is predicted
    >= 5% faster and the time saved over 10,000 steps pays for compiling."""
    from models import meta_lm_trace

    from micscompile.cost_model.specs import Cluster, default_cluster
    from micscompile.runtime.codegen import choose_codegen

    assert mc.Plan().codegen == "auto"
    tg = meta_lm_trace(vocab=256, h=256, layers=4, batch=8, seq=64)
    rp = mc.Plan(partition_size=2, micro_batches=3).resolve(4)
    on_cpu = choose_codegen(tg, rp, default_cluster("cpu", "cpu", 4, 2))
    assert on_cpu.codegen == "eager" and on_cpu.inductor_s <= on_cpu.eager_s  # matmul-bound: fusing saves ~nothing
    slow = dataclasses.replace(Cluster.preset("dgx-h100"), name="slow dispatch")
    slow = dataclasses.replace(slow, gpu=dataclasses.replace(slow.gpu, op_overhead_s=1e-3))
    dispatch_bound = choose_codegen(tg, rp, slow)
    assert dispatch_bound.codegen == "inductor" and dispatch_bound.eager_s > 1.05 * dispatch_bound.inductor_s
    assert str(dispatch_bound).startswith("codegen: inductor (auto: predicted ") and "slow dispatch" in str(dispatch_bound)
    # mixed precision priced in its own dtype: bf16's peak, half the bytes
    bf16_plan = mc.Plan(partition_size=2, micro_batches=3, param_dtype=torch.bfloat16).resolve(4)
    bf16 = choose_codegen(tg, bf16_plan, slow)
    assert bf16.codegen == "inductor" and bf16.eager_s < dispatch_bound.eager_s
    # fp32 matmuls in TF32 (what mc.compile prices where allow_tf32 is on, on CUDA): at the tensor cores' TF32 peak,
    # named in the reason; a 16-bit plan's price unchanged; a GPU without TF32 (V100, a calibrated one) as it was
    tf32 = choose_codegen(tg, rp, slow.with_tf32())
    assert tf32.eager_s < dispatch_bound.eager_s and "slow dispatch (TF32 matmuls)" in tf32.reason
    assert choose_codegen(tg, bf16_plan, slow.with_tf32()).eager_s == bf16.eager_s
    v100 = Cluster.preset("p3dn.24xlarge")
    assert v100.with_tf32() is v100 and v100.gpu.flops("tfloat32") == v100.gpu.flops("float32")
    assert slow.gpu.flops("float32") < slow.with_tf32().gpu.flops("float32") == slow.gpu.flops("tfloat32")
    assert choose_codegen(tg, rp, None).codegen == "eager"


def test_a_step_replayed_in_a_cuda_graph_is_priced_without_its_host_dispatch():
    """Where the step will be captured, each op costs the device's replayed kernel
    (``GpuSpec.graph_op_overhead_s``, what calibrate measures on a GPU), not its dispatch: the fusing that paid
    for itself against 1 ms dispatches does not against 5 us kernels, so "auto" keeps eager."""
    from models import meta_lm_trace

    from micscompile.cost_model.specs import Cluster
    from micscompile.runtime import cuda_graph
    from micscompile.runtime.codegen import choose_codegen

    tg = meta_lm_trace(vocab=256, h=256, layers=4, batch=8, seq=64)
    rp = mc.Plan(partition_size=2, micro_batches=3).resolve(4)
    slow = dataclasses.replace(Cluster.preset("dgx-h100"), name="slow dispatch")
    slow = dataclasses.replace(slow, gpu=dataclasses.replace(slow.gpu, op_overhead_s=1e-3, graph_op_overhead_s=5e-6))
    dispatched, replayed = (choose_codegen(tg, rp, slow, captured=c) for c in (False, True))
    assert (dispatched.codegen, dispatched.captured) == ("inductor", False)
    assert (replayed.codegen, replayed.captured) == ("eager", True)
    assert "each op replayed in a CUDA graph at 5.0 us" in replayed.reason
    as_replayed = dataclasses.replace(slow, gpu=dataclasses.replace(slow.gpu, op_overhead_s=5e-6))
    assert replayed.eager_s == choose_codegen(tg, rp, as_replayed).eager_s < dispatched.eager_s
    assert slow.gpu.replayed().op_overhead_s == 5e-6 and Cluster.preset("dgx-h100").gpu.replayed().op_overhead_s == 5e-6
    # what mc.compile passes: captured as far as the plan and the device tell before lowering
    cuda, one, fine = torch.device("cuda", 0), mc.Plan(partition_size=1).resolve(1), list
    assert cuda_graph.expected("auto", cuda, one, fine) and not cuda_graph.expected(False, cuda, one, fine)
    assert not cuda_graph.expected("auto", cuda, one, lambda: ["the optimizer keeps its step count on the host"])
    assert not cuda_graph.expected("auto", torch.device("cpu"), one, fine)
    assert not cuda_graph.expected("auto", cuda, rp, fine)  # several ranks: "auto" keeps them eager
    pipeline = mc.Plan(partition_size=1, pipeline_stages=2).resolve(2)
    assert not cuda_graph.expected(True, cuda, pipeline, fine)  # (raised where the lowered plan is checked)
