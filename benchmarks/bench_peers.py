"""Head to head: micscompile against FSDP2 (full shard, HSDP), DeepSpeed ZeRO-3 and DDP.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_peers.py

Same GPT, same ranks, same batches, same AdamW (micscompile steps it by torch's fused kernel, the
peers by torch's default), one launch; the 4 gloo ranks (CPU) are
taken as 2 nodes of 2 (``--gpus-per-node``) for the inter-node bytes and for
micscompile's hierarchical gathers. Systems are grouped by partition size p (how many
ranks shard one replica): p=1 DDP, p=2 FSDP2 HSDP (2 replicas x 2 shards, the shard
group inside a node), p=4 FSDP2 full shard and DeepSpeed ZeRO-3; micscompile runs each p
with its default schedule (``mc.compile`` given this machine's own cluster in nodes of ``--gpus-per-node``: its
calibration or the built-in CPU estimate), and p=4, which spans both nodes, also with
hierarchical gathers forced. For every micro-batch count s:

- step: the median over ``--steps`` steps of the slowest rank (barrier before each), the
  fastest of ``--rounds`` such measurements (every row measured in turn, every other round in
  reverse order: a launch's first measurement runs ~5% slow, and the machine drifts);
  ``/mc``: the system's step time over micscompile's at the same (p, s) (> 1: micscompile
  is faster);
- bytes/rank and inter-node/rank: measured, for one step, by ``measure.CommCounter`` on
  every c10d collective the system issued (ring bytes; mean over ranks);
- peak/rank: ``measure.LiveBytes``'s peak from building the system through its first step
  (max over ranks).

Gradient accumulation for the peers is what their docs recommend: DDP skips the all-reduce
(``no_sync``) except on the last micro-batch; FSDP2 reduces every micro-batch by default;
"AR last" is FSDP2's own ``set_requires_all_reduce(False)`` until the last micro-batch (the
idea of MiCS's 2-hop sync); DeepSpeed accumulates ``gradient_accumulation_steps`` itself.
DeepSpeed runs on its CPU accelerator (``DS_ACCELERATOR=cpu``) with torch's AdamW and
``stage3_param_persistence_threshold=0``: every parameter sharded, as in the others.

``--predict`` also calibrates this machine first (same launch) and prices each row the simulator
has a model for (micscompile's rows; FSDP2 and DeepSpeed ZeRO-3 by their peer models,
``mc.simulate(..., system=...)``, with the same DeepSpeed config), the graph profiled on the
ranks just before each measurement, as ``bench_cost_model.py`` does: predicted step and error. The
peers' own runtime (hooks, copies, optimizer over their parameter types) is measured first, each
rank training alone in a one-rank group (``host_overheads``), and priced on the compute stream.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import os
import statistics

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from measure import CommCounter, LiveBytes, max_over_ranks, mean_over_ranks
from timing import interleaved_times_s, median_step_s
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import micscompile as mc
from micscompile.core.collectives import fmt_bytes
from micscompile.core.launch import step_device
from micscompile.core.optim import prefer_fused
from micscompile.cost_model.calibrate import calibrate
from micscompile.cost_model.specs import default_cluster
from micscompile.tune.profile import profile_trace
from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss

SYSTEMS = [  # (name, partition size): micscompile's default schedule first in each group
    ("micscompile p=1", 1), ("DDP (no_sync)", 1),
    ("micscompile p=2 (2-hop)", 2), ("micscompile p=2, optim. world", 2), ("FSDP2 HSDP 2x2", 2),
    ("FSDP2 HSDP 2x2, AR last", 2),
    ("micscompile p=4", 4), ("micscompile p=4, hierarchical", 4), ("FSDP2 full shard", 4),
    ("DeepSpeed ZeRO-3", 4),
]
PEER_MODELS = {  # row -> (mc.simulate's system, peer_config): the rows a model prices
    "FSDP2 HSDP 2x2": ("fsdp2", None), "FSDP2 full shard": ("fsdp2", None),
    "DeepSpeed ZeRO-3": ("deepspeed-zero3", {"stage3_param_persistence_threshold": 0}),
}
PEER_TOLERANCE = 0.15
"""The peer models predict the measured step times within 15% on this machine."""
HIERARCHICAL = "hierarchical"
"""The row that forces hierarchical gathers (the default, "auto", prices them per bucket)."""
HSDP_GOAL = 0.7
"""micscompile p=2 at s=4 at most 0.7x FSDP2 HSDP's step."""


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def eager_step(model, opt, micro_batches, x, y, *, sync_ctx=None, before_last=None):
    """One optimizer step with gradient accumulation for an eager (hook-based) peer; the loss summed on
    the device and read once, after the optimizer step (a read per micro-batch makes a GPU's host wait)."""
    total = 0
    for j, (xb, yb) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        last = j == micro_batches - 1
        if before_last is not None:
            before_last(last)
        ctx = sync_ctx() if (sync_ctx is not None and not last) else contextlib.nullcontext()
        with ctx:
            loss = lm_loss(model(xb), yb) / micro_batches
            loss.backward()
        total = total + loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(total)


