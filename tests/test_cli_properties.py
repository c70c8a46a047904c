"""Every command line ends in a plan or in one clear line.

Hypothesis draws whole command lines over ``plan``, ``simulate``, ``autotune`` (and the numeric options of
``demo`` and ``calibrate``, which must be refused before any rank starts): zero, negative, huge and
non-numeric values, unknown presets and clusters, a malformed cluster file, missing required options.
Each run must end with exit 0 and outputs that pass the invariants below, or with exit 2 and one line on
stderr; never a traceback. ``main`` runs in process (a subprocess per example would cost torch's import)
on ``gpt:tiny``, its traces cached by what shapes them. ``MICSCOMPILE_CLI_EXAMPLES`` sets the example
count (the suite's below; docs/reliability.md records a longer run)."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import time
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from micscompile.cli import command
from micscompile.cost_model.specs import PRESETS, Cluster

EXAMPLES = int(os.environ.get("MICSCOMPILE_CLI_EXAMPLES", "30"))
BAD = st.sampled_from(["0", "-1", "-0", "65537", str(2**31), str(10**12), "x", "1.5", "", "1e3", "0x10"])
"""Zero, negative, huge and non-numeric: refused by every numeric option."""


def number(*valid: int, huge: int | None = None) -> st.SearchStrategy[str]:
    """An option's value: one of ``valid`` (or ``huge``, its largest accepted) seven times in eight, else BAD."""
    good = st.sampled_from([*valid, *([huge] if huge else [])]).map(str)
    return st.sampled_from([True] * 7 + [False]).flatmap(lambda ok: good if ok else BAD)


NODES = number(1, 2, 3, 4, huge=16)
CLUSTERS = st.sampled_from([*sorted(PRESETS), "p4d.24xlarge", "p3dn.24xlarge", "cray-1", "missing.json", "bad.json"])
MODELS = st.sampled_from(["gpt:tiny"] * 6 + ["gpt:nope", "nosuchmodule:build", "tiny"])


def _maybe(flag: str, values: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.just([]), values.map(lambda v: [flag, *(v if isinstance(v, list) else [v])]))


@st.composite
def command_lines(draw) -> list[str]:
    sub = draw(st.sampled_from(["plan", "simulate", "autotune", "plan", "simulate", "autotune", "demo", "calibrate"]))
    if sub in ("demo", "calibrate"):  # refused values only: a valid one would start ranks
        flag = "--nproc" if sub == "demo" else draw(st.sampled_from(["--nproc", "--repeats"]))
        return [sub, flag, draw(st.one_of(BAD, st.just("1025")))]
    argv = [sub, draw(MODELS)]
    compare = sub == "simulate" and draw(st.booleans())
    for part in (
        _maybe("--cluster", CLUSTERS),
        _maybe("--nodes", st.lists(NODES, min_size=1, max_size=3 if compare else 1)),
        _maybe("--seq", number(1, 7, 64, 128, huge=4096)), _maybe("-b", number(1, 2, 3, 8, huge=64)),
        _maybe("--param-dtype", st.sampled_from(["float32", "bfloat16", "float16", "int8"])),
    ):
        argv += draw(part)
    if sub == "autotune":
        # (a valid batch of thousands prices thousands of micro-batches per pipeline candidate: minutes, not wrong)
        argv += draw(st.one_of(_maybe("--global-batch-size", number(7, 16, 24, 64, 256)),
                               st.just(["--global-batch-size", "64"])))
        argv += draw(_maybe("--top", number(1, 3, 10, huge=10_000)))
        argv += draw(st.sampled_from([[], ["--no-pipelines"]]))
        # (tensor groups of every size multiply the space by seven: a few sizes keep each example short)
        argv += draw(st.sampled_from([["--tp", "1"], ["--tp", "2", "--no-sequence-parallel"], ["--tp", "3"],
                                      ["--tp", "128"]]))
        argv += draw(_maybe("--optimizer-sharding", st.lists(st.sampled_from(["partition", "world", "nowhere"]),
                                                            min_size=1, max_size=2)))
        return argv
    for part in (
        _maybe("-p", st.lists(number(1, 2, 3, 4, 8, 16, huge=64), min_size=1, max_size=2 if sub == "simulate" else 1)),
        _maybe("-S", number(1, 2, 3, 4, huge=1024)), _maybe("-m", number(1, 2, 3, 4, 8, huge=4096)),
        _maybe("--chunks", number(1, 2, 3, huge=64)), _maybe("--tp", number(1, 2, 4, 8, huge=64)),
        _maybe("--schedule", st.sampled_from(["1f1b", "gpipe", "zb"])),
        _maybe("--optimizer-sharding", st.sampled_from(["auto", "partition", "world", "nowhere"])),
    ):
        argv += draw(part)
    argv += [f for f in ("--checkpoint", "--offload", "--flat") if draw(st.booleans())]
    if compare:
        argv.append("--compare-peers")
    return argv


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "bad.json").write_text('{"name": "half a cluster", "gpu": ')
    return d


