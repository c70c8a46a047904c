"""The CUDA/NCCL paths, checked on the CPU: which device host-scalar collectives use,
device syncs at the ends of every timed window, what calibration records for a GPU, and how a
rank picks its GPU and starts its process group. CUDA and c10d entry points are monkeypatched;
docs/gpu.md lists the checks that need a GPU."""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import math
import statistics
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from models import meta_lm_trace

from micscompile.cli import command as cli
from micscompile.cli import demo
from micscompile.core import launch
from micscompile.core.launch import collective_device
from micscompile.cost_model import calibrate
from micscompile.cost_model.specs import Link, default_cluster
from micscompile.runtime import compile as runtime
from micscompile.tune import profile

autotune = importlib.import_module("micscompile.tune.autotune")  # the module: the package exports a function of that name
CUDA0, META = torch.device("cuda", 0), torch.device("meta")


def _timing_module():
    """benchmarks/timing.py (the benchmarks import it as a script-side module)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "timing.py"
    spec = importlib.util.spec_from_file_location("bench_timing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- finding 4: host-scalar collectives on the device the group's backend serves ----------------

@pytest.mark.parametrize("backend, expected", [
    ("nccl", torch.device("cuda", 3)), ("cuda:nccl", torch.device("cuda", 3)),
    ("gloo", torch.device("cpu")), ("cpu:gloo,cuda:nccl", torch.device("cpu")),
])
def test_collective_device_is_the_gpu_only_where_the_backend_serves_no_cpu(monkeypatch, backend, expected):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend(backend))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collective_device() == expected


class Routed(Exception):
    """Raised by the fake all_reduce once it has seen the tensor's device."""


@pytest.fixture(scope="module")
def tiny_trace():
    return meta_lm_trace(vocab=16, h=8, layers=1, batch=2, seq=4)


def _measure_top_one_candidate():
    plan = types.SimpleNamespace(micro_batches=1)
    cand = types.SimpleNamespace(feasible=True, micro_batch_size=1, plan=plan, prefetch=None)
    autotune.measure_top([cand], model=None, loss_fn=None, make_batch=lambda n: (), top_k=1, steps=1, warmup=0)


SITES = {
    "calibrate.slowest_rank_times": lambda trace: calibrate.slowest_rank_times([0.1, 0.2]),
    "calibrate.mean_rank_median": lambda trace: calibrate.mean_rank_median([0.1, 0.2]),
    "calibrate._inner_count": lambda trace: calibrate._inner_count(lambda: None, torch.device("cpu")),
    "profile.profile_trace count": lambda trace: profile.profile_trace(trace, "cpu", repeats=1),
    "autotune.measure_top elapsed": lambda trace: _measure_top_one_candidate(),
    "benchmarks/timing.median_step_s": lambda trace: _timing_module().median_step_s(lambda: None, [()], warmup=0),
}


@pytest.mark.parametrize("site", SITES)
def test_host_scalar_collectives_put_their_tensor_on_collective_device(monkeypatch, tiny_trace, site):
    """Every count or time reduced across ranks is made on ``collective_device()`` (here a sentinel,
    'meta'): a CPU tensor under a plain "nccl" group crashes."""
    for module in (calibrate, profile, autotune):
        monkeypatch.setattr(module, "collective_device", lambda group=None: META)
    monkeypatch.setattr(autotune, "compile_step", lambda *a, **k: (lambda *batch: None))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    seen = []

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise Routed

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(Routed):
        SITES[site](tiny_trace)
    assert seen == [META]


# ---- findings 5 and 12: timed windows end when the device is done -------------------------------

