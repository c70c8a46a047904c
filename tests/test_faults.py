"""A rank that dies or hangs mid-step: the others exit non-zero, with a message naming the
collective, within the compile timeout (plus slack), instead of waiting forever."""

from __future__ import annotations

import datetime
import json
import os
import signal
import time

import pytest
import torch.multiprocessing as mp

WORLD, VICTIM = 4, 3
TIMEOUT_S = 4.0
SLACK_S = 20.0  # process start-up is not in it: timed from the victim's last breath
pytestmark = pytest.mark.multiproc


def _worker(rank: int, store: str, out_dir: str, how: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["LOCAL_WORLD_SIZE"] = str(WORLD)
    import torch
    import torch.distributed as dist

    import micscompile as mc
    from models import MODELS

    torch.set_num_threads(1)
    # the default group's own timeout is long: the step's must be what bounds the wait
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    report = os.path.join(out_dir, f"rank{rank}.json")
    try:
        cls, make_loss, make_batches = MODELS["tied_lm"]
        torch.manual_seed(0)
        model = cls()
        batch = make_batches(1, 8)[0]
        step = mc.compile(model, mc.Plan(partition_size=2, micro_batches=2), loss_fn=make_loss(model),
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), example_inputs=batch, timeout=TIMEOUT_S)
        step(*batch)  # one whole step first
        if rank == VICTIM:  # the third collective of step 2 is its last: mid-step, mid-micro-batch
            record, calls = step.comm_stats().record, [0]

            def last_breath(*args, **kwargs):
                calls[0] += 1
                if calls[0] == 3:
                    with open(os.path.join(out_dir, "victim.json"), "w") as f:
                        json.dump({"t": time.time()}, f)
                    os.kill(os.getpid(), signal.SIGKILL if how == "killed" else signal.SIGSTOP)
                return record(*args, **kwargs)

            step.comm_stats().record = last_breath
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
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, str(tmp_path / "store"), str(tmp_path), how)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        start = time.time()
        while not (tmp_path / "victim.json").exists():
            assert time.time() - start < 240, "the victim never reached step 2"
            assert all(p.exitcode is None for p in procs), [p.exitcode for p in procs]
            time.sleep(0.1)
        died = json.loads((tmp_path / "victim.json").read_text())["t"]
        survivors = [r for r in range(WORLD) if r != VICTIM]
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
