"""Accuracy of the cost model: predicted vs measured step time on the local ranks.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_cost_model.py

Calibrates the machine first (same launch), then for each configuration profiles
the meta-device trace's graph on every rank (profile mode), compiles and times real
steps (median over steps of the slowest rank), and predicts the same step with
``mc.simulate`` on the calibrated cluster. ``--no-profile`` prices ops with the
calibrated roofline instead. ``--collective-waits``: then, per configuration, what each collective
costs its rank inside the step (issue to the end of its wait, by kind and group) against
what the calibrated model prices it alone; with ``--prefetch 0`` a gather is waited at once, so
that is its in-step cost (a reduce-scatter's or a second hop's span includes the compute before
its wait); a gather issued while a reduce-scatter of its group is issued and not yet waited is
counted apart ("a reduce-scatter in flight"). ``--split-local``: then, per configuration, the same
step run again with every collective's communication taken out (``local_copies``) and priced with every
collective free, which splits the error into the step's local work and its communication.
``--models``: a subset. On 2 ranks (``--nproc-per-node 2``: one per core here) p = 1 and 2 run, in
about 2 minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import statistics
import time
from collections import defaultdict
from unittest import mock

import torch
import torch.distributed as dist
from timing import median_step_s

import micscompile as mc
from micscompile.core.launch import local_world_size
from micscompile.cost_model.calibrate import calibrate
from micscompile.cost_model.collective_time import collective_time_s
from micscompile.cost_model.node_cost import META_TIME_S
from micscompile.lowering.lowered import lower
from micscompile.lowering.predict import concrete
from micscompile.tune.profile import profile_trace
from micscompile.zoo.models import GPT, GPTConfig, lm_batch, lm_loss

MODELS = {
    "gpt-small": GPTConfig(vocab_size=512, seq_len=64, layers=2, hidden=128),
    "gpt-medium": GPTConfig(vocab_size=512, seq_len=64, layers=4, hidden=256),
}


@contextlib.contextmanager
def collective_waits(cluster: mc.Cluster):
    """Wrap the collectives the runtime issues (``dist.all_gather_single``, ``reduce_scatter_single``,
    ``all_reduce``): per (kind, this rank's group), [calls, seconds from issue to the end of the wait (a
    gather waited at once: its in-step duration), seconds the calibrated model prices them alone]."""
    seen: dict[tuple[str, tuple[int, ...]], list] = defaultdict(lambda: [0, 0.0, 0.0, []])
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single", "all_reduce")}
    unwaited: dict[tuple[int, ...], set] = defaultdict(set)  # a group's reduce-scatters issued, not yet waited

    class Timed:
        def __init__(self, work, row, t0, ranks):
            self.work, self.row, self.t0, self.ranks = work, row, t0, ranks

        def wait(self, *args, **kwargs):
            try:
                return self.work.wait(*args, **kwargs)
            finally:
                done = time.perf_counter()
                unwaited[self.ranks].discard(self)
                self.row[1] += done - self.t0
                self.row[3].append((self.t0, done))

        def __getattr__(self, name):
            return getattr(self.work, name)

    def wrap(name, fn):
        kind = name.removesuffix("_single")
        def issue(out, *args, group=None, async_op=False, **kwargs):
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else \
                tuple(range(dist.get_world_size()))
            full = out if kind != "reduce_scatter" else args[0]  # the full buffer the model prices
            beside = " (a reduce-scatter in flight)" if kind == "all_gather" and unwaited[ranks] else ""
            row = seen[(kind + beside, ranks)]  # (a partition group apart from a replication group of its size)
            row[0] += 1
            row[2] += collective_time_s(kind, full.numel() * full.element_size(), ranks, cluster)
            t0 = time.perf_counter()
            work = fn(out, *args, group=group, async_op=async_op, **kwargs)
            if work is None:
                done = time.perf_counter()
                row[1] += done - t0
                row[3].append((t0, done))
                return None
            timed = Timed(work, row, t0, ranks)
            if kind == "reduce_scatter":
                unwaited[ranks].add(timed)
            return timed
        return issue

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def local_copies():
    """The collectives the runtime issues with their communication taken out: a gather writes this
    rank's input into every chunk of its output, a reduce-scatter copies its own chunk of the input,
    an all-reduce leaves its buffer; each returns a finished handle. The step's local work (compute,
    packing, accumulation, the runtime's host code) runs as before, on wrong numbers: for timing only.
    Yields [seconds spent in the copies], to be taken out of the step's time (the real collectives'
    time includes writing their outputs)."""
    spent = [0.0]

    class Done:
        def wait(self, *args, **kwargs):
            return True

    def timed(fn):
        def call(*args, async_op=False, **kwargs):
            t0 = time.perf_counter()
            fn(*args)
            spent[0] += time.perf_counter() - t0
            return Done() if async_op else None
        return call

    with mock.patch.multiple(
        dist,
        all_gather_single=timed(lambda out, inp, *_: out.view(-1, inp.numel()).copy_(inp.view(1, -1))),
        reduce_scatter_single=timed(lambda out, inp, *_: out.copy_(inp.view(-1, out.numel())[0])),
        all_reduce=timed(lambda t, *_: None),
    ):
        yield spent


def free_collectives(cluster: mc.Cluster) -> mc.Cluster:
    """``cluster`` with every collective priced at zero (a calibrated one: its fits and interference)."""
    return dataclasses.replace(cluster, collective_interference={},
                               collective_fits={k: {"alpha_s": 0.0, "beta_s_per_byte": 0.0} for k in cluster.collective_fits})


def arrival_split(seen) -> dict[tuple[str, tuple[int, ...]], tuple[float, float]]:
    """Per (kind, group): of a call's time from issue to the end of its wait, the mean seconds spent
    waiting for the group's last rank to issue it, and the mean after that; from every rank's issue
    and end times (``time.perf_counter`` is the host's one monotonic clock), on every rank."""
    mine = {key: row[3] for key, row in seen.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    out = {}
    for key, calls in mine.items():
        _, ranks = key
        skew = after = 0.0
        for i, (issued, done) in enumerate(calls):  # the i-th call of a group is the same call on its ranks
            last = max(every[r][key][i][0] for r in ranks)
            skew, after = skew + last - issued, after + done - last
        out[key] = (skew / len(calls), after / len(calls))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=None,
                    help="run and price this prefetch distance instead of the schedule's choice (0: every gather "
                         "at its use, nothing overlapped: the collectives' own cost)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--collective-waits", action="store_true",
                    help="also time each collective inside the step against its calibrated price alone")
    ap.add_argument("--split-local", action="store_true",
                    help="also run and price each step with its communication taken out: the error's local part")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="price ops with the calibrated roofline instead of timing them (profile mode)")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    t0 = time.perf_counter()
    cluster = calibrate(log=say)
    say(f"calibrated in {time.perf_counter() - t0:.1f} s\n")

    rows = []
    for name in args.models:
        cfg = MODELS[name]
        torch.manual_seed(0)
        model = GPT(cfg)
        gen = torch.Generator().manual_seed(rank)
        batches = [lm_batch(cfg, args.batch_per_rank, gen) for _ in range(args.warmup + args.steps)]
        for s in (1, 4):
            # one trace per micro-batch shape, shared by every partition size
            with torch.device("meta"):
                meta_model = GPT(cfg)
            trace = mc.trace(meta_model, tuple(t[: args.batch_per_rank // s] for t in batches[0]), lm_loss,
                             device="cpu")  # the gloo ranks' kernels, which profile_trace times on the CPU
            for p in (p for p in (1, 2, 4) if world % p == 0):  # (2 ranks: p = 1, 2)
                plan = mc.Plan(partition_size=p, micro_batches=s)
                if args.profile:  # every rank at once (each measures its share), just before the run:
                    profile_trace(trace, micro_batches=s)  # a shared machine's speed drifts by minutes
                # the step runs the schedule the prediction prices: the schedule's search on the
                # profiled trace (mc.compile's own, on the roofline, may choose another)
                forced = None if args.prefetch is None or p == 1 else [args.prefetch]
                priced = [lower(concrete(trace), plan.resolve(world, local_world_size()),
                                cluster, prefetch=forced, need_graph=False).program.prefetch]
                dist.broadcast_object_list(priced, src=0)  # (each rank profiled its own share: rank 0's)
                priced = priced[0]
                step = mc.compile(model, plan, loss_fn=lm_loss, example_inputs=batches[0], cluster=cluster,
                                  optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), prefetch=(priced,))
                measured, _ = median_step_s(step, batches, args.warmup)
                pred = mc.simulate(trace, plan, cluster, prefetch=(priced,))
                if step.program.prefetch != priced:
                    say(f"  the step runs {step.program.prefetch}, the prediction prices {priced}")
                inside = ""
                if args.collective_waits:
                    with collective_waits(cluster) as seen:
                        for batch in batches[args.warmup:]:
                            step(*batch)
                    split = arrival_split(seen)
                    inside = ("\n  inside the step, per collective: " + ", ".join(
                        f"{kind} {list(ranks)} x{calls // args.steps}: {spent / calls * 1e3:.2f} ms = "
                        f"{split[(kind, ranks)][0] * 1e3:.2f} for the last rank to issue it + "
                        f"{split[(kind, ranks)][1] * 1e3:.2f} after (alone {alone / calls * 1e3:.2f})"
                        for (kind, ranks), (calls, spent, alone, _) in sorted(seen.items())))
                err = (pred.step_time_s - measured) / measured
                row = {"model": name, "p": p, "s": s, "measured_s": measured, "predicted_s": pred.step_time_s,
                       "error": err}
                if args.split_local:
                    with local_copies() as copies:
                        local, _ = median_step_s(step, batches, args.warmup)
                    spent = [None] * world
                    dist.all_gather_object(spent, copies[0] / (args.warmup + args.steps))
                    row["local_measured_s"] = local - max(spent)  # (the copies are the collectives' own work)
                    row["local_predicted_s"] = mc.simulate(trace, plan, free_collectives(cluster),
                                                           prefetch=(priced,)).step_time_s
                    inside += (f"\n  communication taken out: measured {row['local_measured_s'] * 1e3:.1f} ms "
                               f"(copies {max(spent) * 1e3:.1f} ms taken out), predicted "
                               f"{row['local_predicted_s'] * 1e3:.1f} ms")
                rows.append(row)
                profiled = sum(n.meta.get(META_TIME_S, 0) for n in trace.gm.graph.nodes)
                say(f"{name:<11} p={p} s={s}: measured {measured * 1e3:7.1f} ms  predicted "
                    f"{pred.step_time_s * 1e3:7.1f} ms  error {err:+6.1%}   (micro-step graph {profiled * 1e3:.0f} ms; "
                    f"{pred.compute_s * 1e3:.0f} ms compute, "
                    f"{pred.exposed_comm_s * 1e3:.0f} ms exposed; "
                    + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(pred.stream_busy_s.items())) + ")" + inside)
    if rank == 0:
        errs = sorted(abs(r["error"]) for r in rows)
        print(f"\n{'model':<11} {'p':>2} {'s':>2} {'measured':>10} {'predicted':>10} {'error':>8}")
        for r in rows:
            print(f"{r['model']:<11} {r['p']:>2} {r['s']:>2} {r['measured_s'] * 1e3:8.1f}ms "
                  f"{r['predicted_s'] * 1e3:8.1f}ms {r['error']:>+8.1%}")
        print(f"median |error| {statistics.median(errs):.1%}, worst {errs[-1]:.1%} over {len(rows)} configurations "
              f"({world} gloo ranks, {args.batch_per_rank} samples/rank)")
        if args.split_local:
            print(f"\nthe error split (ms): local work = the step with its communication taken out; "
                  f"communication = the rest\n{'model':<11} {'p':>2} {'s':>2} {'local: measured':>16} {'predicted':>10} "
                  f"{'comm: measured':>15} {'predicted':>10} {'error: local':>13} {'comm':>7}")
            for r in rows:
                lm, lp = r["local_measured_s"], r["local_predicted_s"]
                cm, cp = r["measured_s"] - lm, r["predicted_s"] - lp
                print(f"{r['model']:<11} {r['p']:>2} {r['s']:>2} {lm * 1e3:16.1f} {lp * 1e3:10.1f} {cm * 1e3:15.1f} "
                      f"{cp * 1e3:10.1f} {(lp - lm) * 1e3:+13.1f} {(cp - cm) * 1e3:+7.1f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