@functools.cache
def _cached_trace(key, trace):
    return trace()


def _trace(args, cluster, *, symbolic=False):
    """``command._trace``, once per what shapes the trace (model, micro-batch, length, dtype, device)."""
    key = (args.model, args.micro_batch_size, args.seq, str(command._dtype(args, cluster)), cluster.gpu.device_type,
           symbolic)
    return _cached_trace(key, functools.partial(_real_trace, args, cluster, symbolic=symbolic))


_real_trace = command._trace


def run_main(argv: list[str], workdir) -> tuple[int, str, str]:
    if argv[0] in ("plan", "simulate") and "--out" not in argv:
        argv = [*argv, "--out" if argv[0] == "plan" else "--png", str(workdir / ("plan" if argv[0] == "plan" else "c.png"))]
    out, err = io.StringIO(), io.StringIO()
    start, here = time.perf_counter(), os.getcwd()
    if os.environ.get("MICSCOMPILE_CLI_LOG"):
        with open(os.environ["MICSCOMPILE_CLI_LOG"], "a") as log:
            log.write(f"start\t{' '.join(argv)}\n")
    os.chdir(workdir)  # (the cluster files are looked up from the working directory)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch.object(command, "_trace", _trace):
            code = command.main([str(a) for a in argv])
    except SystemExit as exc:  # (main returns; nothing may exit past it)
        code = ("SystemExit", exc.code)
    finally:
        os.chdir(here)
    if os.environ.get("MICSCOMPILE_CLI_LOG"):  # each example's command line, exit and time (for the longer run)
        with open(os.environ["MICSCOMPILE_CLI_LOG"], "a") as log:
            log.write(f"{code}\t{time.perf_counter() - start:.1f}\t{' '.join(argv)}\t{err.getvalue().strip()[-300:]}\n")
    return code, out.getvalue(), err.getvalue()


def _numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", line)]


def check_outputs(argv: list[str], out: str) -> None:
    """The invariants of a successful run: world = S * t * d * tp with d >= 1, step time, TFLOP/s and peak > 0,
    scaling efficiency <= 100%, a bubble <= 100% of the work."""
    sub = argv[0]
    if sub == "plan":
        m = re.search(r"^plan: n=(\d+) k=(\d+)(?: tp=(\d+))? p=(\d+) d=(\d+)(?: S=(\d+))?", out, re.M)
        assert m, out[-2000:]
        n, _, tp, p, d, stages = (int(g or 1) for g in m.groups())
        assert d >= 1 and n == stages * p * d * tp, m.group(0)
        pred = next(line for line in out.splitlines() if line.startswith("predicted: step"))
        step_ms = float(re.search(r"step ([\d.]+) (ms|s)", pred).group(1))
        tflops = float(re.search(r"([\d.]+) TFLOP/s per GPU", pred).group(1))
        peak = re.search(r"peak memory ([\d.]+) (\w+)", pred)
        assert step_ms > 0 and tflops > 0 and float(peak.group(1)) > 0, pred
        eff, bubble = re.search(r"scaling efficiency ([\d.]+)%", pred), re.search(r"pipeline bubble ([\d.]+)%", pred)
        assert (eff or bubble) and (not eff or 0 < float(eff.group(1)) <= 100), pred
        assert stages == 1 or bubble, pred  # (a pipeline's bubble: Megatron's (S-1)/m of the compute, any size)
    elif sub == "simulate" and "--compare-peers" not in argv:
        rows = [line.split() for line in out[out.index("step ms"):].splitlines()[2:] if line.strip()]
        world = int(re.search(r"^(\d+) x ", out, re.M).group(1))
        assert rows, out[-2000:]
        tp = int(argv[argv.index("--tp") + 1]) if "--tp" in argv else 1
        for p, stages, _, step_ms, tflops, _, peak, _ in rows:
            assert world % (int(p) * int(stages) * tp) == 0 and float(step_ms) > 0 and float(tflops) > 0 and float(peak) > 0
    elif sub == "simulate":
        assert "wrote" in out, out[-2000:]
    elif sub == "autotune":
        world = int(re.search(r"on (\d+) x ", out).group(1))
        table = out[out.index(" step s "):].splitlines()[2:]
        rows = [r.split() for r in table if r.strip() and r.split()[0].isdigit()]
        assert rows, out[-2000:]
        for r in rows:
            stages, _, tp, p, d, _, m = (int(x.rstrip("s")) for x in r[1:8])
            assert d >= 1 and stages * tp * p * d == world, r
            assert m >= stages, r  # a filled pipeline: Megatron's (S - 1) / m under 100% of its work
            step, tflops = float(r[-5].rstrip("~")), float(r[-4])
            bubble = r[-1]  # (simulated: with the hops of a tiny model's stages it may exceed (S - 1) / m)
            assert step > 0 and tflops > 0 and (bubble == "-" or float(bubble.rstrip("%")) >= 0), r


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=(Phase.explicit, Phase.generate),  # (a failing command line reads as found; shrinking took minutes)
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(argv=command_lines())
def test_every_command_line_ends_in_a_plan_or_one_clear_line(argv, workdir):
    code, out, err = run_main(argv, workdir)
    event(f"{argv[0]}: exit {code}" + (" (a bad argument)" if code == 2 and "argument" in err else ""))
    assert "Traceback" not in err + out, (argv, err[-3000:])
    assert code in (0, 2), (argv, code, err[-2000:])
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "error:" in lines[0], (argv, lines)
        assert "\r" not in err, (argv, err)  # no progress bar in front of it
    else:
        check_outputs(argv, out)


