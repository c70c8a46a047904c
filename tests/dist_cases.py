"""Cases run inside ONE multi-process gloo launch (see test_multiproc.py).

Each rank trains every case's compiled step for STEPS steps on its slice of the
global batch, trains the single-process eager reference on the whole global batch,
and reports: losses, its own shards' parity error, the full state's parity error,
measured and predicted communication. Bad-input cases run first: each must raise
before any collective, which the cases after them prove (a stray collective would
desynchronise every later one).
"""

from __future__ import annotations

import copy
import dataclasses
import traceback
from dataclasses import dataclass

import torch
from harness import run_cases
from models import MODELS

import micscompile as mc
from micscompile.cli.parity import rel_error, state_error, train_reference, train_reference_mixed
from micscompile.core.sharding import shard_of
from micscompile.cost_model.node_cost import _is_view
from micscompile.cost_model.specs import default_cluster
from micscompile.runtime.materialize import initialize

STEPS = 5
LOCAL_BATCH = 12  # divisible by micro_batches in {1, 3, 4}


@dataclass(frozen=True)
class Case:
    model: str
    p: int
    s: int
    opt: str = "sgd"
    grad_sync: str = "2hop"
    meta: bool = False
    """Build the model on the meta device; compile initialises it with init_fn (seed 1)."""
    reinit: bool = False
    """Build it for real, then apply the same init_fn under the same seed (the meta twin)."""
    k: int | None = None
    """gpus_per_node; None = all 4 ranks on one node."""
    prefetch: mc.Prefetch | None = None
    """Force this Prefetch (None: the schedule's default)."""
    hierarchical: bool | str = "auto"
    arena: bool = True
    """Collectives' buffers in the planned arena (False: allocated per use)."""
    checkpoint: bool | str = False
    checkpoint_every: int = 1
    offload: bool = False
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    """Mixed precision: compared with ``train_reference_mixed`` instead of fp32 eager."""
    codegen: str = "eager"
    """Plan.codegen: "inductor" compiles the compute between communication points."""
    dynamo: bool = False
    """Through the Dynamo frontend: torch.compile(loss, backend=mc.backend(plan, ...))."""

    @property
    def mixed(self) -> bool:
        return self.param_dtype != torch.float32 or self.reduce_dtype != torch.float32

    @property
    def id(self) -> str:
        extra = ("-every_step" if self.grad_sync == "every_step" else "") + ("-meta" if self.meta else "")
        extra += ("-reinit" if self.reinit else "") + (f"-k{self.k}" if self.k else "")
        extra += {True: "-hier", False: "-flat"}.get(self.hierarchical, "") + ("" if self.arena else "-noarena")
        if self.checkpoint:
            extra += f"-ckpt{'sel' if self.checkpoint == 'selective' else ''}{self.checkpoint_every}"
            extra += "-offload" if self.offload else ""
        if self.mixed:
            extra += f"-{str(self.param_dtype)[6:]}-reduce_{str(self.reduce_dtype)[6:]}"
        if self.prefetch is not None:
            pf = self.prefetch
            extra += f"-prefetch{pf.distance}" + (f"-keep{pf.keep_live}" if pf.keep_live else "")
            extra += "-across" if pf.across_micro_steps else ""
        extra += ("-inductor" if self.codegen == "inductor" else "") + ("-dynamo" if self.dynamo else "")
        return f"{self.model}-p{self.p}-s{self.s}-{self.opt}{extra}"


def optimizer(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-3)


