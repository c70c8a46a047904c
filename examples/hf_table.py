"""The Hugging Face tables (README, docs/tensor-parallel.md): each architecture of
``micscompile.zoo.hf_models.ARCHITECTURES``, tiny, built from its default config (``use_cache=True`` and its
default attention, sdpa, as it comes), trained 3 steps on 4 gloo ranks next to single-process eager PyTorch on
the same global batch, under each plan of ``VARIANTS`` (p=2; tp=2 x p=2; tp=2 x p=2 with sequence parallelism):
the parity error of the weights, or the refusal it gets.

    torchrun --standalone --nproc-per-node 4 examples/hf_table.py
"""

from __future__ import annotations

import copy
import datetime
import re
import time

import torch
import torch.distributed as dist

import micscompile as mc
from micscompile.cli.parity import LOW_PRECISION_TOLERANCE, TOLERANCE, state_error, train_reference, train_reference_mixed
from micscompile.core.launch import init_distributed
from micscompile.zoo import hf_models

STEPS, LOCAL_BATCH, SEQ, S = 3, 4, 16, 2
P = 2  # partition size (1 on a single rank)
VARIANTS = {"p=2": (1, False), "tp=2 x p=2": (2, False), "tp=2 x p=2, sequence parallel": (2, True)}
"""Column name: (tensor_parallel_size, sequence_parallel)."""


def _opt(ps):
    return torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def row(name: str, rank: int, world: int, tp: int = 1, sp: bool = False) -> dict:
    """One architecture under ``tp`` tensor ranks (``sp``: with sequence parallelism): {"name", "class",
    "dtype", "error", "tolerance"} or {..., "refused": message}."""
    _, dtype = hf_models.ARCHITECTURES[name]
    torch.manual_seed(0)
    model = hf_models.build_architecture(name)
    out = {"name": name, "class": type(model).__name__, "dtype": str(dtype)[6:],
           "params": sum(p.numel() for p in model.parameters())}
    chains = world // tp  # a tensor group's ranks read the same slice of the batch
    gen = torch.Generator().manual_seed(1)
    batches = [hf_models.lm_batch(model, LOCAL_BATCH * chains, SEQ, gen) for _ in range(STEPS)]
    chain = rank // tp
    local = [tuple(x[chain * LOCAL_BATCH:(chain + 1) * LOCAL_BATCH] for x in b) for b in batches]
    start = time.perf_counter()
    try:
        step = mc.compile(model, mc.Plan(partition_size=min(P, world // tp), micro_batches=S, param_dtype=dtype,
                                                  tensor_parallel_size=tp, sequence_parallel=sp),
                          loss_fn=hf_models.lm_loss, optimizer=_opt, example_inputs=local[0])
    except (mc.TraceError, mc.PlanError) as exc:  # (before any collective: every rank alike)
        return {**out, "refused": f"{type(exc).__name__}: {exc}"}
    try:  # a failure here is every rank's (the same op on the same shapes): nobody is left waiting
        for b in local:
            step(*b)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        try:  # the same model in the same dtype, eagerly, on one rank's batch
            low = copy.deepcopy(model).to(dtype)
            hf_models.lm_loss(low(local[0][0]), local[0][1]).backward()
            eager = "eager PyTorch runs it"
        except Exception:  # noqa: BLE001
            eager = "eager PyTorch fails the same way here"
        return {**out, "refused": f"fails at run time: {type(exc).__name__}: {exc} ({eager})"}
    if dtype == torch.float32:
        _, ref = train_reference(copy.deepcopy(model), hf_models.lm_loss, _opt, batches)
        tolerance = TOLERANCE
    else:
        _, ref = train_reference_mixed(copy.deepcopy(model), lambda m: hf_models.lm_loss, _opt, batches, chains * S,
                                       dtype)
        tolerance = LOW_PRECISION_TOLERANCE
    err, worst = state_error(step.full_state_dict(), ref)
    return {**out, "error": err, "worst": worst, "tolerance": tolerance, "seconds": time.perf_counter() - start}


def verdict(r: dict) -> str:
    """A row's cell: its parity error against the tolerance, or the first line of its refusal."""
    if "refused" not in r:
        return f"{r['error']:.1e} ({'within' if r['error'] <= r['tolerance'] else 'ABOVE'} {r['tolerance']:.0e})"
    said = r["refused"].split("\n")[0]
    if " — " in said:  # a TraceError: where, and its hint
        where, hint = said.split(" — ", 1)
        return f"{where.split(' [')[0]}: {re.split(r': [A-Z][A-Za-z]*(?:Error|Exception): ', hint)[0]}"
    return said if len(said) <= 220 else f"{said[:150]} ... {said[-60:]}"


def table(rows: list[dict]) -> str:
    """Markdown, an architecture a line, a column per variant the rows hold (max rel. error of the weights)."""
    columns = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    lines = ["| architecture | class | dtype | " + " | ".join(columns) + " |", "|---|---|---|" + "---|" * len(columns)]
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = {r["variant"]: r for r in rows if r["name"] == name}
        first = next(iter(mine.values()))
        cells = [verdict(mine[v]) if v in mine else "-" for v in columns]
        lines.append(f"| {name} | {first['class']} | {first['dtype']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rows(rank: int, world: int, plan: dict[str, list[str]] | None = None) -> list[dict]:
    """Each (architecture, variant) of ``plan`` (variant -> names; every one of each by default)."""
    plan = plan or {v: list(hf_models.ARCHITECTURES) for v in VARIANTS}
    return [{**row(name, rank, world, *VARIANTS[v]), "variant": v} for v, names in plan.items() for name in names]


def main() -> None:
    init_distributed(timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"{world} ranks on {dist.get_backend()}, torch {torch.__version__}, transformers "
              f"{__import__('transformers').__version__}")
    out = rows(rank, world)
    if rank == 0:
        print(table(out))
    dist.barrier()  # (no rank tears the group down while another still prints)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