@pytest.fixture
def events(monkeypatch) -> list[str]:
    """What happened, in order: device syncs ("sync"), clock reads ("clock"); CUDA pretended."""
    log: list[str] = []
    clock = time.perf_counter
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(time, "perf_counter", lambda: log.append("clock") or clock())
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)
    for module in (calibrate, profile, autotune):
        monkeypatch.setattr(module, "collective_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: None)
    return log


def test_calibrate_windows_sync_the_device_at_both_ends(events):
    calibrate._window(lambda: events.append("fn"), 2, CUDA0)
    assert events == ["sync", "clock", "fn", "fn", "sync", "clock"]
    events.clear()
    calibrate._inner_count(lambda: events.append("fn"), CUDA0)
    assert events == ["sync", "clock", "fn", "sync", "clock"]


def test_benchmark_steps_are_timed_until_the_device_is_done(events):
    timing = _timing_module()
    step = lambda: events.append("step")  # noqa: E731
    timing.median_step_s(step, [(), ()], warmup=1)
    assert events == ["step", "sync", "clock", "step", "sync", "clock"]
    events.clear()
    timing.interleaved_times_s({"a": step}, [()], warmup=0)
    assert events == ["sync", "clock", "step", "sync", "clock"]


def test_profile_times_its_sizing_run_until_the_device_is_done(monkeypatch, tiny_trace, events):
    """The straight run that sizes the whole-graph window (``once``) is synced at both ends: a
    launch-only time would make the window far too long."""
    monkeypatch.setattr(profile, "device_sync", lambda device: events.append("sync"))
    call = torch.nn.Module.__call__
    monkeypatch.setattr(torch.nn.Module, "__call__", lambda self, *a, **k: events.append("graph") or call(self, *a, **k))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)

    def all_reduce(*args, **kwargs):
        raise Routed

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(Routed):  # stop at the count's all_reduce, right after the sizing run
        profile.profile_trace(tiny_trace, "cpu", repeats=1)
    assert events.count("graph") == 1 and events[-5:] == ["sync", "clock", "graph", "sync", "clock"]


def test_measure_top_times_steps_until_the_device_is_done(monkeypatch, events):
    monkeypatch.setattr(autotune, "compile_step", lambda *a, **k: (lambda *batch: events.append("step")))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    _measure_top_one_candidate()
    assert events[-5:] == ["sync", "clock", "step", "sync", "clock"]


# ---- finding 5: what calibration records for a GPU ---------------------------------------------