class _OneRank:
    """DeepSpeed's model-parallel unit that makes a rank's data-parallel group itself alone."""

    def __init__(self, group):
        self.group = group

    def get_data_parallel_group(self):
        return self.group

    get_model_parallel_group = get_tensor_model_parallel_group = get_data_parallel_group

    def get_data_parallel_world_size(self):
        return 1

    get_model_parallel_world_size = get_tensor_model_parallel_world_size = get_data_parallel_world_size

    def get_data_parallel_rank(self):
        return 0

    get_model_parallel_rank = get_tensor_model_parallel_rank = get_data_parallel_rank


def deepspeed_step(model, s: int, batch_per_rank: int, alone=None):
    """DeepSpeed ZeRO-3's step; ``alone``: a one-rank group this rank trains in by itself."""
    import deepspeed  # imported here: the other systems run without it

    config = {"train_micro_batch_size_per_gpu": batch_per_rank // s, "gradient_accumulation_steps": s,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=config,
                                      dist_init_required=False, mpu=None if alone is None else _OneRank(alone))
    if alone is not None and engine.dp_world_size != 1:
        raise RuntimeError(f"DeepSpeed alone on one rank runs data-parallel over {engine.dp_world_size}")

    def step(x, y):
        total = 0.0
        for xb, yb in zip(x.chunk(s), y.chunk(s)):
            loss = lm_loss(engine(xb), yb)
            engine.backward(loss)  # scaled by 1 / s inside
            engine.step()  # steps the optimizer at the accumulation boundary only
            total += float(loss.detach()) / s
        return total

    return step


