"""MiCS-Pipe parity on 4 real gloo ranks (one launch): S * t * d = 4 with 1F1B, interleaved and
GPipe schedules, a tied input/output embedding, buffers, a meta model; bad input refused first."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass

import pytest
import torch
from harness import assert_parity, launch, run_cases
from models import MODELS, TiedLM
from nccl_semantics import nccl_p2p

import micscompile as mc
from micscompile.cli.parity import (
    LOW_PRECISION_TOLERANCE,
    TOLERANCE,
    rel_error,
    state_error,
    train_reference,
    train_reference_mixed,
)
from micscompile.core import collectives as C
from micscompile.core.schedules import ZERO_BUBBLE
from micscompile.cost_model.specs import default_cluster
from micscompile.runtime.materialize import initialize

WORLD, STEPS, LOCAL_BATCH = 4, 5, 12  # divisible by every m below
pytestmark = pytest.mark.multiproc


@dataclass(frozen=True)
class PipeCase:
    stages: int
    t: int
    m: int
    schedule: str = "1f1b"
    v: int = 1
    model: str = "tied_lm"
    opt: str = "sgd"
    meta: bool = False
    checkpoint: bool = False
    param_dtype: torch.dtype = torch.float32
    """Mixed precision (fp32 reduction): compared with ``train_reference_mixed``."""
    codegen: str = "eager"

    @property
    def id(self) -> str:
        meta = ("-meta" if self.meta else "") + ("-ckpt" if self.checkpoint else "")
        meta += "" if self.param_dtype == torch.float32 else f"-{str(self.param_dtype)[6:]}"
        meta += "-inductor" if self.codegen == "inductor" else ""
        return (f"{self.model}-S{self.stages}-t{self.t}-d{WORLD // (self.stages * self.t)}-{self.schedule}"
                f"-v{self.v}-m{self.m}-{self.opt}{meta}")


CASES = [
    PipeCase(2, 2, 2), PipeCase(2, 2, 2, "interleaved", 2),
    PipeCase(4, 1, 4), PipeCase(4, 1, 4, "interleaved", 2, opt="adamw"),
    PipeCase(2, 1, 4), PipeCase(2, 1, 4, "interleaved", 2),
    PipeCase(2, 2, 4, "gpipe"),
    PipeCase(2, 2, 3, model="convnet", opt="adamw"),  # buffers; m not a multiple of S
    PipeCase(2, 2, 2, meta=True),
    # a rank holds two chunks that are not contiguous in the model: each module still initialised once
    PipeCase(2, 1, 4, "interleaved", 2, opt="adamw", meta=True),
    PipeCase(2, 2, 4, checkpoint=True), PipeCase(2, 1, 4, "interleaved", 2, checkpoint=True),
    PipeCase(2, 2, 2, param_dtype=torch.bfloat16), PipeCase(2, 1, 4, "interleaved", 2, param_dtype=torch.bfloat16),
    PipeCase(2, 2, 3, model="convnet", param_dtype=torch.float16),
    # Inductor-compiled regions in every chunk's forward and backward (4 chunks: 2 per rank)
    PipeCase(2, 1, 4, "interleaved", 2, codegen="inductor"),
    # zero-bubble: each backward split into B and W (passes.weight_split), W deferred into the bubbles
    PipeCase(2, 2, 4, "zb-h1"), PipeCase(4, 1, 4, "zb-h1", opt="adamw"),
    PipeCase(2, 1, 4, "zb-h1", checkpoint=True, param_dtype=torch.bfloat16),
    PipeCase(2, 1, 4, "interleaved-zb", 2), PipeCase(2, 1, 4, "zb-v", 2),
]


def _model(case: PipeCase):
    if case.model == "tied_lm":
        return TiedLM(layers=6)
    return MODELS[case.model][0]()


def run_case(case: PipeCase, rank: int, world: int) -> dict:
    _, make_loss, make_batches = MODELS[case.model]
    torch.manual_seed(0)
    model = _model(case)
    if case.meta:
        torch.manual_seed(1)
        initialize(model)
    chains = world // case.stages
    batches = make_batches(STEPS, LOCAL_BATCH * chains)
    opt = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)) if case.opt == "sgd" else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    if case.param_dtype != torch.float32:  # every chain's micro-batch a slice computed in param_dtype
        ref_losses, ref_state = train_reference_mixed(copy.deepcopy(model), make_loss, opt, batches,
                                                      chains * case.m, case.param_dtype)
    else:
        ref_losses, ref_state = train_reference(copy.deepcopy(model), make_loss(model), opt, batches, copy_model=False)
    if case.meta:
        with torch.device("meta"):
            model = _model(case)
        torch.manual_seed(1)
    plan = mc.Plan(partition_size=case.t, pipeline_stages=case.stages, pipeline_schedule=case.schedule,
                   pipeline_chunks=case.v, micro_batches=case.m, checkpoint=case.checkpoint,
                   param_dtype=case.param_dtype, codegen=case.codegen)
    rp = plan.resolve(world, world)
    chain = rank // (case.stages * case.t) * case.t + rank % case.t  # the ranks of one chain share a batch
    local = [tuple(x[chain * LOCAL_BATCH : (chain + 1) * LOCAL_BATCH] for x in b) for b in batches]
    step = mc.compile(model, plan, loss_fn=make_loss(model), optimizer=opt, example_inputs=local[0])
    losses = [float(step(*b)) for b in local[:-1]]
    step.track_memory = True
    with _second_hops_logged(step) as hops:
        losses.append(float(step(*local[-1])))
    memory = step.memory_stats()
    stats = step.comm_stats()
    return {
        "losses": losses, "ref_losses": ref_losses,
        "loss_err": max(rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)),
        "state_err": state_error(_full_state_dict(step), ref_state),
        "stage": rp.stage_of(rank),
        "chunks": step.program.my_chunks(),
        "memory": (memory.arena_bytes, memory.arena_buffers, memory.outside_planned_peak_bytes,
                   memory.outside_measured_peak_bytes),
        "calls": {k: r.calls for k, r in stats.rows.items()},
        "sent": (stats[("send", "pipe")].bytes, step.program.comm_stats()[("send", "pipe")].bytes * STEPS),
        "hops": hops,
        "program": str(step.program) if rank == 0 else "",
        "codegen": step.codegen and [(r.graph_name, r.compiled, r.reused_from) for r in step.codegen.regions],
    }


@contextlib.contextmanager
def _second_hops_logged(step):
    """Log, for each second hop the step starts (an all-reduce or reduce-scatter over the replicas),
    the chunk whose backward was running and how many of that chunk's backwards had started (its W's, for a
    zero-bubble schedule: W accumulates the gradients)."""
    log, running, started = [], [None], {}

    def logged(inner, c, phase):
        def run(args):
            running[0], started[c, phase] = (c, phase), started.get((c, phase), 0) + 1
            try:
                return inner(args)
            finally:
                running[0] = None
        return run

    for ch in step._chunks.values():
        weight = ch.phases.weight and logged(ch.phases.weight, ch.index, "W")
        ch.phases = dataclasses.replace(ch.phases, backward=logged(ch.phases.backward, ch.index, "B"), weight=weight)
    real = {name: getattr(C, name) for name in ("all_reduce_start", "reduce_scatter_start")}

    def logged(fn):
        def start(*args, what=None, **kwargs):
            if what and "second-hop" in what:
                log.append((running[0] and running[0][0], started.get(running[0]), running[0] and running[0][1]))
            return fn(*args, what=what, **kwargs)
        return start
    for name, fn in real.items():
        setattr(C, name, logged(fn))
    try:
        yield log
    finally:
        for name, fn in real.items():
            setattr(C, name, fn)


def _full_state_dict(step) -> dict:
    """``step.full_state_dict()``, checking that no tensor travels as a pickled object (which would
    stage every rank's payload on every GPU)."""
    real = torch.distributed.all_gather_object

    def gather_object(out, obj, group=None):
        assert not any(isinstance(v, torch.Tensor) for v in torch.utils._pytree.tree_leaves(obj)), "tensors as objects"
        return real(out, obj, group=group)

    torch.distributed.all_gather_object = gather_object
    try:
        return step.full_state_dict()
    finally:
        torch.distributed.all_gather_object = real


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    _, make_loss, make_batches = MODELS["tied_lm"]
    torch.manual_seed(0)
    model = TiedLM(layers=1)  # 4 blocks
    x, y = make_batches(1, LOCAL_BATCH)[0]
    out = {}
    for key, fields in {"too_many_chunks": dict(pipeline_stages=4, micro_batches=4),
                        "interleaved_m": dict(pipeline_stages=2, micro_batches=3)}.items():
        try:  # (the Plan itself refuses what it can check without the model: under a process group, at once)
            plan = mc.Plan(partition_size=1, pipeline_chunks=2, pipeline_schedule="interleaved", **fields)
            mc.compile(model, plan, loss_fn=make_loss(model), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                       example_inputs=(torch.cat([x] * plan.micro_batches), torch.cat([y] * plan.micro_batches)))
            out[key] = "NO EXCEPTION"
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def flat_plan_first(rank: int, world: int) -> dict[str, str]:
    """Bad input, then a flat plan whose partition groups span (simulated) nodes, compiled in the same
    process as the pipelines: its (d, p/k, k) mesh must not stand in for a (d, S, t) one."""
    out = bad_inputs(rank, world)
    _, make_loss, make_batches = MODELS["tied_lm"]
    torch.manual_seed(0)
    model = TiedLM(layers=1)
    mc.compile(model, mc.Plan(partition_size=2), loss_fn=make_loss(model), cluster=default_cluster("cpu", "cpu", world, 1),
               optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), example_inputs=make_batches(1, LOCAL_BATCH)[0])
    return out


