"""A training step never makes the host wait for the device. On CPU the test runs
whole steps (flat p in {1, 2} with s = 3, a pipeline, fp16 loss scaling off) under ``HostSyncProbe``
(``runtime.cuda_graph``), which records every scalar read (``.item()``, ``.tolist()``, ``bool(t)``,
``float(t)``), data-dependent shape and copy from a device to the host: none. Clipping needs one (the finite-norm check that skips
a step on every rank, ``Step._scale_grads``): exactly one per step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from harness import launch
from models import TiedLM, lm_batches, lm_loss
from torch.utils._python_dispatch import TorchDispatchMode

import micscompile as mc
from micscompile.runtime.cuda_graph import HostSyncProbe
from micscompile.tune.profile import OpCounter

pytestmark = pytest.mark.multiproc
aten = torch.ops.aten


class ArenaSlices(TorchDispatchMode):
    """Counts the views a step makes of the arena or of a buffer taken from it (slices, and views made
    on its storage)."""

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__()
        self.ptr = storage.untyped_storage().data_ptr()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten.slice.Tensor:
            self.count += args[0].untyped_storage().data_ptr() == self.ptr
        elif func is aten.set_.source_Storage_storage_offset:  # a view made on the storage (flat_view)
            self.count += args[1].data_ptr() == self.ptr
        return func(*args, **(kwargs or {}))


def eager_ops(batch, micro_batches: int) -> int:
    """The ops one eager PyTorch step of the same model dispatches (after a first step): the micro-batches'
    forward and backward, accumulated in ``.grad``, and torch's fused AdamW."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    ops = OpCounter()
    for counted in (False, True):
        with ops if counted else contextlib.nullcontext():
            for x, y in zip(*(t.chunk(micro_batches) for t in batch)):
                (lm_loss(model(x), y) / micro_batches).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return ops.total


PLANS = {
    "p1 s3": (mc.Plan(partition_size=1, micro_batches=3), None),
    "p2 s3": (mc.Plan(partition_size=2, micro_batches=3), None),
    "p2 s3 clipped": (mc.Plan(partition_size=2, micro_batches=3), 1.0),
    "pipeline S2": (mc.Plan(partition_size=1, pipeline_stages=2, micro_batches=3), None),
}


def run(rank: int, world: int) -> dict:
    out = {}
    for name, (plan, clip) in PLANS.items():
        torch.manual_seed(0)
        batches = [tuple(t[rank * 6:(rank + 1) * 6] for t in b) for b in lm_batches(3, 6 * world)]
        step = mc.compile(TiedLM(), plan, loss_fn=lm_loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                          example_inputs=batches[0], max_grad_norm=clip)
        step(*batches[0])  # the first step may set things up
        syncs = HostSyncProbe({id(st["step"]) for st in step.optimizer.state.values() if "step" in st})
        with syncs:
            for b in batches[1:]:
                step(*b)
        out[name] = syncs.seen
        if step._arena is not None:
            with ArenaSlices(step._arena.storage) as slices:
                step(*batches[1])
            out[name + " arena slices"] = (slices.count, len(step._arena.buffers))
        if name == "p1 s3":
            with OpCounter() as ops:
                step(*batches[1])
            out["p1 ops"] = (ops.total, eager_ops(batches[1], 3))
        out[name + " fused"] = step.fused_optimizer and all(g["fused"] for g in step.optimizer.param_groups)
        sd = step.state_dict()  # a checkpoint saved before the fused default, loaded: the step keeps its kernel
        for group in sd["optim"]["param_groups"]:
            group["fused"] = group["foreach"] = None
        step.load_state_dict(sd)
        out[name + " fused after a load"] = all(g["fused"] for g in step.optimizer.param_groups)
    return out


@pytest.fixture(scope="module")
def results():
    return launch(run, 2)


@pytest.mark.parametrize("name", [n for n in PLANS if "clipped" not in n])
def test_a_step_never_waits_for_the_device(results, name):
    for rank, res in enumerate(results):
        assert res[name] == [], (rank, res[name])