def _nodes(cluster: mc.Cluster, k: int) -> mc.Cluster:
    """``cluster`` as the emulated nodes of ``k`` ranks each (what the Plan's groups cross)."""
    return dataclasses.replace(cluster, nodes=cluster.world_size // k, gpus_per_node=k)


def _plan(system: str, p: int, s: int) -> mc.Plan:
    """micscompile's Plan for a row: the default schedule, hierarchical gathers forced, or the optimizer
    states over all ranks."""
    return mc.Plan(partition_size=p, micro_batches=s, hierarchical=True if HIERARCHICAL in system
                   else "auto", optimizer_sharding="world" if "optim. world" in system else "partition")


class Autocast(torch.nn.Module):
    """``model`` with its forward under ``torch.autocast`` in ``dtype`` on its device (a peer's low precision:
    fp32 weights, low-precision matmuls)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.model(x)


def build(system: str, model: GPT, p: int, s: int, k: int, example, batch_per_rank: int,
          dtype: torch.dtype = torch.float32):
    """Returns step(x, y) for one system, on this rank's device (``step_device``: the CPU on gloo, its GPU
    on NCCL, as ``bench_gpu.py`` runs the peers); ``dtype`` (a peer's: DDP under ``Autocast``, FSDP2 by its
    ``MixedPrecisionPolicy`` with fp32 reductions) below fp32: mixed precision."""
    world = dist.get_world_size()
    if system.startswith("micscompile"):
        device = step_device()
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        cluster = default_cluster(device.type, name, world, k)  # (mc.compile's own, in nodes of k)
        step = mc.compile(model, _plan(system, p, s), loss_fn=lm_loss, optimizer=adamw, example_inputs=example,
                          cluster=cluster)
        return lambda x, y: float(step(x, y))
    device = step_device()
    model = copy.deepcopy(model).to(device)
    low = dtype != torch.float32
    if system.startswith("DeepSpeed"):
        return deepspeed_step(model, s, batch_per_rank)
    if system.startswith("DDP"):
        ddp = DDP(Autocast(model, dtype) if low else model)
        opt = adamw(ddp.parameters())
        return lambda x, y: eager_step(ddp, opt, s, x, y, sync_ctx=ddp.no_sync)
    if system.startswith("FSDP2 HSDP"):
        mesh = init_device_mesh(device.type, (world // p, p), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if low else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = adamw(model.parameters())
    if system.endswith("AR last"):
        return lambda x, y: eager_step(model, opt, s, x, y, before_last=model.set_requires_all_reduce)
    return lambda x, y: eager_step(model, opt, s, x, y)


def host_overheads(model: GPT, args, batches) -> dict[str, tuple[float, float]]:
    """Per peer model ("fsdp2", "deepspeed-zero3"): (seconds per micro-step, seconds per step) its
    runtime adds to the same model's eager step on this machine, none of it communication: each rank
    trains alone in a one-rank group, every rank at once (the cores shared as in the bench), the
    peer's step timed in alternation with the eager one. What it adds: its hooks, its copies between
    flat buffers and parameters, its optimizer over its own parameter types beyond the eager step's,
    which runs as micscompile's does (torch's fused AdamW, ``core.optim.prefer_fused``: what the
    calibrated optimizer cost prices). T_peer(s) - T_eager(s) = s * per micro-step + per step, fitted
    over the ``--micro-batches`` counts."""
    world = dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)][dist.get_rank()]  # (every rank creates every group)
    mesh = DeviceMesh.from_group(alone, "cpu")
    extra: dict[str, list[tuple[int, float]]] = {"fsdp2": [], "deepspeed-zero3": []}
    for s in args.micro_batches:
        eager, sharded = copy.deepcopy(model), copy.deepcopy(model)
        for block in sharded.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        opt_e, opt_s = adamw(eager.parameters()), adamw(sharded.parameters())
        prefer_fused(opt_e)  # the optimizer as micscompile's step runs it, which calibration prices
        steps = {"eager": lambda x, y, m=eager, o=opt_e, s=s: eager_step(m, o, s, x, y),
                 "fsdp2": lambda x, y, m=sharded, o=opt_s, s=s: eager_step(m, o, s, x, y),
                 "deepspeed-zero3": deepspeed_step(copy.deepcopy(model), s, args.batch_per_rank, alone)}
        rounds = batches[: args.warmup] + 2 * batches[args.warmup:]  # (twice the bench's steps: a difference of two times)
        times = {k: statistics.median(v) for k, v in interleaved_times_s(steps, rounds, args.warmup).items()}
        for name in extra:
            extra[name].append((s, times[name] - times["eager"]))
    out = {}
    for name, points in extra.items():
        if len(points) == 1:
            (s, d), = points
            out[name] = (max(d / s, 0.0), 0.0)
            continue
        ms = statistics.mean(s for s, _ in points)
        md = statistics.mean(d for _, d in points)
        per_micro = sum((s - ms) * (d - md) for s, d in points) / sum((s - ms) ** 2 for s, _ in points)
        out[name] = (max(per_micro, 0.0), max(md - per_micro * ms, 0.0))
    return out


def predict(system: str, p: int, s: int, args, trace, cluster, host: dict[str, tuple[float, float]]) -> float | None:
    """The predicted step of one row on the calibrated ``cluster`` (None: no model for it); ``host``:
    the peers' runtime time, ``host_overheads`` (it includes their copy-outs)."""
    plan, cluster = _plan(system, p, s), _nodes(cluster, args.gpus_per_node)
    if system.startswith("micscompile"):
        return mc.simulate(trace, plan, cluster).step_time_s
    if system not in PEER_MODELS:
        return None
    name, config = PEER_MODELS[system]
    per_micro, per_step = host.get(name, (0.0, 0.0))
    return mc.simulate(trace, plan, cluster, system=name, peer_config=config, copy_out_ops=None,
                       host_per_micro_step_s=per_micro, host_per_step_s=per_step).step_time_s