def run_case(case: Case, rank: int, world: int) -> dict:
    cls, make_loss, make_batches = MODELS[case.model]
    torch.manual_seed(0)
    model = cls()
    if case.meta or case.reinit:
        torch.manual_seed(1)
        initialize(model)
    batches = make_batches(STEPS, LOCAL_BATCH * world)
    opt = optimizer(case.opt)
    ref = copy.deepcopy(model)
    if case.mixed:  # fp32 masters, each rank's micro-batch a slice computed in param_dtype (by Inductor, as the
        # plan's compute is: its fused kernels round once where eager rounds each op's output to 16 bits)
        ref_losses, ref_state = train_reference_mixed(ref, make_loss, opt, batches, world * case.s, case.param_dtype,
                                                      compiled=case.codegen == "inductor")
    else:
        ref_losses, ref_state = train_reference(ref, make_loss(ref), opt, batches, copy_model=False)

    if case.meta:
        with torch.device("meta"):
            model = cls()
        torch.manual_seed(1)
    loss_fn = make_loss(model)
    plan = mc.Plan(partition_size=case.p, micro_batches=case.s, grad_sync=case.grad_sync,
                   hierarchical=case.hierarchical, checkpoint=case.checkpoint, checkpoint_every=case.checkpoint_every,
                   offload_activations=case.offload, param_dtype=case.param_dtype, reduce_dtype=case.reduce_dtype,
                   codegen=case.codegen)
    local = [tuple(x[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for x in b) for b in batches]
    cluster = None if case.k is None else default_cluster("cpu", "cpu", world, case.k)  # (simulated nodes of k)
    prefetch = None if case.prefetch is None else (case.prefetch,)
    if case.dynamo:  # the step is built at the first call of the compiled loss
        torch._dynamo.reset()  # this code object was compiled for other models and shapes before
        backend = mc.backend(plan, optimizer=opt, prefetch=prefetch, arena=case.arena, cluster=cluster)
        # dynamic=True: the step replays the graph per micro-batch (a static one is refused, test_codegen)
        run = torch.compile(lambda x, y: loss_fn(model(x), y), backend=backend, dynamic=case.s > 1)
        losses = [float(run(*local[0]))]
        step = backend.step
    else:
        run = step = mc.compile(model, plan, loss_fn=loss_fn, optimizer=opt, example_inputs=local[0],
                                prefetch=prefetch, arena=case.arena, cluster=cluster)
        losses = []
    losses += [float(run(*b)) for b in local[len(losses):-1]]
    step.track_memory = True  # the last step counts what ops allocate outside the arena
    losses.append(float(run(*local[-1])))
    memory = step.memory_stats()

    shard_rank = rank % case.p
    own = step.local_shards()
    own_err = max(
        rel_error(own[slot.name], shard_of(ref_state[slot.name], lay, slot, shard_rank))
        for lay in step.layouts for slot in lay.slots
    )
    state = step.full_state_dict()
    stats = step.comm_stats()
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_err": max(rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)),
        "own_shard_err": own_err,
        "state_err": state_error(state, ref_state),
        "state": state if case in KEEP_STATE else None,
        "memory": (memory.arena_bytes, memory.arena_buffers, memory.outside_planned_peak_bytes,
                   memory.outside_measured_peak_bytes),
        "measured": {k: r.bytes for k, r in stats.rows.items()},
        "calls": {k: r.calls for k, r in stats.rows.items()},
        "inter_node": {k: r.inter_node_bytes for k, r in stats.rows.items()},
        "intra_node": {k: r.intra_node_bytes for k, r in stats.rows.items()},
        "peak_gathered": (stats.peak_gathered_bytes, step.program.peak_gathered_bytes),
        "calls_per_step": (sum(r.calls for r in stats.rows.values()), STEPS * len(step.program.collective_order())),
        "predicted": {k: STEPS * v for k, v in step.program.wire_bytes().items()},
        "layouts": [(lay.row_numel, lay.numel, len(lay.slots)) for lay in step.layouts],
        "program": str(step.program) if rank == 0 else "",
        "keep_live": step.program.prefetch.keep_live if step.program.prefetch else 0,
        "eager_ops_left": [n.name for n in step.gm.graph.nodes if n.op == "call_function"
                           and isinstance(n.target, torch._ops.OpOverload) and not _is_view(n)],
        "codegen": None if step.codegen is None else [
            (r.compiled, r.reused_from, r.key, r.compile_s, r.cache_hit) for r in step.codegen.regions],
    }


