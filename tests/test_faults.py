"""A rank that dies or hangs mid-step: the others exit non-zero, with a message naming the
collective, within the compile timeout (plus slack), instead of waiting forever. On gloo always;
on NCCL with TORCH_NCCL_BLOCKING_WAIT=1 (a GPU test, on 2 GPUs or more), and without it compile
warns that the watchdog, not a CollectiveError, ends the process."""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import micscompile as mc
from micscompile.core import collectives as C
from micscompile.runtime import compile as runtime

WORLD = 4  # the last rank is the victim
TIMEOUT_S = 4.0
SLACK_S = 20.0  # process start-up is not in it: timed from the victim's last breath
pytestmark = pytest.mark.multiproc


def _worker(rank: int, store: str, out_dir: str, how: str, backend: str = "gloo", world: int = WORLD,
            pipeline: bool = False) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    if backend == "nccl":  # read when the process groups are created; =0 in the test's environment shows the default
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    from models import MODELS

    torch.set_num_threads(1)
    # the default group's own timeout is long: the step's must be what bounds the wait
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    report = os.path.join(out_dir, f"rank{rank}.json")
    try:
        cls, make_loss, make_batches = MODELS["tied_lm"]
        torch.manual_seed(0)
        model = cls()
        batch = make_batches(1, 8)[0]
        plan = mc.Plan(partition_size=1, pipeline_stages=2, micro_batches=2) if pipeline else \
            mc.Plan(partition_size=2, micro_batches=2)
        step = mc.compile(model, plan, loss_fn=make_loss(model), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                          example_inputs=batch, timeout=TIMEOUT_S)
        step(*batch)  # one whole step first
        if rank == world - 1:  # the victim: its third collective (a pipeline: P2P batch) of step 2 is its last
            calls = [0]

            def dying(call):
                def last_breath(*args, **kwargs):
                    calls[0] += 1
                    if calls[0] == 3:
                        with open(os.path.join(out_dir, "victim.json"), "w") as f:
                            json.dump({"t": time.time()}, f)
                        os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                    return call(*args, **kwargs)
                return last_breath

            if pipeline:  # mid-exchange: the stage before it waits on its activations' gradients
                dist.batch_isend_irecv = dying(dist.batch_isend_irecv)
            else:
                step.comm_stats().record = dying(step.comm_stats().record)
        for _ in range(3):
            step(*batch)
    except BaseException as exc:
        with open(report, "w") as f:
            json.dump({"error": f"{type(exc).__name__}: {exc}", "t": time.time()}, f)
        raise
    with open(report, "w") as f:
        json.dump({"finished": True, "t": time.time()}, f)


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_the_others_exit_nonzero_within_the_timeout(tmp_path, how):
    _the_others_exit_nonzero_within_the_timeout(tmp_path, how, "gloo", WORLD)


def test_a_rank_killed_in_a_pipeline_exchange_the_others_exit_within_the_timeout(tmp_path):
    """SIGKILL in the middle of a P2P exchange (S=2 1F1B): its stage neighbour raises from
    the exchange, the other pipe from the boundary all-reduce, each a CollectiveError in time."""
    _the_others_exit_nonzero_within_the_timeout(tmp_path, "killed", "gloo", WORLD, pipeline=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (dist.is_nccl_available() and torch.cuda.device_count() >= 2), reason="needs 2 GPUs and NCCL")
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_nccl_with_blocking_wait_the_others_exit_nonzero_within_the_timeout(tmp_path, how):
    _the_others_exit_nonzero_within_the_timeout(tmp_path, how, "nccl", 2)


def _the_others_exit_nonzero_within_the_timeout(tmp_path, how: str, backend: str, world: int,
                                                pipeline: bool = False) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / "store"), str(tmp_path), how, backend, world,
                                               pipeline))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        start = time.time()
        while not (tmp_path / "victim.json").exists():
            assert time.time() - start < 240, "the victim never reached step 2"
            assert all(p.exitcode is None for p in procs), [p.exitcode for p in procs]
            time.sleep(0.1)
        died = json.loads((tmp_path / "victim.json").read_text())["t"]
        survivors = list(range(world - 1))
        for r in survivors:
            procs[r].join(max(0.0, died + TIMEOUT_S + SLACK_S - time.time()))
        assert [procs[r].exitcode for r in survivors if procs[r].exitcode is None] == [], "a rank is still waiting"
        for r in survivors:
            assert procs[r].exitcode != 0, (r, procs[r].exitcode)
            report = json.loads((tmp_path / f"rank{r}.json").read_text())
            assert "error" in report, (r, report)
            assert report["error"].startswith("CollectiveError: rank "), report["error"]
            assert f"rank {r}, step 2: " in report["error"], report["error"]
            assert "Another rank died, hung or left the step" in report["error"], report["error"]
            assert "collectives give up after 4 s" in report["error"], report["error"]
            assert report["t"] - died <= TIMEOUT_S + SLACK_S, (r, report["t"] - died)
        if how == "hung":  # nobody may finish a step the victim never joined
            assert all("finished" not in json.loads((tmp_path / f"rank{r}.json").read_text()) for r in survivors)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