def measure(system: str, p: int, s: int, args, model: GPT, batches, trace=None, cluster=None, host=None) -> dict:
    predicted = None
    if cluster is not None:  # every rank at once, just before the run (a shared machine's speed drifts)
        profile_trace(trace, micro_batches=s)
        predicted = predict(system, p, s, args, trace, cluster, host or {})
    with LiveBytes() as live:
        step = build(system, model, p, s, args.gpus_per_node, batches[0], args.batch_per_rank)
        step(*batches[0])
    t, loss = median_step_s(step, batches, args.warmup)
    with CommCounter(args.gpus_per_node) as counter:
        step(*batches[-1])
    if not system.startswith("micscompile"):
        loss = mean_over_ranks(loss)  # peers return this rank's loss; micscompile the global mean
    return {"step": t, "loss": loss, "bytes": mean_over_ranks(counter.total()),
            "inter": mean_over_ranks(counter.total_inter_node()), "peak": max_over_ranks(live.peak_bytes),
            "predicted": predicted}


def print_table(results: dict, systems: list[tuple[str, int]], args, cfg: GPTConfig, n_params: int, world: int) -> None:
    print(f"GPT {cfg.layers} layers h={cfg.hidden} seq {cfg.seq_len} ({n_params / 1e6:.1f}M params, fp32), "
          f"{world} gloo ranks (CPU) as {world // args.gpus_per_node} nodes x {args.gpus_per_node}, "
          f"{args.batch_per_rank} samples/rank, AdamW; step = median of {args.steps} steps (slowest rank), "
          f"fastest of {args.rounds} rounds")
    predicted = any(r.get("predicted") is not None for r in results.values())
    head = (f"{'system':<32}{'p':>3}{'s':>3}{'step':>10}{'/mc':>7}{'bytes/rank':>13}{'inter-node':>13}"
            f"{'peak/rank':>13}{'loss':>9}" + (f"{'predicted':>11}{'error':>8}" if predicted else ""))
    print(head)
    print("-" * len(head))
    for s in args.micro_batches:
        for system, p in systems:
            r, ours = results[(system, s)], results[(next(n for n, q in systems if q == p), s)]
            pred = ""
            if predicted:
                pred = (f"{r['predicted']:>9.3f} s{(r['predicted'] - r['step']) / r['step']:>+8.1%}"
                        if r.get("predicted") is not None else f"{'-':>11}{'-':>8}")
            print(f"{system:<32}{p:>3}{s:>3}{r['step']:>8.3f} s{r['step'] / ours['step']:>6.2f}x"
                  f"{fmt_bytes(r['bytes']):>13}{fmt_bytes(r['inter']):>13}{fmt_bytes(r['peak']):>13}{r['loss']:>9.4f}"
                  + pred)
    print("/mc > 1: micscompile is faster at the same (p, s). inter-node: bytes a rank sends to the other node "
          "(ring order). loss: last step's global mean (same data for all).")
    def default(p: int, s: int) -> float:  # the first micscompile row of each p: its default schedule
        return results[(next(n for n, q in systems if q == p and n.startswith("micscompile")), s)]["step"]

    slower = [(sy, s) for s in args.micro_batches for sy, p in systems
              if not sy.startswith("micscompile") and results[(sy, s)]["step"] < default(p, s)]
    print("goal, micscompile's default step at or below every peer's at the same (p, s): "
          + ("met" if not slower else f"NOT met for {slower}"))
    for hsdp in (n for n, _ in systems if n.startswith("FSDP2 HSDP")):
        if 4 in args.micro_batches and ("micscompile p=2 (2-hop)", 4) in results:
            ratio = results[("micscompile p=2 (2-hop)", 4)]["step"] / results[(hsdp, 4)]["step"]
            print(f"goal, s=4: micscompile p=2 at most {HSDP_GOAL}x {hsdp}: {ratio:.2f}x, "
                  + ("met" if ratio <= HSDP_GOAL else "NOT met"))
    if predicted:
        errs = {(sy, s): (results[(sy, s)]["predicted"] - results[(sy, s)]["step"]) / results[(sy, s)]["step"]
                for s in args.micro_batches for sy, _ in systems
                if sy in PEER_MODELS and results[(sy, s)].get("predicted") is not None}
        off = {k: f"{v:+.1%}" for k, v in errs.items() if abs(v) > PEER_TOLERANCE}
        print(f"goal, the peer models within {PEER_TOLERANCE:.0%} of the measured step: "
              + (f"met ({len(errs)} rows)" if not off else f"NOT met for {off} ({len(errs) - len(off)} of {len(errs)})"))
    if not all(name in {n for n, _ in systems} for name in ("micscompile p=2 (2-hop)", "FSDP2 HSDP 2x2",
                                                            "micscompile p=4, hierarchical", "FSDP2 full shard")):
        return
    for s in args.micro_batches:
        ours, hsdp = results[("micscompile p=2 (2-hop)", s)]["inter"], results[("FSDP2 HSDP 2x2", s)]["inter"]
        print(f"goal, s={s}: inter-node bytes micscompile p=2 {fmt_bytes(ours)} vs FSDP2 HSDP {fmt_bytes(hsdp)}: "
              + ("strictly fewer" if ours < hsdp else "not fewer (2-hop saves only when s > 1)"))
        ours4, full = results[("micscompile p=4, hierarchical", s)]["inter"], results[("FSDP2 full shard", s)]["inter"]
        print(f"goal, s={s}: inter-node bytes micscompile p=4 hierarchical {fmt_bytes(ours4)} vs FSDP2 full shard "
              f"{fmt_bytes(full)}: " + ("strictly fewer" if ours4 < full else "not fewer"))