def test_calibrate_records_every_dtype_peak_and_the_torchrun_topology(monkeypatch):
    """The whole of ``calibrate()`` with every timing 1 ms and no collectives: the bf16 and fp16
    peaks land in ``GpuSpec.peak_flops`` (a bf16 plan is priced at them), and 8 ranks with
    LOCAL_WORLD_SIZE=4 are 2 nodes of 4."""
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 8)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend("gloo"))
    monkeypatch.setattr(calibrate, "_groups", lambda world, rank: {})
    monkeypatch.setattr(calibrate, "_timed", lambda fn, repeats, device: 1e-3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cluster = calibrate.calibrate(repeats=1)
    peak = statistics.median(2 * m * k * n for m, k, n in calibrate.MATMUL_SHAPES) / 1e-3
    assert cluster.gpu.peak_flops == pytest.approx({"float32": peak, "bfloat16": peak, "float16": peak})
    assert cluster.gpu.flops("bfloat16") == pytest.approx(peak)
    assert (cluster.nodes, cluster.gpus_per_node) == (2, 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(RuntimeError, match="LOCAL_WORLD_SIZE=3 does not divide the 8 ranks"):
        calibrate._topology(8)


def test_calibrated_memory_is_the_gpus_not_a_share_of_host_memory(monkeypatch):
    asked = []
    props = types.SimpleNamespace(total_memory=80 << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: asked.append(device) or props)
    assert calibrate._memory_bytes(torch.device("cuda", 1), per_node=4) == 80 << 30
    assert asked == [torch.device("cuda", 1)]
    assert 0 < calibrate._memory_bytes(torch.device("cpu"), per_node=4) < calibrate._memory_bytes(
        torch.device("cpu"), per_node=1)


def test_calibrated_links_split_inside_and_across_nodes():
    fits = {"all_gather:4": {"alpha_s": 3e-5, "beta_s_per_byte": 0.75 / 100e9},
            "all_gather:8": {"alpha_s": 7e-4, "beta_s_per_byte": 0.875 / 10e9}}
    intra, inter = calibrate._links(fits, world=8, per_node=4)
    assert intra == Link(bandwidth_bps=pytest.approx(100e9), latency_s=pytest.approx(1e-5))
    # the world's ring over 2 nodes: 1 network step and 6 intra-node ones (NCCL's latency) make its alpha
    assert inter == Link(bandwidth_bps=pytest.approx(10e9), latency_s=pytest.approx(7e-4 - 6 * 1e-5))
    from micscompile.cost_model.collective_time import ring_latency_s
    from micscompile.cost_model.specs import CPU_ESTIMATE, Cluster

    cluster = Cluster(name="two nodes", nodes=2, gpus_per_node=4, gpu=CPU_ESTIMATE, intra=intra, inter=inter)
    assert ring_latency_s(8, 2, cluster) == pytest.approx(7e-4) and ring_latency_s(4, 1, cluster) == pytest.approx(3e-5)
    assert calibrate._links(fits, world=4, per_node=4) == (intra, intra)


# ---- finding 11: the rank's GPU first, then its process group ----------------------------------

@pytest.fixture
def calls(monkeypatch) -> list[tuple]:
    """A machine with 4 GPUs (pretended): set_device and init_process_group calls, in order; the
    first init_process_group call stops the caller (raises Routed)."""
    log: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: log.append(("set_device", torch.device(device))))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def init_process_group(backend=None, **kwargs):
        log.append(("init", backend, kwargs.get("device_id")))
        raise Routed

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for name in ("LOCAL_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    return log


def test_init_distributed_sets_the_local_gpu_before_the_group(monkeypatch, calls):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(Routed):
        launch.init_distributed(timeout=None)
    assert calls == [("set_device", torch.device("cuda", 2)), ("init", "cpu:gloo,cuda:nccl", torch.device("cuda", 2))]


def test_without_local_rank_each_rank_takes_rank_mod_gpus(monkeypatch, calls):
    monkeypatch.setenv("RANK", "5")
    assert launch.local_device() == torch.device("cuda", 1)
    monkeypatch.delenv("RANK")
    with pytest.raises(RuntimeError, match="set LOCAL_RANK"):
        launch.local_device()
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(RuntimeError, match="LOCAL_RANK=5, but this machine shows 4 GPUs"):
        launch.local_device()


def test_init_distributed_on_cpu_is_gloo(monkeypatch, calls):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Routed):
        launch.init_distributed(timeout=None)
    assert calls == [("init", "gloo", None)]


def test_runtime_device_is_not_gpu0_for_every_rank(monkeypatch, calls):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: dist.Backend("nccl"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 6)
    assert runtime._device() == torch.device("cuda", 2)
    assert calls == [("set_device", torch.device("cuda", 2))]


@pytest.mark.parametrize("entry", ["demo", "calibrate"])
def test_demo_and_calibrate_start_through_init_distributed(monkeypatch, calls, entry):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(Routed):
        demo.main([]) if entry == "demo" else cli.main(["calibrate"])
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "cpu:gloo,cuda:nccl", torch.device("cuda", 1))]


# ---- on a GPU (skipped without one; docs/gpu.md): one-rank groups, in this process ---------------

def needs_gpu(test):
    """A GPU check: deselected by default (pyproject's ``-m "not gpu"``); ``pytest -m gpu`` runs it."""
    skip = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()), reason="needs a CUDA GPU")
    return pytest.mark.gpu(skip(test))