def test_clipping_waits_once_per_step_for_the_finite_check(results):
    for rank, res in enumerate(results):
        seen = res["p2 s3 clipped"]
        assert len(seen) == 2 and all("_scale_grads" in s or "isfinite" in s for s in seen), (rank, seen)


def test_a_later_step_makes_no_view_of_its_arena_again(results):
    """Host time on a GPU: the arena's slots sit at the same offsets every step, so ``Arena.take`` makes
    each slot's view once, and ``unpack_param`` each parameter's and gradient's view of an arena slot once (``flat_view``);
    a later step makes no view of the arena or of a buffer taken from it (~200 per micro-step
    before, for bench_peers' GPT: 2.5x the ops eager PyTorch dispatches, docs/gpu.md)."""
    for rank, res in enumerate(results):
        flat = {n: res[n + " arena slices"] for n in PLANS if n + " arena slices" in res}
        assert "p2 s3" in flat and all(taken > 0 for _, taken in flat.values()), (rank, flat)
        assert all(count == 0 for count, _ in flat.values()), (rank, flat)


def test_a_p1_step_dispatches_no_more_ops_than_eager_pytorch(results):
    """On a GPU a small model's step is the host dispatching ops, so at p=1, where there is nothing to
    gather, micscompile's step dispatches at most what eager PyTorch's does for the same model and
    micro-batches: the arena's and the buckets' views kept (above), each bucket's gradients copied and
    accumulated by one foreach op (``pack_grads``, ``accumulate_local``), transposes of transposes
    dropped (``passes.fold_transposes``). bench_peers' GPT at s=4: 4,223 ops per step before, 1,249
    after, eager 1,657, DDP 2,341 (docs/gpu.md); this model: 268 against eager's 344."""
    for rank, res in enumerate(results):
        ours, eager = res["p1 ops"]
        assert 0 < ours <= eager, (rank, ours, eager)


def test_the_optimizer_steps_torchs_fused_kernel_without_waiting(results):
    """The factory above leaves the implementation to torch, so every step's AdamW is the fused kernel
    (``core.optim.prefer_fused``), the steps above that never waited ran it, and loading a checkpoint
    whose groups say otherwise (saved before) leaves the step's kernel as it is."""
    for rank, res in enumerate(results):
        assert all(res[name + " fused"] for name in PLANS), rank
        assert all(res[name + " fused after a load"] for name in PLANS), rank


def test_prefer_fused_only_where_the_user_left_the_choice():
    from micscompile.core.optim import prefer_fused

    def params():
        out = [torch.nn.Parameter(torch.randn(37)), torch.nn.Parameter(torch.zeros(0))]
        for p in out:
            p.grad = torch.randn_like(p)
        return out

    ps = params()
    fused = torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    assert prefer_fused(fused) and all(g["fused"] for g in fused.param_groups)
    ref_ps = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    for p, q in zip(ref_ps, ps):
        p.grad = q.grad.clone()
    ref = torch.optim.AdamW(ref_ps, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        fused.step()
        ref.step()
    torch.testing.assert_close(ps[0].detach(), ref_ps[0].detach(), rtol=1e-6, atol=1e-7)  # the same update
    for chosen in ({"foreach": False}, {"foreach": True}, {"fused": False}):
        assert not prefer_fused(torch.optim.AdamW(params(), lr=1e-2, **chosen))
    assert not prefer_fused(torch.optim.SGD(params(), lr=1e-2))

    class Mine(torch.optim.AdamW):  # a subclass may step otherwise
        pass

    assert not prefer_fused(Mine(params(), lr=1e-2))
    assert not prefer_fused(torch.optim.Adam(params(), lr=1e-2, differentiable=True))
    stepped = torch.optim.AdamW(params(), lr=1e-2)
    stepped.step()  # its step counters already laid out for another kernel
    assert not prefer_fused(stepped)
