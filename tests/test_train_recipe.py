"""``examples/train_lm.py`` (``make train``) on 4 gloo ranks, in one launch and a few steps: a run
stopped after its checkpoint and started again continues the same curve, value for value, as the run
that never stopped; a half-written checkpoint (``.tmp``) is never loaded; the loss curve is written."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

import pytest
from harness import launch

pytestmark = pytest.mark.multiproc
RECIPE = Path(__file__).resolve().parent.parent / "examples" / "train_lm.py"
SMALL = ["--steps", "4", "--eval-every", "2", "--ckpt-every", "2", "--keep", "1", "--no-progress",
         "--layers", "1", "--hidden", "32", "--seq", "32", "--batch-per-rank", "2", "--eval-batches", "1",
         "--data-bytes", str(1 << 20), "--warmup", "2"]


def _recipe():
    spec = importlib.util.spec_from_file_location("train_lm", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runs(rank: int, world: int, root: str) -> dict:
    recipe = _recipe()
    straight, stopped = os.path.join(root, "straight"), os.path.join(root, "stopped")
    recipe.main([*SMALL, "--out", straight])
    first = recipe.main([*SMALL, "--out", stopped, "--steps", "2"])  # stopped after its checkpoint at step 2
    if rank == 0:  # a run killed while writing its step-4 checkpoint left this behind
        (Path(stopped) / "checkpoints" / "step_000004.tmp").mkdir()
    recipe.main([*SMALL, "--out", stopped])
    return {"first": first, "kept": sorted(p.name for p in (Path(stopped) / "checkpoints").iterdir())}


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as root:
        values = launch(runs, 4, root, timeout_s=300)
        logs = {name: [json.loads(line) for line in (Path(root) / name / "log.jsonl").read_text().splitlines()]
                for name in ("straight", "stopped")}
        curve = (Path(root) / "straight" / "loss_curve.png").stat().st_size
    return values, logs, curve


def test_a_restarted_run_continues_the_same_curve(results):
    values, logs, _ = results
    assert values[0]["first"]["steps"] == 2
    assert [r["step"] for r in logs["stopped"]] == [1, 2, 3, 4]
    for a, b in zip(logs["straight"], logs["stopped"]):
        assert (a["loss"], a["lr"], a["grad_norm"], a.get("val_loss")) == (b["loss"], b["lr"], b["grad_norm"],
                                                                          b.get("val_loss"))


def test_half_written_checkpoints_are_never_loaded_and_old_ones_pruned(results):
    values, _, _ = results
    # the run resumed from step 2 (not the .tmp), wrote step 4 over the leftover, and kept 1
    assert values[0]["kept"] == ["step_000004"]


def test_the_run_logs_every_step_and_draws_the_curve(results):
    _, logs, curve = results
    assert all({"loss", "lr", "grad_norm", "tokens_per_s", "step_s", "memory"} <= r.keys() for r in logs["straight"])
    assert [r["step"] for r in logs["straight"] if "val_loss" in r] == [2, 4]
    assert curve > 10_000


def killed_mid_save(rank: int, world: int, root: str) -> dict:
    """The last rank writes its files of the step-4 checkpoint, then is SIGKILLed before DCP finishes
    the save (rank 0 writes .metadata last); the others wait in the save until the group's timeout."""
    import signal

    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    recipe = _recipe()
    if rank == world - 1:
        calls, write = [0], FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            done = write(self, plan, planner)
            calls[0] += 1
            if calls[0] == 2:  # step 4's checkpoint: its own files written, the save not finished
                done.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return done

        FileSystemWriter.write_data = write_then_die
    recipe.main([*SMALL, "--steps", "6", "--out", os.path.join(root, "killed")])
    return {}


def resumed(rank: int, world: int, root: str) -> dict:
    recipe = _recipe()
    killed = Path(root) / "killed" / "checkpoints"
    left = {p.name: sorted(f.name for f in p.iterdir()) for p in killed.iterdir()}
    try:
        recipe.check_complete(killed / "step_000004.tmp")
        refusal = "loaded"
    except SystemExit as exc:
        refusal = str(exc)
    recipe.main([*SMALL, "--steps", "6", "--out", os.path.join(root, "straight")])
    out = recipe.main([*SMALL, "--steps", "6", "--out", os.path.join(root, "killed")])
    return {"left": left, "refusal": refusal, "steps": out["steps"]}


def test_a_rank_killed_mid_checkpoint_resumes_from_the_last_whole_one():
    """SIGKILL while the step-4 checkpoint is being written. The others fail within the
    group's timeout; the half-written checkpoint is refused, naming what is missing; started again,
    the run resumes from step 2 and continues exactly the curve of a run that was never killed."""
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(RuntimeError, match="rank 3 left no result"):
            launch(killed_mid_save, 4, root, timeout_s=120, pg_timeout_s=10)
        values = launch(resumed, 4, root, timeout_s=300)
        logs = {name: [json.loads(line) for line in (Path(root) / name / "log.jsonl").read_text().splitlines()]
                for name in ("straight", "killed")}
    left, refusal = values[0]["left"], values[0]["refusal"]
    assert sorted(left) == ["step_000002", "step_000004.tmp"] and ".metadata" in left["step_000002"]
    assert ".metadata" not in left["step_000004.tmp"] and left["step_000004.tmp"], left  # files, no metadata
    assert "is not a complete checkpoint: it has no .metadata" in refusal and "__3_0.distcp" in refusal, refusal
    assert values[0]["steps"] == 6
    assert [r["step"] for r in logs["killed"]] == [1, 2, 3, 4, 5, 6]  # what it logged after step 2 was dropped
    for a, b in zip(logs["straight"], logs["killed"]):
        assert (a["loss"], a["lr"], a["grad_norm"]) == (b["loss"], b["lr"], b["grad_norm"]), (a, b)
