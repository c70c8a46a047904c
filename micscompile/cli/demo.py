"""Train a small GPT with micscompile under torchrun: what ``micscompile demo`` (``make demo``) runs.

    micscompile demo                                   # 4 gloo ranks, p=2, 4 micro-batches, --check
    micscompile demo --dynamo --codegen inductor       # captured by torch.compile, compute by Inductor
    torchrun --standalone --nproc-per-node 4 -m micscompile.cli.demo --partition-size 2 --micro-batches 4 --check

Every rank draws the same global batches from one seed and trains on its slice;
with --check, rank 0 also trains the single-process eager reference on the whole
global batch and prints both losses side by side, then the final parameter error.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import time

import torch
import torch.distributed as dist

import micscompile as mc
from micscompile.cli.parity import LOW_PRECISION_TOLERANCE, TOLERANCE, state_error, train_reference, train_reference_mixed
from micscompile.core.launch import init_distributed
from micscompile.runtime.materialize import initialize
from micscompile.zoo.models import GPT, GPTConfig, gpt_params, lm_batch, lm_loss


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--partition-size", type=int, default=2, help="p: ranks that shard one replica")
    ap.add_argument("--micro-batches", type=int, default=4, help="s: gradient-accumulation steps")
    ap.add_argument("--grad-sync", choices=["2hop", "every_step"], default="2hop")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                    help="sgd (momentum 0.9) is the parity yardstick: AdamW turns the rounding noise of "
                         "gradients that are mathematically zero (attention key bias) into lr-sized steps")
    ap.add_argument("--lr", type=float, default=None, help="default: 0.1 for sgd, 1e-3 for adamw")
    ap.add_argument("--param-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="mixed precision: gathers and compute in this dtype, fp32 master weights")
    ap.add_argument("--reduce-dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="dtype of the gradient reductions")
    ap.add_argument("--meta", action="store_true", help="build the model on the meta device (no full weights)")
    ap.add_argument("--codegen", choices=["auto", "eager", "inductor"], default="auto",
                    help="Plan.codegen: run the compute between collectives op by op, Inductor-compiled, or as the "
                         "cost model picks (auto)")
    ap.add_argument("--dynamo", action="store_true",
                    help="capture with torch.compile(loss, backend=mc.backend(plan, ...)) instead of mc.compile")
    ap.add_argument("--check", action="store_true", help="compare with single-process eager PyTorch")
    ap.add_argument("--program", action="store_true", help="print the whole per-rank Program")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    init_distributed(timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    out = print if rank == 0 else (lambda *a, **k: None)

    torch.manual_seed(0)
    if args.meta:
        with torch.device("meta"):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    gen = torch.Generator().manual_seed(1234)
    global_batches = [lm_batch(cfg, args.batch_per_rank * world, gen) for _ in range(args.steps)]
    b = args.batch_per_rank
    local = [tuple(t[rank * b : (rank + 1) * b] for t in batch) for batch in global_batches]

    param_dtype, reduce_dtype = getattr(torch, args.param_dtype), getattr(torch, args.reduce_dtype)
    plan = mc.Plan(partition_size=args.partition_size, micro_batches=args.micro_batches, grad_sync=args.grad_sync,
                   param_dtype=param_dtype, reduce_dtype=reduce_dtype, codegen=args.codegen)
    mixed = param_dtype != torch.float32 or reduce_dtype != torch.float32
    if args.optimizer == "sgd":
        optimizer = lambda ps: torch.optim.SGD(ps, lr=args.lr or 0.1, momentum=0.9)  # noqa: E731
    else:
        optimizer = lambda ps: torch.optim.AdamW(ps, lr=args.lr or 1e-3)  # noqa: E731
    out(f"micscompile demo: GPT {cfg.layers} layers, h={cfg.hidden}, seq {cfg.seq_len}, "
        f"{gpt_params(cfg) / 1e6:.2f}M parameters{' (built on meta)' if args.meta else ''}")

    start = time.perf_counter()
    torch.manual_seed(0)  # the meta model is initialised from this seed
    losses = []
    if args.dynamo:
        if args.meta:
            raise SystemExit("--dynamo runs the model: build it for real (drop --meta)")
        backend = mc.backend(plan, optimizer=optimizer)
        # dynamic=True: the step runs the graph once per micro-batch, at the micro-batch size
        train = torch.compile(lambda x, y: lm_loss(model(x), y), backend=backend, dynamic=args.micro_batches > 1)
        losses.append((float(train(*local[0])), None))  # Dynamo captures, micscompile compiles, one step runs
        step = backend.step
        how = "Dynamo captured the loss, micscompile compiled it (and ran step 0)"
    else:
        step = train = mc.compile(model, plan, loss_fn=lm_loss, optimizer=optimizer, example_inputs=local[0])
        how = "compiled"
    out(f"{world} ranks on {dist.get_backend()}, plan: {step.program.plan}")
    out(f"\n{how} in {time.perf_counter() - start:.2f} s: {step.graph.summary()}")
    out("passes: " + "; ".join(map(str, step.pass_records)))
    program = str(step.program).splitlines()
    out("\n".join(program if args.program else program[:16] + ["   ... (--program prints it all)"] + program[-8:]))
    if step.codegen_choice is not None:
        out(f"\n{step.codegen_choice}")
    if step.codegen is not None:
        out(f"\n{step.codegen}")

    reference = None
    if args.check and rank == 0:
        ref_model = model
        if args.meta:  # initialised as the meta model was: from seed 0, after it is built
            ref_model = GPT(cfg)
            torch.manual_seed(0)
            initialize(ref_model)
        if mixed:  # eager model.to(param_dtype) on each rank's micro-batch, fp32 masters
            reference = train_reference_mixed(copy.deepcopy(ref_model), lambda m: lm_loss, optimizer, global_batches,
                                              world * args.micro_batches, param_dtype)
        else:
            reference = train_reference(copy.deepcopy(ref_model), lm_loss, optimizer, global_batches)

    out(f"\n{'step':>4}  {'micscompile loss':>17}  {'eager loss':>11}  {'|diff|':>9}  {'time':>8}")
    for i, batch in enumerate(local):
        step.track_memory = i == len(local) - 1  # count what ops allocate outside the arena on the last step
        t0 = time.perf_counter()
        loss, dt = losses[i] if i < len(losses) else (float(train(*batch)), time.perf_counter() - t0)
        dt = f"{dt:7.3f}s" if dt is not None else f"{'(first)':>8}"
        ref = f"{reference[0][i]:11.6f}" if reference else f"{'-':>11}"
        diff = f"{abs(loss - reference[0][i]):9.2e}" if reference else f"{'-':>9}"
        out(f"{i:>4}  {loss:17.6f}  {ref}  {diff}  {dt}")

    state = step.full_state_dict()  # collective: every rank calls it
    if reference:
        err, name = state_error(state, reference[1])
        # mixed: low-precision gradients are summed in another order than the reference's (parity.py)
        tolerance = LOW_PRECISION_TOLERANCE if mixed else TOLERANCE
        verdict = "OK" if err <= tolerance else "MISMATCH"
        out(f"\nparameters after {args.steps} steps vs eager reference: max rel err {err:.2e} "
            f"({name}), tolerance {tolerance:.0e}: {verdict}")
    out(f"\ncommunication of rank 0 over {args.steps} steps (ring wire bytes per rank):")
    out(step.comm_stats())
    out("\nmemory of rank 0 per step (static plan: collectives' buffers and out= results in one arena):")
    out(step.memory_stats())
    dist.barrier()  # nobody tears its gloo pairs down while a peer still reads from them (seen: SIGABRT at exit)
    dist.destroy_process_group()
    if reference and verdict != "OK":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
