"""The whole step as one CUDA graph (``Plan.cuda_graph``, ``runtime.cuda_graph``). What capture needs,
checked on a CPU: each condition that rules it out is named before any collective, and a step's host
synchronizations (run under ``HostSyncProbe``) are exactly those a blocker names. Capture and replay themselves
run on a GPU (tests/test_cuda_paths.py, ``pytest -m gpu``)."""

from __future__ import annotations

import contextlib
import datetime

import pytest
import torch

import micscompile as mc
from micscompile.cli.parity import TOLERANCE
from micscompile.core import launch
from micscompile.runtime import cuda_graph
from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss

CUDA = torch.device("cuda", 0)


@pytest.fixture
def gloo_rank(one_rank):
    """A one-rank gloo world on this CPU."""
    return launch.init_distributed(timeout=datetime.timedelta(seconds=60))


def _blockers(world: int = 1, **plan) -> list[str]:
    return cuda_graph.static_blockers(CUDA, mc.Plan(**plan).resolve(world, world))


def test_plan_takes_auto_true_or_false():
    assert mc.Plan().cuda_graph == "auto"
    with pytest.raises(mc.PlanError, match="cuda_graph must be 'auto', True or False"):
        mc.Plan(cuda_graph="always")


def test_each_condition_that_rules_capture_out_is_named_with_what_lifts_it():
    """A flat fp32 or bf16 step on CUDA captures; each of the others is one blocker naming its cause."""
    assert _blockers(partition_size=1) == [] and _blockers(partition_size=1, param_dtype=torch.bfloat16) == []
    assert _blockers(world=4, partition_size=2, optimizer_sharding="partition") == []
    cases = {
        "pipeline_stages > 1": _blockers(world=2, partition_size=1, pipeline_stages=2),
        "offload_activations": _blockers(partition_size=1, checkpoint=True, offload_activations=True),
        "optimizer_sharding='partition' captures": _blockers(world=4, partition_size=2, optimizer_sharding="world"),
        "fp16's loss scale": _blockers(partition_size=1, param_dtype=torch.float16),
    }
    for words, blockers in cases.items():
        assert len(blockers) == 1 and words in blockers[0], (words, blockers)
    assert "CUDA graphs need a CUDA device" in cuda_graph.static_blockers(
        torch.device("cpu"), mc.Plan(partition_size=1).resolve(1, 1))[0]


def test_an_optimizer_rules_capture_out_by_a_host_step_count_or_with_clipping_no_device_skip():
    """AdamW's step count on the host (capturable=False) is a blocker unless micscompile chose the fused kernel
    (it then turns capturable on); with max_grad_norm, so is an optimizer that cannot skip a non-finite step on
    the device (torch's fused kernels can: found_inf)."""
    params = [torch.nn.Parameter(torch.ones(3))]
    own = torch.optim.AdamW(params, capturable=False)
    assert "capturable=True" in cuda_graph.optimizer_blockers(own, fused_by_us=False, clipped=False)[0]
    chosen = torch.optim.AdamW(params, fused=True)  # as micscompile's prefer_fused leaves it
    assert cuda_graph.optimizer_blockers(chosen, fused_by_us=True, clipped=True) == []
    assert all(g["capturable"] for g in chosen.param_groups) and cuda_graph.device_skip(chosen)
    probe = cuda_graph.probe_optimizer_blockers  # (what mc.compile checks before any collective)
    assert probe(lambda ps: torch.optim.AdamW(ps), torch.device("cpu"), clipped=True) == []
    assert "capturable=True" in probe(lambda ps: torch.optim.AdamW(ps, foreach=True), torch.device("cpu"), False)[0]
    sgd = torch.optim.SGD(params, lr=0.1)
    assert cuda_graph.optimizer_blockers(sgd, fused_by_us=False, clipped=False) == []
    clipped = cuda_graph.optimizer_blockers(sgd, fused_by_us=False, clipped=True)
    assert len(clipped) == 1 and "host synchronization" in clipped[0] and not cuda_graph.device_skip(sgd)


