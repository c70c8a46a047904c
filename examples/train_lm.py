"""Train a small GPT on real text with micscompile: the loop a real run needs (``make train``).

    torchrun --standalone --nproc-per-node 4 examples/train_lm.py            # what make train runs
    torchrun --standalone --nproc-per-node 4 examples/train_lm.py --steps 600 --out runs/longer

The text is the source of Python's standard library (on every machine with Python), read as bytes
(256 tokens); one file in ten, by a hash of its path, is held out for validation. The loop:

* ``mc.compile`` with a token-weighted loss (``(loss_sum, count)``), gradient clipping at 1.0,
  AdamW with weight decay on the matrices only (``mc.decay_groups``), warmup + cosine learning
  rate (``torch.optim.lr_scheduler`` on ``step.optimizer``), bf16 compute where the GPU has it;
* one log line per step (loss, learning rate, gradient norm, tokens/s, step time, memory; MFU on
  a GPU) under a progress bar, validation (``step.evaluate``) every ``--eval-every`` steps;
* a checkpoint every ``--ckpt-every`` steps through torch.distributed.checkpoint, written to a
  ``.tmp`` directory and renamed when complete (a half-written one is never loaded), the last
  ``--keep`` kept; started again with the same ``--out`` it resumes from the latest and continues
  the same curve (batches are a function of the step number);
* at the end: the validation loss against the unigram baseline of the same text, and the loss
  curve (train and validation, over every run into ``--out``) as ``loss_curve.png``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import re
import shutil
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn import functional as F
from tqdm import tqdm

import micscompile as mc
from micscompile.core.collectives import fmt_bytes
from micscompile.core.launch import init_distributed, step_device
from micscompile.cost_model.specs import A100_40GB, H100, V100_32GB
from micscompile.zoo.models import GPT, GPTConfig, gpt_params

CKPT = re.compile(r"^step_(\d{6})$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/train_lm", help="checkpoints, log.jsonl and loss_curve.png")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-per-rank", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--partition-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine ends at lr * this")
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--keep", type=int, default=2, help="checkpoints kept")
    ap.add_argument("--data-bytes", type=int, default=24 << 20, help="at most this much of the library is read")
    ap.add_argument("--fresh", action="store_true", help="ignore checkpoints in --out and start over")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


# ---- data ----------------------------------------------------------------------------------
def library_text(limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train bytes, validation bytes) of the standard library's .py files, as uint8 tensors: files in
    path order, every tenth by hash held out, each followed by a NUL; at most ``limit`` bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, val, total = bytearray(), bytearray(), 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or total >= limit:
            continue
        try:
            data = path.read_bytes() + b"\0"
        except OSError:
            continue
        held_out = hashlib.blake2b(str(path.relative_to(root)).encode(), digest_size=2).digest()[0] % 10 == 0
        (val if held_out else train).extend(data)
        total += len(data)
    if len(val) < 1 << 16:
        raise SystemExit(f"too little text under {root} ({total} bytes): is the standard library's source installed?")
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8)


def batch(data: torch.Tensor, n: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` windows of ``seq + 1`` bytes at offsets drawn from ``seed``: (inputs, next-byte targets)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - seq - 1, (n,), generator=g)
    rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def unigram_baseline(train: torch.Tensor, val: torch.Tensor) -> float:
    """Cross-entropy (nats per byte) of the validation bytes under the training bytes' frequencies
    (add-one smoothed): what a model that ignores context scores."""
    p = (torch.bincount(train.long(), minlength=256).double() + 1)
    p /= p.sum()
    counts = torch.bincount(val.long(), minlength=256).double()
    return float(-(counts * p.log()).sum() / counts.sum())


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy in fp32, targets counted): the step divides by the global count, so
    padding (targets of -100) anywhere in the batch gives the whole batch's token mean."""
    flat = targets.flatten()
    return F.cross_entropy(logits.flatten(0, 1).float(), flat, reduction="sum"), (flat != -100).sum()


# ---- checkpoints -----------------------------------------------------------------------------
def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``out``, oldest first (``.tmp`` ones are half-written: never listed)."""
    found = [(int(m.group(1)), p) for p in (out / "checkpoints").glob("step_*") if (m := CKPT.match(p.name))]
    return sorted(found)


def save(step: mc.TrainStep, schedule, out: Path, keep: int, rank: int) -> Path:
    final = out / "checkpoints" / f"step_{step.steps:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    state = step.state_dict()
    state["schedule"] = schedule.state_dict()
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()  # every rank's files are written
    if rank == 0:
        os.replace(tmp, final)  # atomic: the checkpoint appears whole or not at all
        for _, old in checkpoints(out)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def check_complete(path: Path) -> None:
    """Refuse a checkpoint that is not whole: DCP writes ``.metadata`` last, on rank 0, once every
    rank's files are in (a run killed mid-save leaves the files without it, under ``.tmp``)."""
    if path.name.endswith(".tmp") or not (path / ".metadata").is_file():
        files = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
        raise SystemExit(f"{path} is not a complete checkpoint: it has no .metadata (written last, once every "
                         f"rank's files are in; found {files or 'nothing'}): a run was killed while saving it. "
                         f"Resume from an earlier step_* directory")


def load(step: mc.TrainStep, schedule, path: Path) -> None:
    check_complete(path)
    state = step.state_dict()
    state["schedule"] = schedule.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    schedule.load_state_dict(state.pop("schedule"))
    step.load_state_dict(state)


# ---- the run ---------------------------------------------------------------------------------
GPUS = {"H100": H100, "H200": H100, "A100": A100_40GB, "V100": V100_32GB}
"""The cost model's GPU specs by device name (the H200 has the H100's compute)."""


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The GPU's dense peak in ``dtype`` (None: CPU, fp32, or a GPU the cost model has no spec for)."""
    if device.type != "cuda" or dtype == torch.float32:
        return None
    name = torch.cuda.get_device_name(device)
    spec = next((g for k, g in GPUS.items() if k in name), None)
    return spec and spec.peak_flops.get(str(dtype).removeprefix("torch."))


