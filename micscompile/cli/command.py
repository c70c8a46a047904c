"""The ``micscompile`` command (also ``python -m micscompile``).

    micscompile demo                                            # what `make demo` runs: 4 gloo ranks
    micscompile plan gpt:13b --cluster p4d.24xlarge --nodes 16  # Program summary + pictures
    micscompile simulate bert:52b --nodes 16 -p 8 64 128        # predictions side by side
    micscompile simulate bert:10b --compare-peers --nodes 2 4 8 16 32 64   # against ZeRO-3 and FSDP2
    micscompile autotune gpt:175b --cluster p4de.24xlarge --nodes 128 --global-batch-size 1536
    micscompile calibrate                                       # measure this machine

MODEL_SPEC is a preset (``gpt:13b``, ``bert:104b``, ``hf:llama-7b``, ...) or ``module:function``
returning (model, example_inputs, loss_fn) (``model_specs``). Everything but ``demo`` and
``calibrate`` traces on the meta device and prices with the cost model: no GPU, no process
group. A bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

DEMO_DEFAULTS = ["--partition-size", "2", "--micro-batches", "4", "--steps", "5", "--check"]
DTYPES = ("float32", "bfloat16", "float16")
MAX_NODES = 65536
"""Nodes a command prices (524,288 GPUs of 8): beyond any cluster built; the search's divisors stay fast."""
MAX_SEQ = 1 << 24
"""Tokens per sample: beyond any context length trained."""
MAX_STAGES, MAX_MICRO_BATCHES = 1024, 4096
"""A pipeline's schedule lists every rank's actions: S * m of them per chunk."""
MAX_BATCH = 1 << 16
"""Samples per micro-batch (``-b``) and per step (``--global-batch-size``, whose pipelines' m follows from it)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument ends in one line on stderr and status 2, like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def _count(what: str, most: int, least: int = 1):
    """An argparse type: an integer from ``least`` to ``most``, refused with the range in the message."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer from {least} to {most:,}, got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"expected {least} to {most:,}, got {value:,}")
        return value
    parse.__name__ = what
    return parse


def _say(msg: str) -> None:
    print(msg, flush=True)


# ---- calibrate and demo: real ranks under torchrun -------------------------------------------