PARITY = [
    Case(model, p, s, opt)
    for model in ("tied_lm", "convnet")
    for p in (1, 2, 4)
    for s in (1, 3, 4)
    for opt in ("sgd", "adamw")
]
EXTRA = [
    Case("tied_lm", 2, 3, "sgd", grad_sync="every_step"),
    Case("convnet", 4, 4, "adamw", grad_sync="every_step"),
    Case("convnet", 1, 3, "sgd", grad_sync="every_step"),
    Case("tied_lm", 2, 3, "sgd", meta=True),
    Case("tied_lm", 4, 1, "adamw", meta=True),
    Case("convnet", 2, 4, "sgd", meta=True),
    # a parameter only the loss reads, an unused one (AdamW's weight decay must not touch it), in-place ops
    *(Case("quirky", p, s, opt) for p in (1, 2) for s in (1, 3) for opt in ("sgd", "adamw")),
    Case("convnet", 4, 2, "sgd", k=2),  # the partition group spans both (simulated) nodes
    Case("convnet", 2, 2, "sgd", k=2),  # partition groups inside a node, replication across
    # the schedule's other choices: gathered at the use, two and three intervals ahead, the first
    # gathers issued by the previous micro-step, buckets kept live from forward into backward
    Case("tied_lm", 2, 3, "adamw", prefetch=mc.Prefetch(distance=0)),
    Case("tied_lm", 4, 2, "sgd", prefetch=mc.Prefetch(distance=3)),
    Case("convnet", 2, 3, "sgd", prefetch=mc.Prefetch(distance=2)),
    Case("tied_lm", 2, 3, "adamw", prefetch=mc.Prefetch(distance=2, across_micro_steps=True)),
    Case("convnet", 4, 4, "sgd", prefetch=mc.Prefetch(distance=1, keep_live=2, across_micro_steps=True)),
    Case("tied_lm", 4, 3, "adamw", prefetch=mc.Prefetch(distance=2, keep_live=1)),
    # hierarchical gathers and reduce-scatters: the partition group spans both (simulated) nodes
    Case("tied_lm", 4, 3, "adamw", k=2, hierarchical=True),
    Case("convnet", 4, 2, "sgd", k=2, hierarchical=True, prefetch=mc.Prefetch(distance=2, keep_live=1, across_micro_steps=True)),
]
# the real-model runs that the meta runs are compared against, value for value
REAL_TWINS = [dataclasses.replace(c, meta=False, reinit=True) for c in EXTRA if c.meta]
# the hierarchical runs, gathered flat
FLAT_TWINS = [dataclasses.replace(c, hierarchical=False) for c in EXTRA if c.hierarchical is True]
# collectives' buffers allocated per use instead of in the planned arena: the same numbers, bit for bit
ARENA_OFF = [dataclasses.replace(c, arena=False) for c in (
    EXTRA[-1], EXTRA[-2], EXTRA[-5], Case("tied_lm", 1, 3, "sgd"), Case("convnet", 2, 4, "adamw"))]
ARENA_PAIRS = {c: dataclasses.replace(c, arena=True) for c in ARENA_OFF}
ARENA_PAIRS.update({v: k for k, v in ARENA_PAIRS.items()})
# activation checkpointing: bitwise the numbers of the same plan without it
CKPT = [
    Case("tied_lm", 2, 3, "sgd", checkpoint=True), Case("convnet", 4, 4, "adamw", checkpoint=True),
    Case("tied_lm", 2, 3, "sgd", checkpoint="selective"), Case("tied_lm", 4, 4, "adamw", checkpoint=True,
                                                                   checkpoint_every=2),
    # and the checkpointed segment outputs offloaded to host memory between forward and backward
    Case("tied_lm", 2, 3, "sgd", checkpoint=True, offload=True), Case("convnet", 4, 4, "adamw", checkpoint=True, offload=True),
]
CKPT_TWINS = {c: dataclasses.replace(c, checkpoint=False, checkpoint_every=1, offload=False) for c in CKPT}
# mixed precision: gathers and compute in bf16 / fp16, fp32 masters, reduction in fp32 or low precision
BF16, FP16 = torch.bfloat16, torch.float16
MIXED = [
    Case("tied_lm", 2, 3, "sgd", param_dtype=BF16), Case("convnet", 4, 4, "adamw", param_dtype=BF16),
    Case("convnet", 1, 3, "sgd", param_dtype=BF16),  # p = 1: the cast without a gather
    Case("tied_lm", 4, 1, "sgd", param_dtype=BF16, reduce_dtype=BF16),
    Case("convnet", 4, 4, "sgd", param_dtype=FP16, reduce_dtype=FP16),
    Case("tied_lm", 4, 3, "adamw", k=2, hierarchical=True, param_dtype=BF16),
    Case("convnet", 2, 2, "sgd", k=2, param_dtype=BF16, reduce_dtype=BF16),  # low-precision boundary all-reduce
    Case("tied_lm", 2, 3, "sgd", checkpoint=True, offload=True, param_dtype=BF16),
]
MIXED_TWINS = {c: dataclasses.replace(c, param_dtype=torch.float32, reduce_dtype=torch.float32) for c in MIXED}
CASES = PARITY + EXTRA + REAL_TWINS + FLAT_TWINS + ARENA_OFF + CKPT + MIXED
KEEP_STATE = {c for c in EXTRA if c.meta}.union(
    REAL_TWINS, ARENA_PAIRS, CKPT_TWINS, CKPT_TWINS.values(), MIXED_TWINS, MIXED_TWINS.values())
