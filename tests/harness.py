"""Launch real multi-process gloo worlds from a test.

``launch(fn, world_size)`` spawns ``world_size`` processes, each initialises a gloo
process group (FileStore rendezvous in a temp dir, bounded timeout) and calls
``fn(rank, world_size, *args)``; the per-rank return values come back in rank
order. A worker exception is re-raised in the test with the worker's traceback; a
hung world is killed after ``timeout_s``.

``MICSCOMPILE_TEST_BACKEND=nccl`` (on a machine with a GPU per rank) runs the same tests over
NCCL instead: rank r takes GPU r, the group is "cpu:gloo,cuda:nccl" bound to it
(``micscompile.core.launch.init_distributed``), and the steps run on the GPUs (docs/gpu.md).
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback

import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, fn, args, pg_timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    result: dict = {}
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        init = dict(init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        if os.environ.get("MICSCOMPILE_TEST_BACKEND", "gloo") == "nccl":
            from micscompile.core.launch import init_distributed

            os.environ["LOCAL_RANK"] = str(rank)  # one machine: rank r on GPU r
            init_distributed(timeout, **init)
        else:
            dist.init_process_group("gloo", timeout=timeout, **init)
        result["value"] = fn(rank, world_size, *args)
    except BaseException as exc:  # noqa: BLE001 - shipped to the parent verbatim
        result["error"] = "".join(traceback.format_exception(exc))
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, world_size: int, *args, timeout_s: float = 300, pg_timeout_s: float = 60) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, os.path.join(tmp, "store"), tmp, fn, args, pg_timeout_s))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} left no result (hung: {hung}, exit codes "
                                   f"{[p.exitcode for p in procs]})")
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    errors = [f"--- rank {r} ---\n{res['error']}" for r, res in enumerate(results) if "error" in res]
    if errors:
        raise RuntimeError("worker(s) failed:\n" + "\n".join(errors))
    return [res["value"] for res in results]


def run_cases(rank: int, world: int, bad_inputs, run_case, cases) -> dict:
    """In one launch: the bad-input checks first (each must fail before any collective, which the
    cases after them prove), then every case; keyed by case."""
    results = {"bad_inputs": bad_inputs(rank, world)}
    for case in cases:
        results[case] = run_case(case, rank, world)
    return results


def assert_parity(results: list[dict], case, tolerance: float) -> None:
    """Every rank's losses and full state match the single-process reference; all ranks report
    the same global mean losses."""
    for rank, res in enumerate(results):
        r = res[case]
        assert r["loss_err"] <= tolerance, (rank, r["losses"], r["ref_losses"])
        err, name = r["state_err"]
        assert err <= tolerance, (rank, name, err)
    assert all(res[case]["losses"] == results[0][case]["losses"] for res in results)