@needs_gpu
def test_gpu_host_scalar_collectives_work_on_a_pure_nccl_group(one_rank, tiny_trace):
    """What crashed: CPU tensors reduced over a plain "nccl" group (as a user's script may start it)."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", 0))
    assert collective_device() == torch.device("cuda", 0)
    assert calibrate.slowest_rank_times([0.25, 0.5]) == [0.25, 0.5]
    assert calibrate._inner_count(lambda: None, torch.device("cuda", 0)) >= 1
    profile.profile_trace(tiny_trace, "cuda", repeats=1)
    assert all(n.meta[profile.META_TIME_S] > 0 for n in tiny_trace.gm.graph.nodes if profile.META_TIME_S in n.meta)


@needs_gpu
def test_gpu_init_distributed_serves_host_and_device_tensors(one_rank):
    device = launch.init_distributed(timeout=datetime.timedelta(seconds=60))
    assert device == torch.device("cuda", 0) and torch.cuda.current_device() == 0
    assert str(dist.get_backend()) == "cpu:gloo,cuda:nccl" and collective_device() == torch.device("cpu")
    for t in (torch.ones(2), torch.ones(2, device=device)):  # gloo and NCCL
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    assert runtime._device() == device


@needs_gpu
def test_gpu_a_replayed_kernel_is_timed_apart_from_its_dispatch(one_rank):
    """calibrate times a chain of bare adds captured in one CUDA graph (``graph_op_overhead_s``):
    no host dispatch, so each costs the device less than the same add dispatched (docs/gpu.md: a replayed kernel
    3.4-4.5 us on an H200, a dispatched op 20-25 us of an H100 host's time)."""
    device = launch.init_distributed(timeout=datetime.timedelta(seconds=60))
    tiny = torch.ones(8, device=device)
    replayed = calibrate._replayed_op_s(tiny, 3, device)
    dispatched = calibrate._timed(lambda: tiny.add(tiny), 3, device)
    print(f"a bare add: {dispatched * 1e6:.2f} us dispatched, {replayed * 1e6:.2f} us replayed")
    assert 0 < replayed < dispatched and replayed < 50e-6


@needs_gpu
def test_gpu_timed_windows_wait_for_the_kernels(one_rank):
    """A launch-only window would time a 8192^3 bf16 matmul at microseconds: > 100 PFLOP/s."""
    device = launch.init_distributed(timeout=datetime.timedelta(seconds=60))
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    flops = 2 * n**3
    assert flops / calibrate._timed(lambda: torch.mm(a, b), 3, device) < 5e15  # above any GPU's bf16 peak
    step_s, _ = _timing_module().median_step_s(lambda: torch.mm(a, b), [()] * 4, warmup=1)
    assert flops / step_s < 5e15
    assert calibrate._memory_bytes(device, 1) == torch.cuda.get_device_properties(device).total_memory
    peaks = calibrate._matmul_peaks(device, 1)
    assert set(peaks) == {"float32", "bfloat16", "float16"} and all(0 < p < 5e15 for p in peaks.values())


@needs_gpu
def test_gpu_calibration_measures_the_gpus_matmul_peak_and_memory_bandwidth(one_rank):
    """Calibrated on a GPU of a preset, the bf16 matmul peak and the memory bandwidth are the
    device's, near its datasheet: with the CPU's shapes and operands an H100 measured 13.9 TFLOP/s
    (1.4% of 989) and 2.08 TB/s (its L2 cache, of 3.35 TB/s HBM)."""
    launch.init_distributed(timeout=datetime.timedelta(seconds=60))
    name = torch.cuda.get_device_name()
    preset = default_cluster("cuda", name, 1, 1)
    if preset is None:
        pytest.skip(f"{name} has no preset to compare with")
    gpu = calibrate.calibrate(repeats=3).gpu
    assert gpu.flops("bfloat16") > 0.5 * preset.gpu.flops("bfloat16"), (gpu.peak_flops, preset.gpu.peak_flops)
    assert gpu.memory_bandwidth_bps > 0.75 * preset.gpu.memory_bandwidth_bps


def _small_gpt_on_this_gpu(steps: int, **plan):
    """A 2-layer GPT, an untouched twin of it and ``steps`` batches on this rank's GPU, and ``build(model,
    cuda_graph)``: ``mc.compile`` at p = 1 under AdamW with ``plan``'s other fields."""
    import copy

    import micscompile as mc
    from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss

    device = launch.init_distributed(timeout=datetime.timedelta(seconds=60))
    cfg = GPTConfig(layers=2, hidden=128, heads=4, seq_len=64, vocab_size=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    batches = [tuple(t.to(device) for t in lm_batch(cfg, 8, gen)) for _ in range(steps)]

    def build(m, setting):
        return mc.compile(m, mc.Plan(partition_size=1, cuda_graph=setting, **plan), loss_fn=lm_loss,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), example_inputs=batches[0])

    return build, model, twin, batches


@needs_gpu
def test_gpu_a_captured_step_replays_what_the_eager_step_computes(one_rank, monkeypatch):
    """``Plan.cuda_graph=True`` captures the third call whole and replays it; with deterministic kernels
    its losses, weights and counted collectives equal an eager twin's step for step (docs/gpu.md's probe: bitwise at
    p = 1); a changed float learning rate recaptures, as does a loaded checkpoint (its tensors are new)."""
    import copy

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        build, model, twin, batches = _small_gpt_on_this_gpu(6, micro_batches=2)
        graphed, eager = build(model, True), build(twin, False)
        assert graphed.cuda_graph_choice.captured and not eager.cuda_graph_choice.captured
        for i, b in enumerate(batches):
            torch.testing.assert_close(graphed(*b), eager(*b), msg=f"step {i + 1}")
        assert graphed._graphed.captures == 1 and graphed.steps == eager.steps == len(batches)
        assert graphed.comm_stats().as_dict() == eager.comm_stats().as_dict()
        for step in (graphed, eager):
            for g in step.optimizer.param_groups:
                g["lr"] = 5e-4
        with pytest.warns(UserWarning, match="recapturing"):
            torch.testing.assert_close(graphed(*batches[0]), eager(*batches[0]))
        assert graphed._graphed.captures == 2
        for name, value in eager.full_state_dict().items():
            torch.testing.assert_close(graphed.full_state_dict()[name], value, msg=name)
        graphed.load_state_dict(eager.state_dict())
        for b in batches[1:3]:
            torch.testing.assert_close(graphed(*b), eager(*b))
        assert graphed._graphed.captures == 3 and graphed.steps == eager.steps
        auto = build(copy.deepcopy(model), "auto")
        assert auto.cuda_graph_choice.captured, auto.cuda_graph_choice
        # codegen="auto" priced each as it runs: replayed kernels, or dispatched ops
        assert auto.codegen_choice.captured and graphed.codegen_choice.captured and not eager.codegen_choice.captured
    finally:
        torch.use_deterministic_algorithms(False)


@needs_gpu
def test_gpu_an_inductor_step_in_bf16_replays_what_it_computes_uncaptured(one_rank):
    """What "auto" now runs for a bf16 model whose fusing pays (bench_gpu.py's Llama on an H200): Inductor's regions
    over the arena in bf16, captured. Its losses and weights equal the same step uncaptured (the same kernels in the
    same order), and the regions' statistics reach them in the dtype they were compiled for."""
    build, model, twin, batches = _small_gpt_on_this_gpu(5, param_dtype=torch.bfloat16, codegen="inductor")
    graphed, eager = build(model, True), build(twin, False)
    assert graphed.cuda_graph_choice.captured and graphed.codegen.compiled  # (Inductor regions run)
    losses = [(float(graphed(*b)), float(eager(*b))) for b in batches]
    assert graphed._graphed.captures == 1 and all(math.isfinite(a) for a, _ in losses), losses
    assert [a for a, _ in losses] == [b for _, b in losses], losses
    for name, value in eager.full_state_dict().items():
        torch.testing.assert_close(graphed.full_state_dict()[name], value, rtol=0, atol=0, msg=name)