NCCL_TIMEOUT = ("[PG ID 1 PG GUID 3(shard) Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, "
                "OpType=_ALLGATHER_BASE, NumelIn=40, NumelOut=80, Timeout(ms)=4000) ran for 4012 milliseconds before "
                "timing out.\nException raised from checkTimeout at ProcessGroupNCCL.cpp")


class _TimedOut:
    """An NCCL Work in blocking wait whose collective ran past the group's timeout."""

    def wait(self):
        raise dist.DistBackendError(NCCL_TIMEOUT)


def test_an_nccl_backend_error_is_a_collective_error_naming_the_collective():
    pending = C.Pending(_TimedOut(), None, what="all_gather of bucket 2 over shard[0, 1]")
    with pytest.raises(C.CollectiveError) as info:
        C.collective_wait(None, pending)
    assert str(info.value) == f"all_gather of bucket 2 over shard[0, 1] failed: {NCCL_TIMEOUT.splitlines()[0]}"
    assert isinstance(info.value.__cause__, dist.DistBackendError)
    step = C.step_failure(info.value, 1, 2, datetime.timedelta(seconds=4))
    assert str(step).startswith("rank 1, step 2: all_gather of bucket 2 over shard[0, 1] failed: [PG ID 1")


@pytest.mark.parametrize("environ, blocking", [
    ({}, False),
    ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, True),
    ({"TORCH_NCCL_BLOCKING_WAIT": "True"}, True),
    ({"TORCH_NCCL_BLOCKING_WAIT": "0"}, False),
    ({"NCCL_BLOCKING_WAIT": "1"}, True),
    ({"TORCH_NCCL_BLOCKING_WAIT": "0", "NCCL_BLOCKING_WAIT": "1"}, False),  # c10d: the first name wins
])
def test_nccl_blocking_wait_is_read_as_c10d_reads_it(environ, blocking):
    assert C.nccl_blocking_wait(environ) is blocking


class _Compiled(Exception):
    """Raised where compile's first collective would be: what came before it is what is tested."""


def _compile_on(monkeypatch, backend: str, device: str, **kwargs) -> None:
    """mc.compile up to its first collective, as on a rank whose default group has ``backend`` and
    whose step runs on ``device``: no process group, no GPU."""
    from models import MODELS

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(runtime, "_device", lambda: torch.device(device))
    monkeypatch.setattr(runtime, "_check_agreement", lambda *a: (_ for _ in ()).throw(_Compiled()))
    cls, make_loss, make_batches = MODELS["tied_lm"]
    model = cls()
    with pytest.raises(_Compiled):
        mc.compile(model, mc.Plan(partition_size=2), loss_fn=make_loss(model),
                   optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), example_inputs=make_batches(1, 8)[0], **kwargs)


@pytest.mark.parametrize("backend", ["nccl", "cpu:gloo,cuda:nccl"])
def test_compile_with_a_timeout_on_nccl_without_blocking_wait_warns_with_the_fix(monkeypatch, backend):
    for name in C.BLOCKING_WAIT_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.warns(RuntimeWarning) as record:
        _compile_on(monkeypatch, backend, "cuda", timeout=4)
    [ours] = [w for w in record if "BLOCKING_WAIT" in str(w.message)]
    message = str(ours.message)
    assert message.startswith("mc.compile(timeout=...) on NCCL without TORCH_NCCL_BLOCKING_WAIT=1: "
                              "a dead or hung rank will not raise CollectiveError."), message
    assert "TORCH_NCCL_BLOCKING_WAIT=1 torchrun" in message and "docs/gpu.md" in message
    assert ours.filename == __file__  # points at the caller of mc.compile


@pytest.mark.parametrize("backend, device, env, kwargs", [
    ("nccl", "cuda", {"TORCH_NCCL_BLOCKING_WAIT": "1"}, {"timeout": 4}),  # the mode that raises
    ("nccl", "cuda", {}, {}),  # no timeout asked for
    ("gloo", "cpu", {}, {"timeout": 4}),
    ("cpu:gloo,cuda:nccl", "cpu", {}, {"timeout": 4}),  # the step's collectives run on gloo
])
def test_compile_is_silent_where_a_timeout_raises_or_none_was_asked_for(monkeypatch, backend, device, env, kwargs):
    for name in C.BLOCKING_WAIT_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(C, "default_timeout", lambda: datetime.timedelta(seconds=60))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _compile_on(monkeypatch, backend, device, **kwargs)
