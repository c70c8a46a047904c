"""Static memory plan vs the lower bound L and vs PyTorch's CUDA caching allocator.

    .venv/bin/python benchmarks/bench_memory.py            # every model x plan below
    .venv/bin/python benchmarks/bench_memory.py --quick    # GPT only

For each model (traced once on the meta device) and plan (4 ranks; rank 0's Program,
pipelines included) the step's buffers come from the Program (``micscompile.memory.lifetimes``:
gathered parameters, gradient buckets and shards, hierarchical stages, pipeline
receives, activations, temporaries). Columns:

* L: most aligned bytes live at once (no offset plan can use less);
* plan: ``mc.ir.plan_memory``'s arena for all of them, and plan / L;
* PyTorch: peak reserved bytes of a simulation of the CUDA caching allocator
  (``cost_model.caching_allocator``: 512 B rounding, 2 MiB small-pool segments, 20 MiB
  segments below 10 MiB, best fit, split rule) replaying the same allocations in the same
  order, and PyTorch / plan (what the plan saves over what PyTorch would have reserved);
* arena: what ``mc.compile`` actually puts in its runtime arena (the collectives'
  buffers) and its ratio to that subset's L.

Then checkpointing and offload on the GPT in bf16 (``Plan.param_dtype``) against the
formulas (docs/design.md: a checkpointed layer keeps b*s*h*2 bytes; Korthikanti et al.'s
dropout-free 32 sbh plus the fused attention's log-sum-exp without it;
``mc.activation_bytes_per_layer``): the device L and the peak of saved activations per option,
and whether each drop is at least what the formula predicts (checkpointing: every layer's full
activations but one recomputed layer's, less every layer's kept input;
offload: all kept inputs but the two the backward holds, one in use and one reloaded ahead).

No GPU and no process group needed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import micscompile as mc
from micscompile.cost_model.caching_allocator import replay_buffers
from micscompile.lowering.predict import step_buffers_of
from micscompile.memory.lifetimes import arena_offsets, on_device
from micscompile.zoo.models import GPTConfig, meta_gpt

MIB = 1 << 20
WORLD = 4


GPT_CFG = GPTConfig(vocab_size=8192, seq_len=512, layers=8, hidden=512, heads=8)


def gpt_trace(causal: bool, batch: int = 8, param_dtype=None):
    return mc.trace(*meta_gpt(GPTConfig(**{**GPT_CFG.__dict__, "causal": causal}), batch), param_dtype=param_dtype)


def checkpoint_report(batch: int = 8) -> bool:
    """Device L and saved-activation peak for no checkpointing / checkpointing / + offload, bf16 GPT,
    against the formulas; True when every drop is at least the predicted one."""
    bf16 = torch.bfloat16
    trace = gpt_trace(True, batch, bf16)
    c = GPT_CFG
    full = mc.activation_bytes_per_layer(batch, c.seq_len, c.hidden, c.heads)
    kept = mc.activation_bytes_per_layer(batch, c.seq_len, c.hidden, c.heads, checkpoint=True)
    options = {"none": {}, "checkpoint": {"checkpoint": True},
               "checkpoint + offload": {"checkpoint": True, "offload_activations": True}}
    L, saved = {}, {}
    for name, extra in options.items():
        buffers = on_device(step_buffers_of(trace, mc.Plan(partition_size=2, param_dtype=bf16, **extra), WORLD))
        L[name] = mc.ir.plan_memory(buffers).lower_bound_bytes
        saved[name] = mc.ir.plan_memory([b for b in buffers if b.kind == "activation"]).lower_bound_bytes
    print(f"\nGPT {c.layers} x h{c.hidden}, seq {c.seq_len}, batch {batch}, bf16, p=2 (4 ranks): per layer the formula "
          f"keeps {full / MIB:.1f} MiB without checkpointing, {kept / MIB:.1f} MiB with it")
    head = f"{'option':<22}{'device L MiB':>13}{'saved peak MiB':>16}"
    print(head + "\n" + "-" * len(head))
    for name in options:
        print(f"{name:<22}{L[name] / MIB:>13.1f}{saved[name] / MIB:>16.1f}")
    ckpt_drop, want_ckpt = L["none"] - L["checkpoint"], (c.layers - 1) * full - c.layers * kept
    off_drop, want_off = saved["checkpoint"] - saved["checkpoint + offload"], (c.layers - 2) * kept
    print(f"checkpointing lowers L by {ckpt_drop / MIB:.1f} MiB; formula: >= (layers - 1) * full - layers * kept = "
          f"{want_ckpt / MIB:.1f} MiB  [{'ok' if ckpt_drop >= want_ckpt else 'FAIL'}]")
    print(f"offload lowers the saved peak by {off_drop / MIB:.1f} MiB; formula: >= (layers - 2) * kept = "
          f"{want_off / MIB:.1f} MiB  [{'ok' if off_drop >= want_off else 'FAIL'}]; device L by "
          f"{(L['checkpoint'] - L['checkpoint + offload']) / MIB:.1f} MiB")
    return ckpt_drop >= want_ckpt and off_drop >= want_off


def cnn_trace(batch: int = 64):
    sys.path.insert(0, "tests")
    from models import ConvNet, cls_loss  # the test suite's CNN, wider input

    with torch.device("meta"):
        model = ConvNet(length=4096)
    return mc.trace(model, (torch.zeros(batch, 3, 4096), torch.zeros(batch, dtype=torch.long)), cls_loss)


PLANS = {
    "p=1 s=2": (mc.Plan(partition_size=1, micro_batches=2), None),
    "p=2 s=1": (mc.Plan(partition_size=2), None),
    "p=4 s=2": (mc.Plan(partition_size=4, micro_batches=2), None),
    "p=4 s=2 keep+across": (mc.Plan(partition_size=4, micro_batches=2), (mc.Prefetch(2, 1, True),)),
    "p=4 k=2 hierarchical": (mc.Plan(partition_size=4, micro_batches=2, hierarchical=True), None),
    "p=2 s=1 checkpoint": (mc.Plan(partition_size=2, checkpoint=True), None),
    "p=2 s=1 selective": (mc.Plan(partition_size=2, checkpoint="selective"), None),
    "S=2 t=2 1F1B m=4": (mc.Plan(partition_size=2, pipeline_stages=2, micro_batches=4), None),
    "S=2 t=2 1F1B checkpoint": (mc.Plan(partition_size=2, pipeline_stages=2, micro_batches=4, checkpoint=True), None),
    "S=2 t=1 interleaved v=2": (mc.Plan(partition_size=1, pipeline_stages=2, micro_batches=4, pipeline_chunks=2,
                                        pipeline_schedule="interleaved"), None),
}


def row(model: str, plan_name: str, trace) -> dict:
    plan, prefetch = PLANS[plan_name]
    buffers = step_buffers_of(trace, plan, WORLD, prefetch=prefetch, gpus_per_node=2 if "k=2" in plan_name else None)
    t0 = time.perf_counter()
    mp = mc.ir.plan_memory(buffers)
    solve_s = time.perf_counter() - t0
    mp.check(buffers)
    reserved = replay_buffers(buffers).peak_reserved_bytes
    arena = arena_offsets(buffers)[1]
    return {"model": model, "plan": plan_name, "buffers": len(buffers), "L": mp.lower_bound_bytes,
            "arena": mp.arena_bytes, "reserved": reserved, "solve_s": solve_s, "method": mp.method,
            "rt_arena": arena.arena_bytes, "rt_L": arena.lower_bound_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT only")
    args = ap.parse_args()
    models = {"GPT": lambda: gpt_trace(True)}
    if not args.quick:
        models |= {"BERT": lambda: gpt_trace(False), "CNN": cnn_trace}
    head = (f"{'model':<6}{'plan':<25}{'buffers':>8}{'L MiB':>9}{'plan MiB':>10}{'plan/L':>8}"
            f"{'PyTorch MiB':>13}{'PyTorch/plan':>14}{'arena/L':>9}{'solve s':>9}  method")
    print(head)
    print("-" * len(head))
    worst_l, worst_pt = 0.0, float("inf")
    for name, make in models.items():
        trace = make()
        for plan_name in PLANS:
            try:
                r = row(name, plan_name, trace)
            except mc.PlanError as exc:  # the CNN has 3 blocks that read parameters: no 4 pipeline chunks
                print(f"{name:<6}{plan_name:<25}  refused: {str(exc).split(':')[0]}", flush=True)
                continue
            ratio, saving = r["arena"] / r["L"], r["reserved"] / r["arena"]
            worst_l, worst_pt = max(worst_l, ratio), min(worst_pt, saving)
            print(f"{name:<6}{plan_name:<25}{r['buffers']:>8}{r['L'] / MIB:>9.1f}{r['arena'] / MIB:>10.1f}"
                  f"{ratio:>8.4f}{r['reserved'] / MIB:>13.1f}{saving:>13.2f}x"
                  f"{r['rt_arena'] / max(r['rt_L'], 1):>9.4f}{r['solve_s']:>9.2f}  {r['method']}", flush=True)
    print(f"\nworst plan / L: {worst_l:.4f} (goal <= 1.01); smallest PyTorch reserved / plan: {worst_pt:.2f}x "
          f"(goal >= 1)")
    checkpoint_report()


if __name__ == "__main__":
    main()