def run_all(rank: int, world: int) -> dict:
    return run_cases(rank, world, flat_plan_first, run_case, CASES)


def run_all_nccl(rank: int, world: int) -> dict:
    with nccl_p2p():
        return {case: run_case(case, rank, world) for case in CASES}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(run_all, WORLD, timeout_s=300)


@pytest.fixture(scope="module")
def nccl_results() -> list[dict]:
    return launch(run_all_nccl, WORLD, timeout_s=300)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pipeline_parity_with_single_process_eager(results, case: PipeCase):
    """Mixed precision: the tied embedding's two gradients are summed in fp32 across stages, where
    the reference's autograd sums them in bf16 (LOW_PRECISION_TOLERANCE)."""
    tied_mixed = case.param_dtype != torch.float32 and case.model == "tied_lm"
    assert_parity(results, case, LOW_PRECISION_TOLERANCE if tied_mixed else TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_pipeline_parity_under_nccl_p2p_semantics(nccl_results, case: PipeCase):
    """As on CUDA (tests/nccl_semantics.py): one Work per batch_isend_irecv, received data only after
    it is waited for (NaN before), send buffers read until then. The same parity as on plain gloo."""
    tied_mixed = case.param_dtype != torch.float32 and case.model == "tied_lm"
    assert_parity(nccl_results, case, LOW_PRECISION_TOLERANCE if tied_mixed else TOLERANCE)


@pytest.mark.parametrize("case", [c for c in CASES if c.codegen == "eager"], ids=lambda c: c.id)
def test_pipeline_ops_allocate_outside_the_arena_what_the_lifetimes_plan(results, case: PipeCase):
    """Receive buffers, the chunks' collective buffers and the ops' ``out=`` results come from the
    arena; what the other ops allocate (counted over a real step) peaks at most at the lifetimes'
    count (less when a sent activation is freed as its send completes, before the step ends).
    (Inductor's kernels allocate below the dispatcher, where the count cannot see them.)"""
    for rank, res in enumerate(results):
        arena_bytes, n_buffers, planned, measured = res[case]["memory"]
        assert arena_bytes > 0 and n_buffers > 0, (rank, res[case]["memory"])
        assert 0 < measured <= 1.01 * planned + 1024, (rank, measured, planned)


@pytest.mark.parametrize("case", [c for c in CASES if c.model == "tied_lm"], ids=lambda c: c.id)
def test_tied_embedding_gradient_is_all_reduced_between_its_stages(results, case: PipeCase):
    """The embedding (chunk 0) and the LM head (the last chunk) hold one parameter: their partial
    gradients meet in one all-reduce per step between the two ranks, unless both chunks are on one (ZB-V's first
    rank holds chunks 0 and 2S-1: summed there, no all-reduce)."""
    last = case.stages * case.v - 1
    for res in results:
        r = res[case]
        holds = {0, last} & set(r["chunks"])
        assert r["calls"].get(("all_reduce", "tied"), 0) == (STEPS if len(holds) == 1 else 0), (r["chunks"], r["calls"])
    if case.schedule == "zb-v":
        assert {0, last} <= set(results[0][case]["chunks"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_comm_stats_count_the_pipeline_sends_the_plan_predicts(results, case: PipeCase):
    """``step.comm_stats()`` counts each rank's point-to-point sends (activations forward, gradients
    back), byte for byte what the lowered plan's ``comm_stats()`` predicts for its steps, and every
    rank sends something (the first stage activations, the last gradients, a middle one both)."""
    sent = [res[case]["sent"] for res in results]
    assert all(measured == planned for measured, planned in sent), sent
    assert all(measured > 0 for measured, _ in sent), sent


@pytest.mark.parametrize("case", [c for c in CASES if WORLD > c.stages * c.t], ids=lambda c: c.id)
def test_each_chunk_starts_its_second_hops_in_its_last_backward(results, case: PipeCase):
    """2-hop over d > 1 replicas: every chunk a rank holds starts its buckets' all-reduces over the
    replicas (the second hop) inside its own last backward (its last W where the backward is split: the
    gradients are W's), under the rest of the schedule, never in an earlier backward nor at the boundary."""
    phase = "W" if case.schedule in ZERO_BUBBLE else "B"
    for rank, res in enumerate(results):
        hops = res[case]["hops"]
        assert hops and {c for c, _, _ in hops} == set(res[case]["chunks"]), (rank, hops)
        assert all(n == case.m and p == phase for _, n, p in hops), (rank, hops)


def test_bad_pipeline_plans_are_refused_on_every_rank(results):
    for res in results:
        bad = res["bad_inputs"]
        assert bad["too_many_chunks"].startswith("PlanError: cannot cut the model into 8 pipeline chunks"), bad
        assert "use at most 4" in bad["too_many_chunks"], bad
        assert "micro_batches to be a multiple of stages=2" in bad["interleaved_m"], bad


def test_program_prints_the_split_schedule_and_grid(results):
    text = results[0][CASES[1]]["program"]
    assert "chunk 0: emb" in text and "tied parameters" in text
    assert "pipeline interleaved stages=2 chunks=2 micro_batches=2" in text
    assert "step 0" in text and "r1 " in text


@pytest.mark.parametrize("case", [c for c in CASES if c.codegen == "inductor"], ids=lambda c: c.id)
def test_inductor_compiles_every_chunk_and_reuses_regions_across_chunks(results, case: PipeCase):
    for rank, res in enumerate(results):
        regions = res[case]["codegen"]
        graphs = {name for name, compiled, _ in regions if compiled}
        assert graphs == {f"chunk {c} {phase}" for c in res[case]["chunks"] for phase in ("forward", "backward")}, \
            (rank, graphs)
        assert any(reused is not None for _, _, reused in regions), rank