def test_true_with_a_blocker_is_an_error_auto_says_why_it_is_off():
    """True with a blocker raises; "auto" says why it is off, and keeps a step over several ranks eager (a replayed
    collective is outside NCCL's watchdog), which True captures; a wait that polls from the host is a blocker."""
    with pytest.raises(mc.PlanError, match="cannot capture this step: because"):
        cuda_graph.resolve(True, ["because"])
    off = cuda_graph.resolve("auto", ["because"])
    assert not off.captured and "because" in str(off)
    assert cuda_graph.resolve("auto", []).captured and not cuda_graph.resolve(False, []).captured
    several = cuda_graph.resolve("auto", [], world_size=2)
    assert not several.captured and "watchdog" in several.reason and cuda_graph.resolve(True, [], world_size=2).captured
    plan = mc.Plan(partition_size=2).resolve(2, 2)
    assert cuda_graph.static_blockers(CUDA, plan) == []
    assert "TORCH_NCCL_BLOCKING_WAIT" in cuda_graph.static_blockers(CUDA, plan, blocking_wait=True)[0]


def test_optimizer_state_left_on_the_host_is_found_after_a_step():
    """A replay would not advance a step count kept on the host (a Python number, a CPU tensor next to CUDA
    weights: non-capturable Adam, Adagrad); state on the step's device is fine."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    for opt in (torch.optim.AdamW([p], capturable=False), torch.optim.Adagrad([p])):
        opt.step()
        assert "keeps 'step' on cpu" in cuda_graph.host_state(opt, CUDA), type(opt).__name__
        assert cuda_graph.host_state(opt, torch.device("cpu")) is None
    sgd = torch.optim.SGD([p], lr=0.1)
    sgd.step()
    assert cuda_graph.host_state(sgd, CUDA) is None


@pytest.mark.parametrize("setup", [
    {}, {"max_grad_norm": 1.0}, {"micro_batches": 2}, {"param_dtype": torch.bfloat16}, {"checkpoint": True},
    {"codegen": "inductor"}])
def test_a_step_synchronizes_the_host_exactly_where_a_blocker_says_so(gloo_rank, setup):
    """One step of the zoo's GPT on this CPU under ``HostSyncProbe``: a ``.item()``, ``bool()`` of a tensor or a
    data-dependent shape on the step path shows up, and must be one ``static_blockers`` names (as it would be on
    CUDA). Mutations caught: a ``float(loss_sum)`` added to ``Step._step``; the host-sync blocker removed."""
    setup = dict(setup)
    max_grad_norm = setup.pop("max_grad_norm", None)
    plan = mc.Plan(partition_size=1, **setup)
    cfg = GPTConfig(layers=2, hidden=64, heads=2, seq_len=16, vocab_size=64)
    torch.manual_seed(0)
    batch = lm_batch(cfg, 4, torch.Generator().manual_seed(0))
    step = mc.compile(GPT(cfg), plan, loss_fn=lm_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                      example_inputs=batch, max_grad_norm=max_grad_norm)
    assert not step.cuda_graph_choice.captured and "CUDA device" in step.cuda_graph_choice.reason
    step._device_skip = cuda_graph.device_skip(step.optimizer)  # the step as a capture runs it
    step(*batch)  # (the first step makes the optimizer's state)
    with cuda_graph.HostSyncProbe() as probe:
        step(*batch)
    named = [b for b in (*cuda_graph.static_blockers(CUDA, step.program.plan),
                         *cuda_graph.optimizer_blockers(step.optimizer, False, clipped=max_grad_norm is not None))
             if "host synchronization" in b]
    assert bool(probe.seen) == bool(named), (probe.seen, named)


def test_a_non_finite_step_skipped_on_the_device_is_the_one_skipped_from_the_host(gloo_rank):
    """With max_grad_norm, a step whose gradient is not finite (an inf in the batch) leaves the weights and the
    optimizer's state as they were, on the device (the fused kernel's found_inf, what a captured step runs) as
    from the host; both count it, and the next step trains alike. Mutation caught: found_inf left unset."""
    import copy

    from models import ConvNet, cls_loss, conv_batches

    torch.manual_seed(0)
    model = ConvNet()
    batches = conv_batches(4, 3, seed=0)
    poisoned = (batches[1][0].clone(), batches[1][1])
    poisoned[0][0, 0, 0] = float("inf")
    steps = []
    for on_device in (False, True):
        step = mc.compile(copy.deepcopy(model), mc.Plan(partition_size=1), loss_fn=cls_loss,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), example_inputs=batches[0],
                          max_grad_norm=1.0)
        step._device_skip = on_device and cuda_graph.device_skip(step.optimizer)
        assert step._device_skip == on_device
        with pytest.warns(UserWarning, match="skipped") if not on_device else contextlib.nullcontext():
            for b in (batches[0], poisoned, batches[2]):
                step(*b)
        assert step.skipped_steps == 1 and step.steps == 3
        steps.append(step)
    host, device = (s.full_state_dict() for s in steps)
    for name, value in host.items():
        torch.testing.assert_close(device[name], value, rtol=0, atol=0, msg=name)
    for a, b in zip(*(s.optimizer.state.values() for s in steps), strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=0, msg=key)


def test_true_on_a_cpu_is_refused_before_any_collective(gloo_rank):
    cfg = GPTConfig(layers=1, hidden=32, heads=2, seq_len=8, vocab_size=32)
    batch = lm_batch(cfg, 2, torch.Generator().manual_seed(0))
    with pytest.raises(mc.PlanError, match="cuda_graph=True cannot capture this step: the step runs on cpu"):
        mc.compile(GPT(cfg), mc.Plan(partition_size=1, cuda_graph=True), loss_fn=lm_loss,
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1), example_inputs=batch)


def test_the_llama_style_benchmark_model_trains_as_eager_pytorch(gloo_rank):
    """The CUDA-graph benchmark's model (``zoo.models.Llama``: RMSNorm, rotary positions, grouped-query attention, SwiGLU,
    tied embeddings) at a tiny size: three micscompile steps at p = 1 over two micro-batches give eager PyTorch's
    losses and weights, with SGD and momentum. (Under AdamW they sit 2e-4 apart after three steps: AdamW amplifies
    the RMSNorm weights' gradients, which micscompile's step sums 1.1-2.5e-5 away from a float64 reference where
    eager's reduction is 0.5-1.1e-6 away, both inside fp32's n * eps = 3e-5 for the 256 terms summed.)"""
    import copy

    from micscompile.zoo.models import Llama, LlamaConfig

    cfg = LlamaConfig()
    torch.manual_seed(0)
    model = Llama(cfg)
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    batches = [lm_batch(cfg, 4, gen) for _ in range(3)]
    step = mc.compile(model, mc.Plan(partition_size=1, micro_batches=2), loss_fn=lm_loss,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), example_inputs=batches[0])
    opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    for x, y in batches:
        loss = step(x, y)
        opt.zero_grad()
        expected = 0
        for xb, yb in zip(x.chunk(2), y.chunk(2)):  # accumulated micro-batch by micro-batch, as the step sums
            part = lm_loss(reference(xb), yb) / 2
            part.backward()
            expected = expected + part.detach()
        opt.step()
        torch.testing.assert_close(loss, expected, rtol=TOLERANCE, atol=0)
    state = step.full_state_dict()
    for name, value in reference.state_dict().items():
        err = float((state[name] - value).abs().max() / value.abs().max())
        assert err <= TOLERANCE, (name, err)


def test_a_replay_adds_the_collectives_its_capture_counted(gloo_rank):
    """A replayed step's collectives are not called by the host: ``CommStats.since`` takes what one step added
    (``GraphedStep``'s capture) and ``add`` adds it per replay, so ``comm_stats`` reads as if each step had called
    them, also after a ``reset``."""
    cfg = GPTConfig(layers=1, hidden=32, heads=2, seq_len=8, vocab_size=32)
    batch = lm_batch(cfg, 2, torch.Generator().manual_seed(0))
    step = mc.compile(GPT(cfg), mc.Plan(partition_size=1, micro_batches=2), loss_fn=lm_loss,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), example_inputs=batch)
    stats = step.comm_stats()
    step(*batch)
    before = stats.counts()
    step(*batch)
    one = stats.since(before)
    assert one and all(delta["calls"] > 0 for delta in one.values())
    step(*batch)
    two_steps = {k: {f: v - before[k][f] for f, v in r.items()} for k, r in stats.counts().items()}
    stats.reset()
    stats.add(one)
    stats.add(one)
    assert stats.counts() == two_steps


class _FakeStream:
    def __init__(self, device=None) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


@pytest.mark.parametrize("setting", ["auto", True])
def test_a_capture_that_fails_leaves_the_step_as_before_auto_runs_it_eagerly(gloo_rank, monkeypatch, setting):
    """``GraphedStep``'s control flow on a CPU, torch.cuda's streams and graph faked: the third call's capture fails
    (here after the boundary's collectives were counted, as an op CUDA refuses under capture would fail it). The
    step's bookkeeping is as before the call and no graph is kept; "auto" warns and runs that step and every later one
    eagerly (the losses, weights and counted collectives of an eager twin), True raises from the failure."""
    import copy

    cfg = GPTConfig(layers=1, hidden=32, heads=2, seq_len=8, vocab_size=32)
    gen = torch.Generator().manual_seed(0)
    batches = [lm_batch(cfg, 4, gen) for _ in range(5)]
    torch.manual_seed(0)
    model = GPT(cfg)

    def build(m):
        return mc.compile(m, mc.Plan(partition_size=1, micro_batches=2), loss_fn=lm_loss,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), example_inputs=batches[0])

    eager, step = build(copy.deepcopy(model)), build(model)
    capturing = []

    @contextlib.contextmanager
    def graph(g, stream=None, capture_error_mode="global"):
        capturing.append(capture_error_mode)
        try:
            yield
        finally:
            capturing.pop()

    boundary = step._boundary

    def failing_boundary(loss_sum):
        out = boundary(loss_sum)
        if capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return out

    for name, value in {"Stream": _FakeStream, "current_stream": lambda device=None: _FakeStream(),
                        "stream": lambda s: contextlib.nullcontext(), "CUDAGraph": object, "graph": graph}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(step, "_boundary", failing_boundary)
    step._graphed = cuda_graph.GraphedStep(step, forced=setting is True)
    for b in batches[:2]:  # the warm-up steps, eager on the side stream
        torch.testing.assert_close(step(*b), eager(*b), rtol=0, atol=0)
    calls_before = step.comm_stats().counts()
    if setting is True:
        with pytest.raises(mc.PlanError, match=r"cuda_graph=True: the capture failed \(RuntimeError: operation not "
                                               r"permitted") as info:
            step(*batches[2])
        assert isinstance(info.value.__cause__, RuntimeError)
        assert step._graphed.graph is None and step.steps == 2 and step.comm_stats().counts() == calls_before
        return
    with pytest.warns(UserWarning, match=r"cuda_graph: the capture failed .*; the step runs eagerly from now on"):
        torch.testing.assert_close(step(*batches[2]), eager(*batches[2]), rtol=0, atol=0)
    assert step._graphed.graph is None and step._graphed.captures == 0
    assert "auto, after 3 steps: the capture failed" in step.cuda_graph_choice.reason
    for b in batches[3:]:
        torch.testing.assert_close(step(*b), eager(*b), rtol=0, atol=0)
    assert step.steps == eager.steps == 5 and step.comm_stats().counts() == eager.comm_stats().counts()
    for name, value in eager.full_state_dict().items():
        torch.testing.assert_close(step.full_state_dict()[name], value, rtol=0, atol=0, msg=name)