"""The cases whose full state is compared value for value with a twin's."""


def _expect_error(kind, fn) -> str:
    try:
        fn()
    except kind as exc:
        return str(exc)
    except BaseException as exc:  # noqa: BLE001
        return f"WRONG EXCEPTION {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return "NO EXCEPTION"


class DataDependent(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 5)

    def forward(self, x):
        y = self.fc(x.flatten(1)[:, :3])
        if y.sum() > 0:  # data-dependent control flow
            y = -y
        return y


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Each bad input must raise its documented error before any collective."""
    cls, make_loss, make_batches = MODELS["convnet"]
    torch.manual_seed(0)  # every rank the same weights
    model = cls()
    loss_fn = make_loss(model)
    x, y = make_batches(1, LOCAL_BATCH)[0]
    opt = optimizer("sgd")
    out = {}
    out["partition_size"] = _expect_error(mc.PlanError, lambda: mc.Plan(partition_size=3))
    out["micro_batches"] = _expect_error(
        ValueError, lambda: mc.compile(model, mc.Plan(partition_size=2, micro_batches=5), loss_fn=loss_fn,
                                       optimizer=opt, example_inputs=(x, y)))
    out["untraceable"] = _expect_error(
        mc.TraceError, lambda: mc.compile(DataDependent(), mc.Plan(partition_size=2), loss_fn=loss_fn,
                                          optimizer=opt, example_inputs=(x, y)))
    out["budget"] = _expect_error(
        mc.PlanError, lambda: mc.compile(model, mc.Plan(partition_size=2, memory_budget_bytes=64), loss_fn=loss_fn,
                                         optimizer=opt, example_inputs=(x, y)))
    out["world"] = _expect_error(
        mc.PlanError, lambda: mc.compile(model, mc.Plan(partition_size=8), loss_fn=loss_fn, optimizer=opt,
                                         example_inputs=(x, y)))
    out["optimizer"] = _expect_error(
        mc.PlanError, lambda: mc.compile(model, mc.Plan(partition_size=2), loss_fn=loss_fn,
                                         optimizer=lambda ps: torch.optim.Adafactor(ps), example_inputs=(x, y)))
    # ranks that disagree: rank 1 asks for another micro-batch count; every rank must refuse
    s = 2 if rank == 1 else 1
    out["disagree"] = _expect_error(
        RuntimeError, lambda: mc.compile(model, mc.Plan(partition_size=2, micro_batches=s), loss_fn=loss_fn,
                                         optimizer=opt, example_inputs=(x, y)))
    # same Plan and trace, but rank 1 schedules its gathers differently: a different collective order
    prefetch = [mc.Prefetch(distance=0)] if rank == 1 else None
    out["disagree_order"] = _expect_error(
        RuntimeError, lambda: mc.compile(model, mc.Plan(partition_size=2), loss_fn=loss_fn, optimizer=opt,
                                         example_inputs=(x, y), prefetch=prefetch))
    # one rank alone gets bad input: it raises its error, every other rank names it (nobody hangs)
    bad_x, bad_y = (x[:10], y[:10]) if rank == 2 else (x, y)
    out["one_rank"] = _expect_error(
        (ValueError, RuntimeError), lambda: mc.compile(model, mc.Plan(partition_size=2, micro_batches=4),
                                                       loss_fn=loss_fn, optimizer=opt, example_inputs=(bad_x, bad_y)))
    # ranks seeded differently start from different weights
    torch.manual_seed(rank)
    out["weights"] = _expect_error(
        RuntimeError, lambda: mc.compile(cls(), mc.Plan(partition_size=2), loss_fn=loss_fn, optimizer=opt,
                                         example_inputs=(x, y)))
    out["fp16"] = _expect_error(
        mc.PlanError, lambda: mc.compile(copy.deepcopy(model).half(), mc.Plan(partition_size=2), loss_fn=loss_fn,
                                         optimizer=opt, example_inputs=(x, y)))
    step = mc.compile(model, mc.Plan(partition_size=2), loss_fn=loss_fn, optimizer=opt, example_inputs=(x, y))
    out["batch_shape"] = _expect_error(ValueError, lambda: step(x[:5], y[:5]))
    out["batch_count"] = _expect_error(ValueError, lambda: step(x))
    out["calls_after_errors"] = str(sum(r.calls for r in step.comm_stats().rows.values()))
    return out


def run_all(rank: int, world: int) -> dict:
    return run_cases(rank, world, bad_inputs, run_case, CASES)