def _torchrun(nproc: int, module: str, args: list[str]) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", module, *args]
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def _calibrate(args: argparse.Namespace) -> int:
    if "RANK" not in os.environ:  # not under torchrun yet: relaunch with --nproc ranks
        out = ["--out", args.out] if args.out else []
        return _torchrun(args.nproc, "micscompile", ["calibrate", *out, "--repeats", str(args.repeats)])
    import torch
    import torch.distributed as dist

    from micscompile.core.launch import init_distributed
    from micscompile.cost_model.calibrate import calibrate

    init_distributed(timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = dist.get_rank()
    cluster = calibrate(repeats=args.repeats, log=print if rank == 0 else None)
    if rank == 0:
        from micscompile.cost_model.specs import CALIBRATION_CACHE

        paths = [Path(args.out)] if args.out else [Path("local_cluster.json"), CALIBRATION_CACHE.expanduser()]
        for path in paths:  # the cache: what mc.compile schedules on here from now on
            path.parent.mkdir(parents=True, exist_ok=True)
            cluster.save(path)
            print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


def _demo(args: argparse.Namespace) -> int:
    return _torchrun(args.nproc, "micscompile.cli.demo", args.rest or DEMO_DEFAULTS)


# ---- plan, simulate, autotune: one meta trace, the cost model ----------------------------------

def _cluster(args: argparse.Namespace):
    from micscompile.cli.model_specs import SpecError
    from micscompile.cost_model.specs import Cluster

    if len(args.nodes) > 1 and not getattr(args, "compare_peers", False):
        raise SpecError(f"one --nodes (got {len(args.nodes)}); several are for `simulate --compare-peers`")
    if args.cluster.endswith(".json"):
        return Cluster.load(args.cluster).with_nodes(args.nodes[0])
    cluster = Cluster.preset(args.cluster, nodes=args.nodes[0])
    if cluster.era:  # (what a prediction on it stands for)
        _say(f"{cluster.name}: {cluster.era}")
    return cluster


def _dtype(args: argparse.Namespace, cluster):
    """--param-dtype, or the device's 16-bit format: bfloat16 where it has a bf16 peak, else float16."""
    import torch

    name = args.param_dtype or ("bfloat16" if "bfloat16" in cluster.gpu.peak_flops else "float16")
    return getattr(torch, name)


def _trace(args: argparse.Namespace, cluster, *, symbolic: bool = False):

    import micscompile as mc
    from micscompile.cli.model_specs import load
    from micscompile.trace import context_part

    t0 = time.perf_counter()
    tp = getattr(args, "tp", None) or 1  # (autotune: the sizes it searches, a list)
    model, example, loss_fn = load(args.model, micro_batch=max(args.micro_batch_size, 2 if symbolic else 1),
                                   seq_len=args.seq)
    example = context_part(example, getattr(args, "cp", 1), 0)  # (a context rank's tokens: what it traces)
    tg = mc.trace(model, example, loss_fn, param_dtype=_dtype(args, cluster), symbolic_batch=symbolic, progress=True,
                  device=cluster.gpu.device_type,  # the attention kernel the cluster's devices run
                  source_lines=max(tp if isinstance(tp, list) else [tp]) > 1)  # (where a tensor-parallel refusal points)
    _say(f"{args.model}: {tg.summary()}; traced on meta in {time.perf_counter() - t0:.1f} s")
    return tg


def _schedule(name: str, chunks: int) -> str:
    """``--schedule`` with ``--chunks``: v > 1 interleaves 1F1B and ZB-H1 (``Plan`` refuses the rest, saying why)."""
    return {"1f1b": "interleaved", "zb-h1": "interleaved-zb"}.get(name, name) if chunks > 1 else name


def _plans(args: argparse.Namespace, cluster) -> list:

    import micscompile as mc
    from micscompile.tune.partition import one_node

    sizes = args.partition_size or [one_node(mc.Plan(pipeline_stages=args.pipeline_stages,
                                                     tensor_parallel_size=args.tp), cluster)]
    sizes = sizes if isinstance(sizes, list) else [sizes]
    dtype = _dtype(args, cluster)
    return [mc.Plan(partition_size=p, tensor_parallel_size=args.tp, sequence_parallel=args.sequence_parallel,
                    context_parallel_size=args.cp, pipeline_stages=args.pipeline_stages,
                    micro_batches=args.micro_batches,
                    pipeline_schedule=_schedule(args.schedule, args.chunks),
                    pipeline_chunks=args.chunks if args.chunks > 1 else None,  # (zb-v: its own two)
                    checkpoint=args.checkpoint, offload_activations=args.offload,
                    hierarchical=False if args.flat else "auto", param_dtype=dtype, reduce_dtype=dtype,
                    optimizer_sharding=args.optimizer_sharding)
            for p in sizes]


def _plan(args: argparse.Namespace) -> int:
    import micscompile as mc
    from micscompile.cli import pictures
    from micscompile.core.collectives import fmt_bytes
    from micscompile.lowering.lowered import lower
    from micscompile.lowering.predict import concrete, model_buffer_bytes
    from micscompile.lowering.tensor_split import tensor_split
    from micscompile.tune.partition import choose_partition_size

    cluster = _cluster(args)
    plan = _plans(args, cluster)[0]
    rp = plan.resolve(cluster.world_size, cluster.gpus_per_node)  # a Plan that cannot work fails here
    tg = _trace(args, cluster)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # (once: every priced size shares it)
    trace = tensor_split(concrete(tg), plan.tensor_parallel_size, plan.sequence_parallel)
    choice = None
    if args.partition_size is None:  # priced, not assumed (tune.partition)
        choice = choose_partition_size(trace, plan, cluster, progress=_say)
        rp = choice.plan
    lowered = lower(trace, rp, cluster)  # once, as mc.compile lowers rank 0: its Program, prediction and buffers
    if choice is not None:
        for program in lowered.programs().values():
            program.note_choice(choice.why, first=True)
    comm, text = lowered.comm_stats(), str(lowered)
    rp = lowered.plan  # with what the lowering chose ("auto" optimizer sharding)
    pred = lowered.predict(cluster, buffer_bytes=model_buffer_bytes(trace), scaling=True)  # as mc.simulate
    buffers = lowered.rewrite_for_runtime(True)
    memory = mc.MemoryStats.of(buffers, None)
    _say(f"lowered and simulated in {time.perf_counter() - t0:.1f} s\n")
    if choice is not None:
        _say(f"{choice.why}\n{choice.table(cluster)}\n")
    _say(f"plan: {rp}\ncluster: {cluster.world_size} x {cluster.gpu.name} ({cluster.nodes} x {cluster.name})\n")
    _say(f"collectives of one step on rank 0 (ring wire bytes per rank):\n{comm}\n")
    intra = sum(r.intra_node_bytes for r in comm.rows.values())
    inter = sum(r.inter_node_bytes for r in comm.rows.values())
    _say(f"per step: {fmt_bytes(intra)} intra-node, {fmt_bytes(inter)} inter-node (through this node's NICs)\n")
    _say(f"predicted: {pred}\n")
    fits = "fits" if pred.fits(cluster) else \
        "does NOT fit (try --checkpoint, a larger -p, or `micscompile autotune`)"
    _say(f"peak memory {fmt_bytes(pred.peak_memory_bytes)} of {fmt_bytes(cluster.gpu.memory_bytes)}: {fits}")
    sp, ca = memory.step_plan, memory.caching_allocator
    _say(f"step buffers of one rank: static plan {fmt_bytes(sp.arena_bytes)} (lower bound L "
         f"{fmt_bytes(sp.lower_bound_bytes)}); PyTorch's caching allocator would reserve "
         f"{fmt_bytes(ca.peak_reserved_bytes)}\n")
    (out / "program.txt").write_text(text + "\n")
    pred.to_chrome_trace(out / "trace.json")
    title = f"{args.model}, {rp}, {cluster.world_size} x {cluster.gpu.name}"
    pictures.timeline_png(pred, out / "timeline.png", title=f"timeline: {title}")
    pictures.memory_png(buffers, out / "memory.png", title=f"memory: {title}")
    for name in ("program.txt", "trace.json", "timeline.png", "memory.png"):
        _say(f"wrote {out / name}")
    return 0


def _compare_peers(args: argparse.Namespace) -> int:
    from micscompile.cli import pictures
    from micscompile.tune.compare import check_nodes, compare_peers, format_table

    check_nodes(args.nodes)  # before the trace
    cluster = _cluster(args)
    plan = _plans(args, cluster)[0]
    tg = _trace(args, cluster)
    t0 = time.perf_counter()
    rows = compare_peers(tg, cluster, args.nodes, plan, partition_sizes=args.partition_size, progress=_say)
    _say(f"{args.model} on {cluster.name} nodes, {plan.micro_batches} micro-batch(es) of {args.micro_batch_size}, "
         f"priced in {time.perf_counter() - t0:.1f} s")
    _say(format_table(rows))
    path = pictures.save(pictures.compare_figure(rows, f"{args.model} on {cluster.name}"), args.png)
    _say(f"wrote {path}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    import micscompile as mc

    if args.compare_peers:
        return _compare_peers(args)
    cluster = _cluster(args)
    plans = _plans(args, cluster)
    for plan in plans:
        plan.resolve(cluster.world_size, cluster.gpus_per_node)
    tg = _trace(args, cluster)
    cap = cluster.gpu.memory_bytes
    _say(f"{cluster.world_size} x {cluster.gpu.name} ({cluster.nodes} x {cluster.name}), {cap / 2**30:.0f} GiB each; "
         + (f"step times +-{cluster.prediction_error:.0%} (held-out error on this cluster)" if cluster.prediction_error
            else "no held-out error for this cluster"))
    head = f"{'p':>5}{'S':>4}{'m':>5}{'step ms':>12}{'TFLOP/s':>9}{'exposed ms':>12}{'peak GiB':>10}{'fits':>6}"
    _say(head + "\n" + "-" * len(head))
    for plan in plans:
        pred = mc.simulate(tg, plan, cluster)
        _say(f"{plan.partition_size:>5}{plan.pipeline_stages:>4}{plan.micro_batches:>5}{pred.step_time_s * 1e3:>12.1f}"
             f"{pred.tflops_per_gpu:>9.3g}{pred.exposed_comm_s * 1e3:>12.1f}{pred.peak_memory_bytes / 2**30:>10.2f}"
             f"{'yes' if pred.peak_memory_bytes <= cap else 'no':>6}")
    return 0


def _autotune(args: argparse.Namespace) -> int:
    import micscompile as mc
    from micscompile.tune.search_space import TENSOR_SIZES, check_global_batch, tensor_choices

    cluster = _cluster(args)
    tensor = tensor_choices(args.tp or TENSOR_SIZES, args.sequence_parallel)
    check_global_batch(cluster.world_size, args.global_batch_size, tensor, cluster.gpus_per_node)  # before the trace
    tg = _trace(args, cluster, symbolic=True)
    t0 = time.perf_counter()
    ranked = mc.autotune(tg, cluster, global_batch_size=args.global_batch_size, top=args.top,
                         pipeline_stages=None if args.pipelines else (1,), optimizer_sharding=args.optimizer_sharding,
                         tensor=tensor, workers=args.workers, zero_bubble=(False, True) if args.zero_bubble else (False,),
                         exhaustive=args.exhaustive)
    _say(f"searched {len(ranked)} candidates in {time.perf_counter() - t0:.1f} s")
    if not ranked[0].feasible:
        from micscompile.core.plan import PlanError

        raise PlanError(f"none of the {len(ranked)} plans fits a {cluster.gpu.name} ({ranked[0].reason}); try more "
                        "--nodes, a smaller -b or --seq, or a device with more memory")
    return 0


# ---- argument parsing --------------------------------------------------------------------------

def _model_args(sp: argparse.ArgumentParser) -> None:
    from micscompile.cost_model.specs import PRESETS

    sp.add_argument("model", metavar="MODEL_SPEC",
                    help="a preset (gpt:1.3b, gpt:13b, gpt:175b, bert:10b, bert:52b, bert:104b, hf:llama-7b, ...; "
                         "see micscompile.cli.model_specs) or module:function returning (model, example_inputs, loss_fn)")
    sp.add_argument("--seq", type=_count("--seq", MAX_SEQ), default=None,
                    help="sequence length of a preset (default: the preset's)")
    sp.add_argument("-b", "--micro-batch-size", type=_count("-b", MAX_BATCH), default=1,
                    help="samples per micro-batch of a preset")
    sp.add_argument("--param-dtype", choices=DTYPES, default=None,
                    help="dtype of gathers and compute, fp32 master weights (default: bfloat16 where the "
                         "device has it, else float16)")
    sp.add_argument("--cluster", default="p4d.24xlarge",
                    help=f"a preset ({', '.join(sorted(PRESETS))}) or a calibrated cluster .json")
    sp.add_argument("--nodes", type=_count("--nodes", MAX_NODES), nargs="+", default=[1],
                    help="nodes of the cluster (several: simulate --compare-peers, one column each)")


def _plan_args(sp: argparse.ArgumentParser, several: bool) -> None:
    sp.add_argument("-p", "--partition-size", type=_count("-p", MAX_NODES * 64), nargs="+" if several else None,
                    default=None,
                    help="p: ranks that shard one copy of the model states a rank holds (the model, or its stage when "
                         "-S > 1); default: "
                         + ("one node; several: one row each" if several else
                            "priced: one node unless a power of two that fits is 5%% faster"))
    sp.add_argument("--tp", "--tensor-parallel-size", type=_count("--tp", 64), default=1, dest="tp",
                    help="tensor-parallel ranks inside a node splitting each layer (Megatron-LM's); -p then counts "
                         "tensor groups")
    sp.add_argument("--sequence-parallel", action="store_true",
                    help="with --tp > 1: the activations between the split matmuls split along the sequence "
                         "(Megatron-LM's sequence parallelism)")
    sp.add_argument("--cp", "--context-parallel-size", type=_count("--cp", 1024), default=1, dest="cp",
                    help="context-parallel ranks sharing each sequence, each 1/cp of it (Ulysses; the model is "
                         "traced on seq/cp tokens)")
    sp.add_argument("-S", "--pipeline-stages", type=_count("-S", MAX_STAGES), default=1, help="MiCS-Pipe stages S")
    sp.add_argument("-m", "--micro-batches", type=_count("-m", MAX_MICRO_BATCHES), default=1,
                    help="s: micro-batches each rank runs per optimizer step (gradient accumulation; what flows "
                         "through a pipeline when -S > 1)")
    sp.add_argument("--schedule", choices=("1f1b", "gpipe", "zb-h1", "zb-v"), default="1f1b",
                    help="pipeline schedule (zb-h1 and zb-v: zero bubble, each backward split into input and weight "
                         "gradients; zb-h1 with --chunks > 1: interleaved zero bubble)")
    sp.add_argument("--chunks", type=_count("--chunks", 64), default=1,
                    help="v: interleaved 1F1B (or zero bubble) with this many chunks per rank (zb-v has its own 2)")
    sp.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    sp.add_argument("--offload", action="store_true", help="offload checkpointed activations to host memory")
    sp.add_argument("--flat", action="store_true", help="flat gathers across nodes (no hierarchical)")
    sp.add_argument("--optimizer-sharding", choices=("auto", "partition", "world"), default="auto",
                    help="optimizer states over the partition group, or over all p*d ranks (asymmetric); "
                         "auto: priced, world where it is 5%% faster or alone fits")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="micscompile", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n\n")[1].splitlines()))
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="train a small GPT on 4 local gloo ranks against eager PyTorch",
                          description="Launch micscompile.cli.demo under torchrun; arguments after `--` go to it "
                                      f"(default: {' '.join(DEMO_DEFAULTS)}; see python -m micscompile.cli.demo -h).")
    demo.add_argument("--nproc", type=_count("--nproc", 1024), default=4, help="local ranks")
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for micscompile.cli.demo")
    plan = sub.add_parser("plan", help="trace on meta, lower one plan, print its Program summary, write pictures")
    _model_args(plan)
    _plan_args(plan, several=False)
    plan.add_argument("--out", default="micscompile-plan",
                      help="directory for program.txt, trace.json (Perfetto), timeline.png, memory.png")
    sim = sub.add_parser("simulate", help="predict step time, TFLOP/s and peak memory of one or more plans")
    _model_args(sim)
    _plan_args(sim, several=True)
    sim.add_argument("--compare-peers", action="store_true",
                     help="micscompile's best partition size against DeepSpeed ZeRO-3 and FSDP2 (full shard, HSDP) "
                          "at each --nodes: a table and a picture")
    sim.add_argument("--png", default="compare-peers.png", help="--compare-peers: where to write the picture")
    tune = sub.add_parser("autotune", help="search partition size, stages, micro-batch size and memory options")
    _model_args(tune)
    tune.add_argument("--global-batch-size", type=_count("--global-batch-size", MAX_BATCH), required=True,
                      help="samples per optimizer step")
    tune.add_argument("--top", type=_count("--top", 10_000), default=10, help="rows of the printed table")
    tune.add_argument("--optimizer-sharding", nargs="+", choices=("partition", "world"), default=["partition", "world"],
                      help="where the optimizer states may live: over the partition group, over all p*d ranks")
    tune.add_argument("--pipelines", action=argparse.BooleanOptionalAction, default=True,
                      help="search pipeline stages too")
    tune.add_argument("--tp", type=_count("--tp", 64), nargs="+", default=None, dest="tp",
                      help="tensor group sizes to search (default: 1 2 4 8, those dividing a node)")
    tune.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                      help="search each tensor group size > 1 with sequence parallelism too")
    tune.add_argument("--zero-bubble", action=argparse.BooleanOptionalAction, default=True,
                      help="search each pipeline with a zero-bubble schedule too (ZB-H1, interleaved zero bubble)")
    tune.add_argument("--workers", type=_count("--workers", 256), default=None,
                      help="processes pricing the tensor groups' candidates side by side, forked (default: the cores "
                           "this process may use, on Linux; 1 elsewhere; the same table with any number)")
    tune.add_argument("--exhaustive", action="store_true",
                      help="simulate every candidate (default: best first, skipping those whose floor cannot beat "
                           "the top ones or their family's best; the same table)")
    cal = sub.add_parser("calibrate", help="measure compute and collectives on this machine; write a cluster JSON")
    cal.add_argument("--nproc", type=_count("--nproc", 1024), default=4, help="ranks to measure with (when not under torchrun)")
    cal.add_argument("--out", default=None, help="where to write the calibrated cluster (default: ./local_cluster.json "
                     "and ~/.cache/micscompile/local_cluster.json, which mc.compile's default schedule reads)")
    cal.add_argument("--repeats", type=_count("--repeats", 1000), default=7, help="timed repeats per measurement (median)")
    return ap


COMMANDS = {"demo": _demo, "plan": _plan, "simulate": _simulate, "autotune": _autotune, "calibrate": _calibrate}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # -h (0), or a bad argument (2: one line on stderr, _Parser.error)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command == "demo" and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    from micscompile.cli.model_specs import SpecError
    from micscompile.core.plan import PlanError
    from micscompile.cost_model.specs import ClusterError
    from micscompile.trace import TraceError

    try:
        return COMMANDS[args.command](args)
    except (SpecError, PlanError, ClusterError, TraceError, FileNotFoundError) as exc:
        print(f"micscompile {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