@pytest.mark.parametrize("argv, says", [
    (["plan", "gpt:13b", "--nodes", "0"], "--nodes: expected 1 to 65,536, got 0"),
    (["autotune", "gpt:13b", "--nodes", "2", "--global-batch-size", "7", "--tp", "1"], "the smallest that works is 16"),
    (["autotune", "gpt:13b", "--nodes", "2", "--global-batch-size", "1"], "tensor group of 8 ranks (a pipeline of S "
     "stages at least S micro-batches); the smallest that works is 2"),
    (["autotune", "gpt:tiny", "--nodes", "2", "--global-batch-size", "0"], "--global-batch-size: expected 1 to"),
    (["plan", "gpt:tiny", "--seq", "0"], "--seq: expected 1 to"),
    (["plan", "gpt:tiny", "--nodes", "-1"], "--nodes: expected 1 to 65,536, got -1"),
    (["simulate", "gpt:tiny", "-m", "x"], "--micro-batches: expected an integer from 1 to 4,096, got 'x'"),
    (["simulate", "gpt:tiny", "--cluster", "bad.json"], "bad.json is not a cluster file"),
    (["autotune", "gpt:tiny"], "the following arguments are required: --global-batch-size"),
], ids=["nodes-0", "batch-7", "batch-1-tensor", "batch-0", "seq-0", "nodes-neg", "m-text", "bad-json", "missing"])
def test_the_issues_commands_end_in_one_line_naming_what_is_valid(argv, says, workdir):
    """Five commands that once failed badly (a traceback, ten impossible plans, a traceback, a plan of a sequence of
    length 0, an empty list of valid sizes), and four more: each exits 2 before tracing, with one line."""
    code, out, err = run_main(argv, workdir)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and says in lines[0], (code, lines, out[-500:])
    assert "traced on meta" not in out  # refused before the trace


def test_the_autotuner_names_the_smallest_batch_its_space_takes():
    """A space narrowed to 4-stage pipelines of micro-batch 2 on 16 ranks: b * n / S = 8 must divide the batch
    and a pipeline needs m >= S, so 4 * 8 = 32 samples; 33 goes up to 40."""
    from micscompile.tune.search_space import configs, smallest_batch

    narrowed = dict(gpus_per_node=8, units=10, pipeline_stages=[4], micro_batch_sizes=[2])
    assert smallest_batch(16, 1, **narrowed) == 32 and smallest_batch(16, 33, **narrowed) == 40
    assert not configs(16, global_batch=39, **narrowed) and configs(16, global_batch=40, **narrowed)
    assert all(c.micro_batches >= c.stages for c in configs(16, global_batch=64, gpus_per_node=8, units=10))
    assert smallest_batch(16, 1, gpus_per_node=8, units=10, pipeline_stages=[32], micro_batch_sizes=[1]) is None


def test_a_cluster_refuses_no_nodes_and_a_file_that_is_not_one(tmp_path):
    from micscompile.cost_model.specs import ClusterError

    with pytest.raises(ClusterError, match="positive number of nodes, got 0"):
        Cluster.preset("p4d.24xlarge", nodes=0)
    (tmp_path / "c.json").write_text("[]")
    with pytest.raises(ClusterError, match="is not a cluster file"):
        Cluster.load(tmp_path / "c.json")