def main() -> None:
    ap = argparse.ArgumentParser(description="micscompile vs FSDP2 / DeepSpeed ZeRO-3 / DDP: time, bytes, memory")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=2, help="ranks per (emulated) node")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2,
                    help="measure every row this many times (alternate rounds in reverse order); report the fastest")
    ap.add_argument("--skip", nargs="*", default=[], help="leave out systems whose name starts with these")
    ap.add_argument("--predict", action="store_true",
                    help="calibrate this machine first and print each row's predicted step (the peer models)")
    args = ap.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = GPTConfig(seq_len=args.seq, layers=args.layers, hidden=args.hidden)
    torch.manual_seed(0)
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(rank)
    batches = [lm_batch(cfg, args.batch_per_rank, gen) for _ in range(args.warmup + args.steps)]
    systems = [(n, p) for n, p in SYSTEMS if not any(n.startswith(x) for x in args.skip)]
    cluster, host = None, None
    if args.predict:
        cluster = calibrate(log=print if rank == 0 else None)
        host = host_overheads(model, args, batches)
        if rank == 0:
            print("peers' runtime beyond eager, alone on a rank (host_overheads): " + ", ".join(
                f"{k} {a * 1e3:.1f} ms per micro-step + {b * 1e3:.1f} ms per step" for k, (a, b) in host.items()))
    results = {}
    for s in args.micro_batches:
        trace = None
        if cluster is not None:  # one trace per micro-batch shape, the gloo ranks' kernels
            with torch.device("meta"):
                meta_model = GPT(cfg)
            trace = mc.trace(meta_model, tuple(t[: args.batch_per_rank // s] for t in batches[0]), lm_loss,
                             device="cpu")
        for round_ in range(args.rounds):  # the second in reverse order: drift reaches every row alike
            for system, p in systems if round_ % 2 == 0 else systems[::-1]:
                r = measure(system, p, s, args, model, batches, trace, cluster if round_ == 0 else None, host)
                if rank == 0:
                    print(f"  measured {system}, s={s}, round {round_ + 1}: {r['step']:.3f} s/step", flush=True)
                best = results.setdefault((system, s), r)
                best["step"] = min(best["step"], r["step"])
    if rank == 0:
        print_table(results, systems, args, cfg, sum(t.numel() for t in model.parameters()), world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
