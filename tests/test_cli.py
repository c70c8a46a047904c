"""The ``micscompile`` command: every subcommand on a tiny model, as a subprocess (exit code,
output files exist and parse); bad input exits 2 with one line (in process: ``main``'s exit
status); the pictures say what they show."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import micscompile as mc
from micscompile.cli import command, pictures
from micscompile.cost_model.specs import Cluster
from micscompile.lowering.predict import step_buffers_of
from micscompile.zoo.models import GPT, GPTConfig, lm_loss

EXE = Path(sys.executable).with_name("micscompile")  # the pyproject entry point
PNG = b"\x89PNG\r\n\x1a\n"


def run(*args: str, cwd: Path | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG, path
    assert path.stat().st_size > 10_000, path  # drawn, not an empty canvas


@pytest.mark.parametrize("extra", [["-p", "8"], ["-p", "2", "-S", "2", "-m", "4"],
                                   ["-p", "2", "-S", "2", "-m", "4", "--schedule", "zb-h1"]],
                         ids=["flat", "pipeline", "zero-bubble"])
def test_plan_prints_the_program_summary_and_writes_the_pictures(tmp_path, extra):
    out = ok(run("plan", "gpt:tiny", "--cluster", "p3dn.24xlarge", "--nodes", "2", *extra, "--out", str(tmp_path)))
    assert "collectives of one step on rank 0" in out and "all_gather" in out and "reduce_scatter" in out
    assert "intra-node" in out and "inter-node" in out and "TFLOP/s per GPU" in out and "peak memory" in out
    trace = json.loads((tmp_path / "trace.json").read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    stages = {"stage 0", "stage 1", "stage 0 replicate", "stage 1 replicate"}  # (d = 4: second hops)
    assert tracks >= (stages if "-S" in extra else {"compute", "comm:shard"}), tracks
    program = (tmp_path / "program.txt").read_text()
    assert program.strip() and ("second hops (SH): each chunk's last backward" in program) == ("-S" in extra)
    assert ("pipeline zb-h1 stages=2" in program and " W3 " in program) == ("zb-h1" in extra)  # its grid draws W
    for name in ("timeline.png", "memory.png"):
        assert_png(tmp_path / name)


def test_simulate_prints_one_row_per_partition_size():
    out = ok(run("simulate", "gpt:1.3b", "--cluster", "p3dn.24xlarge", "--nodes", "2", "-b", "2",
                 "--checkpoint", "-p", "8", "16"))
    table = out[out.index("step ms"):]
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["8"], ["16"])]
    assert [r[0] for r in rows] == ["8", "16"], out
    assert all(float(r[3]) > 0 for r in rows), out  # a step time each


def test_simulate_compares_the_peers_across_cluster_sizes(tmp_path):
    """One row per --nodes, a column per system (HSDP from 2 nodes), micscompile's ratio to the best
    peer, and the picture."""
    out = ok(run("simulate", "gpt:tiny", "--cluster", "p4d.24xlarge", "--compare-peers", "--nodes", "1", "2",
                 "--png", str(tmp_path / "peers.png")))
    table = out[out.index("nodes  GPUs"):]
    rows = {line.split()[0]: line for line in table.splitlines()[2:] if line.split()[:1] in (["1"], ["2"])}
    assert set(rows) == {"1", "2"}, out
    assert rows["1"].split()[1] == "8" and rows["2"].split()[1] == "16", out
    assert rows["2"].rstrip().endswith("x") and "not priced" not in rows["2"], out  # m=1: HSDP priced
    assert f"+-{mc.Cluster.preset('p4d.24xlarge').prediction_error:.0%}" in table, out
    assert_png(tmp_path / "peers.png")


def test_autotune_prints_its_table():
    out = ok(run("autotune", "gpt:tiny", "--cluster", "p3dn.24xlarge", "--global-batch-size", "16", "--top", "3",
                 "--no-pipelines", "--tp", "1", "2", "--no-sequence-parallel", "--workers", "2"))
    assert "TFLOP/s" in out and "searched" in out
    families = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["MiCS"], ["PTD-P"])}
    assert set(families) == {"MiCS", "PTD-P"} and "the best is " in out, out  # the family table
    assert "tp=2" in families["PTD-P"] and ("best" in families["PTD-P"] or "%" in families["PTD-P"]), out
    assert len([line for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]) >= 3, out


def test_autotune_prices_on_every_core_by_default(monkeypatch):
    """``autotune``'s workers, the CLI's and ``mc.autotune``'s alike, default to the cores the process may use
    (Linux's affinity; mutation caught: 1)."""
    import inspect
    import os

    import micscompile as mc
    from micscompile.cli import command
    from micscompile.core.launch import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    args = command.parser().parse_args(["autotune", "gpt:tiny", "--global-batch-size", "16"])
    assert args.workers is None and inspect.signature(mc.autotune).parameters["workers"].default is None
    assert usable_cores() == 3


def test_a_user_function_is_a_model_spec(tmp_path):
    (tmp_path / "mine.py").write_text(
        "import torch\n"
        "def build():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))\n"
        "    return model, (torch.zeros(8, 32), torch.zeros(8, dtype=torch.long)), torch.nn.functional.cross_entropy\n")
    out = ok(run("simulate", "mine:build", "--cluster", "p3dn.24xlarge", "-p", "1", "2", "--param-dtype", "float32",
                 cwd=tmp_path))
    assert "mine:build: TrainGraph" in out
    ok(run("simulate", str(tmp_path / "mine.py") + ":build", "-p", "2", "--param-dtype", "float32"))


@pytest.mark.parametrize("args, says", [
    (["plan", "gpt:huge"], "unknown gpt preset 'huge'"),
    (["simulate", "nosuchmodule:build"], "cannot import 'nosuchmodule'"),
    (["simulate", "gpt:tiny", "-p", "3"], "partition_size"),
    (["plan", "gpt:tiny", "--cluster", "cray-1"], "unknown cluster preset 'cray-1'"),
    (["simulate", "gpt:tiny", "--cluster", "missing.json"], "missing.json not found"),
    (["plan", "gpt:tiny", "--nodes", "2", "4"], "several are for `simulate --compare-peers`"),
    (["simulate", "gpt:tiny", "--compare-peers", "--nodes", "2", "0"], "--nodes: expected 1 to 65,536, got 0"),
], ids=["preset", "module", "plan", "cluster", "json", "nodes", "compare-nodes"])
def test_bad_input_exits_2_with_one_line(args, says, capsys, tmp_path, monkeypatch):
    """In process (``main`` is what the entry point exits with; a subprocess would cost each case
    torch's import: the other tests here run the entry point)."""
    monkeypatch.chdir(tmp_path)  # (a user module is looked up from the working directory)
    assert command.main(list(args)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines


@pytest.mark.multiproc
def test_demo_trains_against_eager_and_calibrate_writes_a_cluster(tmp_path):
    """A meta model too: its reference is initialised from the same seed after it is built."""
    out = ok(run("demo", "--nproc", "2", "--", "--partition-size", "2", "--micro-batches", "2", "--steps", "2",
                 "--meta", "--check", timeout=300))
    assert "vs eager reference" in out and ": OK" in out, out[-2000:]
    ok(run("calibrate", "--nproc", "2", "--repeats", "1", "--out", str(tmp_path / "c.json"), timeout=300))
    cluster = Cluster.load(tmp_path / "c.json")
    assert cluster.world_size == 2 and cluster.gpu.peak_flops["float32"] > 0
    arrival = cluster.collective_interference["2"]  # how long a rank waits for the other after compute
    assert arrival["arrival_wait_s"] > 0 and 0 <= arrival["arrival_exponent"] <= 1


def _tiny():
    cfg = GPTConfig(vocab_size=64, seq_len=16, layers=2, hidden=32, heads=2)
    with torch.device("meta"):
        model = GPT(cfg)
    x = torch.zeros(2, cfg.seq_len, dtype=torch.long)
    return mc.trace(model, (x, x), lm_loss)


def test_the_pictures_label_their_axes_and_legends():
    tg, plan = _tiny(), mc.Plan(partition_size=2, micro_batches=2)
    cluster = Cluster.preset("p3dn.24xlarge")
    pred = mc.simulate(tg, plan, cluster)
    ax = pictures.timeline_figure(pred).axes[0]
    assert ax.get_xlabel() == "time (ms)" and ax.get_ylabel() == "stream"
    assert [t.get_text() for t in ax.get_yticklabels()][:2] == ["compute", "comm:shard"]
    assert {"compute", "all-gather", "reduce-scatter"} <= {t.get_text() for t in ax.get_legend().get_texts()}
    zb = mc.simulate(tg, mc.Plan(partition_size=1, pipeline_stages=2, micro_batches=2, pipeline_schedule="zb-h1"),
                     cluster)
    ax = pictures.timeline_figure(zb).axes[0]
    assert ax.get_ylabel() == "pipeline stage"
    assert {"forward", "backward", "weight gradients"} <= {t.get_text() for t in ax.get_legend().get_texts()}
    buffers = step_buffers_of(tg, plan, cluster.world_size)
    ax = pictures.memory_figure(buffers).axes[0]
    assert ax.get_xlabel().startswith("Program step") and "GiB" in ax.get_ylabel()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert [s.split(" ")[0] for s in legend] == ["live", "caching", "static", "lower"], legend
    live = max(pictures.live_bytes(buffers)[1])
    assert max(ax.get_lines()[0].get_ydata()) * pictures.GIB == pytest.approx(live)  # the curve is the buffers'
    arena = ax.get_lines()[2].get_ydata()[0] * pictures.GIB
    assert arena >= live  # the static plan holds every buffer live at once


def test_plan_without_a_partition_size_prices_them_and_lowers_the_one_it_takes(tmp_path):
    """No -p: every candidate size priced in a table, the one ``tune.partition.pick`` takes from that
    table marked and lowered (the plan line and program.txt say it). Mutation: the choice priced but
    not lowered (one node's p=8 in the plan line) fails."""
    from types import SimpleNamespace

    from micscompile.tune.partition import PricedSize, pick

    out = ok(run("plan", "gpt:tiny", "--cluster", "p4d.24xlarge", "--nodes", "16", "--out", str(tmp_path)))
    table = out[out.index("step ms  peak GiB"):]
    rows = [line.split() for line in table.splitlines()[2:] if line.split()[:1] and line.split()[0].isdigit()]
    assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16, 32, 64, 128], out
    cluster = mc.Cluster.preset("p4d.24xlarge", nodes=16)
    priced = [PricedSize(int(r[0]), SimpleNamespace(step_time_s=float(r[2]) / 1e3, fits=lambda _, ok=r[4] == "yes": ok))
              for r in rows]
    want = pick(priced, cluster, default=8).partition_size
    assert want != 8, out  # gpt:tiny at one micro-batch: one node is not the choice, so the plan line tells
    assert [int(r[0]) for r in rows if r[-1] == "<-"] == [want], out
    assert f"partition size {want} (priced on p4d.24xlarge" in out and f" p={want} " in out, out
    assert f"partition size {want} (priced" in (tmp_path / "program.txt").read_text()