def cosine(args: argparse.Namespace):
    """Linear warmup over ``--warmup`` steps, then cosine down to ``lr * --min-lr-ratio``."""
    def factor(i: int) -> float:
        if i < args.warmup:
            return (i + 1) / args.warmup
        t = min(1.0, (i - args.warmup) / max(1, args.steps - args.warmup))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return factor


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not dist.is_initialized():
        init_distributed(timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = step_device()
    out = Path(args.out)
    say = tqdm.write if rank == 0 else (lambda *a, **k: None)

    train, val = library_text(args.data_bytes)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    param_dtype = torch.bfloat16 if bf16 else torch.float32
    plan = mc.Plan(partition_size=args.partition_size, micro_batches=args.micro_batches, param_dtype=param_dtype)
    b, global_batch = args.batch_per_rank, args.batch_per_rank * world

    def local(data, seed):
        x, y = batch(data, global_batch, args.seq, seed)
        return x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    step = mc.compile(model, plan, loss_fn=token_loss, example_inputs=local(train, 0),
                      optimizer=lambda ps: torch.optim.AdamW(mc.decay_groups(ps, args.weight_decay), lr=args.lr,
                                                             betas=(0.9, 0.95)),
                      max_grad_norm=args.max_grad_norm)
    schedule = torch.optim.lr_scheduler.LambdaLR(step.optimizer, cosine(args))
    say(f"GPT {gpt_params(cfg) / 1e6:.2f}M parameters, {len(train) / 1e6:.1f} MB train / {len(val) / 1e6:.1f} MB "
        f"validation bytes, {world} ranks ({dist.get_backend()}), p={plan.partition_size}, s={plan.micro_batches}, "
        f"{str(param_dtype)[6:]}; compiled in {time.perf_counter() - t0:.1f} s")

    found = [] if args.fresh else checkpoints(out)
    if rank == 0:
        (out / "checkpoints").mkdir(parents=True, exist_ok=True)
        if args.fresh:
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            (out / "checkpoints").mkdir(parents=True)
            (out / "log.jsonl").unlink(missing_ok=True)
    dist.barrier()
    if found:
        at, path = found[-1]
        load(step, schedule, path)
        say(f"resumed from {path} (step {step.steps})")
    log = out / "log.jsonl"
    if rank == 0 and log.exists():  # drop what a killed run logged after its last checkpoint
        kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= step.steps]
        log.write_text("".join(line + "\n" for line in kept))

    tokens = global_batch * args.seq
    flops = mc.transformer_flops(global_batch, args.seq, cfg.layers, cfg.hidden, cfg.vocab_size, recompute=False)
    peak = peak_flops(device, param_dtype)
    val_seeds = [10_000_000 + i for i in range(args.eval_batches)]

    def evaluate() -> float:
        return sum(float(step.evaluate(*local(val, s))) for s in val_seeds) / len(val_seeds)

    bar = tqdm(total=args.steps, initial=step.steps, desc="train", unit="step",
               disable=True if rank != 0 or args.no_progress else None, dynamic_ncols=True)  # None: a terminal only
    last_val = None
    while step.steps < args.steps:
        x, y = local(train, step.steps + 1)  # the batch is a function of the step: a resumed run continues the curve
        lr = step.optimizer.param_groups[0]["lr"]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        loss = float(step(x, y))  # one host sync per step, for the log
        seconds = time.perf_counter() - start
        schedule.step()
        record = {"step": step.steps, "loss": loss, "lr": lr, "grad_norm": float(step.grad_norm),
                  "tokens_per_s": tokens / seconds, "step_s": seconds}
        if device.type == "cuda":
            record["memory"] = torch.cuda.max_memory_allocated(device)
        else:
            m = step.memory_stats()
            record["memory"] = m.arena_bytes + m.outside_planned_peak_bytes
        if peak:
            record["mfu"] = flops / seconds / world / peak
        if step.steps % args.eval_every == 0 or step.steps == args.steps:
            record["val_loss"] = last_val = evaluate()
        line = (f"step {step.steps:5d} | loss {loss:.4f} | lr {lr:.2e} | grad norm {record['grad_norm']:.3f} | "
                f"{record['tokens_per_s']:,.0f} tok/s | {seconds * 1e3:.0f} ms | mem {fmt_bytes(record['memory'])}")
        line += f" | MFU {record['mfu']:.1%}" if peak else ""
        line += f" | val {record['val_loss']:.4f}" if "val_loss" in record else ""
        say(line)
        bar.update()
        if rank == 0:
            with log.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if step.steps % args.ckpt_every == 0 or step.steps == args.steps:
            say(f"checkpoint {save(step, schedule, out, args.keep, rank)}")
    bar.close()
    if last_val is None:
        last_val = evaluate()
    baseline = unigram_baseline(train, val)
    say(f"validation loss {last_val:.4f} nats/byte; unigram baseline {baseline:.4f} "
        f"({last_val / baseline:.0%} of it); skipped steps {step.skipped_steps}")
    if rank == 0:
        plot(log, out / "loss_curve.png", baseline)
        say(f"loss curve: {out / 'loss_curve.png'}")
    return {"val_loss": last_val, "baseline": baseline, "steps": step.steps}


def plot(log: Path, path: Path, baseline: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1, label="train")
    evals = [r for r in records if "val_loss" in r]
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
    ax.axhline(baseline, ls="--", c="gray", label=f"unigram baseline {baseline:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_title("GPT on the Python standard library, micscompile")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
