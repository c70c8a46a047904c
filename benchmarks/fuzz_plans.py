"""The plan fuzzer: random models under random Plans, each trained on 4 real gloo ranks in
its own launch and classed as trained with parity, refused, or failed.

    OMP_NUM_THREADS=1 python benchmarks/fuzz_plans.py --n 200 --seed 0
    OMP_NUM_THREADS=1 python benchmarks/fuzz_plans.py --replay 17        # one case again
    OMP_NUM_THREADS=1 python benchmarks/fuzz_plans.py --cover            # every pair of features
    OMP_NUM_THREADS=1 python benchmarks/fuzz_plans.py --cover-row 5      # one row of it again

Case ``seed`` draws, from its own ``random.Random(seed)``:

- a model: the tied LM (2-6 blocks; a weight shared by the embedding and the head), the conv net
  (buffers), the quirky graph (a parameter only the loss reads, an unused one, in-place ops), a tiny
  Hugging Face GPT-2 / Llama / BERT, or a ``RandomNet`` drawn for the purpose (odd sizes, skip
  connections, a weight shared across blocks, buffers, an unused parameter, in-place ops, one or two
  inputs; ``tests/models.py``);
- a Plan over everything it accepts: flat (p, s, grad_sync) or a pipeline (S, t, m; 1F1B, GPipe,
  interleaved with v = 2, zero-bubble ZB-H1 or ZB-V), gpus_per_node and hierarchical gathers, a forced
  Prefetch or the default search, bucket sizes, a memory budget, a cap on gathers in flight, checkpointing (plain, selective,
  every 1-2 blocks, with offload), fp32 / bf16 / fp16 compute and reduction, codegen (eager, auto,
  Inductor), the optimizer states over the partition group or the world, the arena, a model built on meta;
- a training set-up: SGD or AdamW, gradient clipping (``max_grad_norm``, ``inf``: measured only), the
  token-weighted loss (``(loss_sum, count)`` with targets padded by ``ignore_index``).

Each case trains 4 steps and is compared with ``cli.parity.train_reference_mixed``: single-process eager
on the same global batch, cut into the plan's micro-batches and summed in their order (in fp32 too, so
that AdamW's amplification of summation order neither hides nor fakes an error) and reduced in the plan's
reduce_dtype where the plan reduces (each sum exact, rounded once: an fp16 sum overflows, and the loss
scale backs off, where the true sum does), with the same clipping, loss scaling and token count. Outcomes:

- **parity**: every loss and the gathered state within docs/design.md's metric (1e-5; 2e-2 mixed);
- **refused**: every rank raised the same error from micscompile's own code while building the Plan or
  in ``mc.compile`` (which checks everything rank-locally before its first collective), other than
  that the ranks disagree (they were given the same model, plan and batch);
- **failed**: wrong numbers, a crash, an error in the steps or not micscompile's, ranks that disagree,
  or a hang past ``--timeout``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import random
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402
from harness import launch  # noqa: E402
from models import MODELS, RandomNet, TiedLM, lm_batches  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import micscompile as mc  # noqa: E402
from micscompile.cli.parity import LOW_PRECISION_TOLERANCE, TOLERANCE, rel_error, train_reference_mixed  # noqa: E402
from micscompile.cost_model.specs import default_cluster  # noqa: E402
from micscompile.runtime.compile import AGREEMENT_HINTS  # noqa: E402
from micscompile.runtime.loss_scale import LossScaler  # noqa: E402
from micscompile.runtime.materialize import initialize  # noqa: E402

WORLD, STEPS, LOCAL_BATCH = 4, 4, 12
ORDER_MARGIN = 4
"""A value may differ from the reference by up to this many times its noise floor (when that exceeds
docs/design.md's tolerance): the larger of how far the reference moves when summed in the reverse
micro-batch order (the order floor) and when computed in float64 (the rounding floor)."""
MICSCOMPILE = str(Path(mc.__file__).resolve().parent)
FAMILIES = ("tied_lm", "convnet", "quirky", "random", "hf")
INTERNAL = ("ProgramError:",)
"""Errors of micscompile's own consistency checks: never a refusal of bad input (the judge calls them failures)."""
HF_FAMILIES = ("gpt2", "llama", "bert")
HF_SEQ, HF_BATCH = 8, 4


@dataclass(frozen=True)
class FuzzCase:
    seed: int
    model: str
    """One of FAMILIES; "random" builds RandomNet(seed), "hf" the tiny ``hf`` family."""
    layers: int = 2
    hf: str = "gpt2"
    plan: tuple = ()
    """The Plan's fields that differ from its defaults, as (name, value) pairs."""
    gpus_per_node: int | None = None
    """Ranks per simulated node (the cluster ``mc.compile`` plans for); None: the 4 ranks on one node."""
    prefetch: mc.Prefetch | None = None
    opt: str = "sgd"
    clip: float | None = None
    counted: bool = False
    meta: bool = False
    arena: bool = True
    row: tuple = ()
    """A covering case's axis values, as (axis, value) pairs (``AXES``); empty for a drawn seed."""

    @property
    def kwargs(self) -> dict:
        return {"codegen": "eager", **dict(self.plan)}  # eager unless drawn (Plan's default is "auto")

    @property
    def id(self) -> str:
        def show(v):
            return str(v)[6:] if isinstance(v, torch.dtype) else v
        names = {"hf": f"hf-{self.hf}", "tied_lm": f"tied_lm{self.layers}", "random": f"random{self.seed}"}
        what = names.get(self.model, self.model)
        plan = ",".join(f"{k}={show(v)}" for k, v in self.plan)
        extra = [self.opt] + ([f"clip={self.clip}"] if self.clip is not None else []) + (["sum/count"] if self.counted else [])
        extra += (["meta"] if self.meta else []) + ([] if self.arena else ["noarena"])
        if self.prefetch is not None:
            pf = self.prefetch
            extra.append(f"prefetch(d={pf.distance},keep={pf.keep_live}{',across' if pf.across_micro_steps else ''})")
        nodes = "" if self.gpus_per_node is None else f" k={self.gpus_per_node}"
        return f"{what} Plan({plan}){nodes} {' '.join(extra)}"

    def cluster(self, world: int) -> mc.Cluster | None:
        """The cluster the case's step is planned for: this machine's, in nodes of ``gpus_per_node``."""
        return None if self.gpus_per_node is None else default_cluster("cpu", "cpu", world, self.gpus_per_node)


def draw(seed: int) -> FuzzCase:
    """The case of ``seed``: the same on every machine and Python run."""
    rng = random.Random(seed)
    model = rng.choices(FAMILIES, weights=(4, 2, 1, 5, 1))[0]
    plan: dict = {}
    pipeline = model != "quirky" and rng.random() < 0.3
    if pipeline:
        stages = rng.choice([2, 2, 4])
        plan["pipeline_stages"] = stages
        plan["partition_size"] = rng.choice([t for t in (1, 2) if stages * t <= WORLD])
        schedule = rng.choice(["1f1b", "1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"])
        if schedule != "1f1b":
            plan["pipeline_schedule"] = schedule
        if schedule == "interleaved":
            plan["pipeline_chunks"] = 2
    else:
        plan["partition_size"] = rng.choice([1, 2, 4])
        if rng.random() < 0.2:
            plan["grad_sync"] = "every_step"
    s = rng.choice([d for d in (1, 2, 3, 4) if LOCAL_BATCH % d == 0 and (model != "hf" or HF_BATCH % d == 0)])
    if s > 1:
        plan["micro_batches"] = s
    if rng.random() < 0.3:
        plan["gpus_per_node"] = 2
        if not pipeline and plan["partition_size"] == 4:
            plan["hierarchical"] = rng.choice(["auto", True, False])
    if rng.random() < 0.2:
        plan["bucket_bytes"] = 1 << rng.randint(8, 14)
    if rng.random() < 0.1:
        plan["memory_budget_bytes"] = 1 << rng.randint(8, 16)
    if rng.random() < 0.15:
        plan["max_gathers_in_flight"] = rng.choice([1, 2])
    if rng.random() < 0.3:
        plan["checkpoint"] = rng.choice([True, True, "selective"])
        if rng.random() < 0.4:
            plan["checkpoint_every"] = 2
        if rng.random() < 0.3:
            plan["offload_activations"] = True
    if rng.random() < 0.25:
        plan["param_dtype"] = rng.choice([torch.bfloat16, torch.float16])
        if rng.random() < 0.5:
            plan["reduce_dtype"] = plan["param_dtype"]
    # Inductor compiles each region (tens of seconds on 2 cores): drawn rarely
    codegen = rng.choices(["eager", "auto", "inductor"], weights=(16, 2, 1))[0]
    if codegen != "eager":
        plan["codegen"] = codegen
    prefetch = None
    if rng.random() < 0.3:
        prefetch = mc.Prefetch(distance=rng.randint(0, 3), keep_live=rng.randint(0, 2),
                               across_micro_steps=s > 1 and rng.random() < 0.5)
    case = dict(
        seed=seed, model=model, layers=rng.choice([2, 4, 6]), hf=rng.choice(HF_FAMILIES),
        prefetch=prefetch, opt=rng.choice(["sgd", "adamw"]),
        clip=rng.choice([None, None, 0.05, 1.0, float("inf")]),
        counted=model in ("tied_lm", "random") and rng.random() < 0.3,
        meta=model != "hf" and rng.random() < 0.15, arena=rng.random() < 0.85,
    )
    if plan.get("grad_sync") != "every_step" and rng.random() < 0.25:  # (drawn last: the rest as before it)
        plan["optimizer_sharding"] = "world"
    if not pipeline and plan.get("grad_sync") != "every_step" and rng.random() < 0.15:  # (after it, likewise)
        plan.update(tensor_parallel_size=2, partition_size=min(plan["partition_size"], 2))
        plan.pop("hierarchical", None)
    return FuzzCase(gpus_per_node=plan.pop("gpus_per_node", None), plan=tuple(plan.items()), **case)


# ---- the covering design -----------------------------------------------------------------------------
# Random seeds draw each feature by chance: a pair drawn once in 70 seeds (a meta model under an interleaved
# pipeline) can stay untried for a whole 200-seed run. The covering design pairs every value of every axis with
# every value of every other axis at least once, in few cases (covertable's greedy covering array); what the
# axes leave open (stages, t, micro-batches, layers, prefetch, buckets, reduce dtype, ...) is drawn per case.
# A new Plan field or training option joins AXES (tests/test_fuzz.py fails on a Plan field no covering case sets,
# unless RANDOM_ONLY names it).

AXES: dict[str, tuple[str, ...]] = {
    "model": ("tied_lm", "convnet", "quirky", "random", "hf-gpt2", "hf-llama", "hf-bert"),
    "plan": ("flat p=1", "flat p=2", "flat p=4", "every_step", "1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"),
    "nodes": ("1x4", "2x2", "2x2 hierarchical"),
    "meta": ("real", "meta"),
    "arena": ("arena", "no arena"),
    "precision": ("fp32", "bf16", "fp16"),
    "codegen": ("eager", "auto", "inductor"),
    "optimizer_sharding": ("auto", "partition", "world"),
    "checkpoint": ("none", "full", "selective", "attention", "offload"),
    "clip": ("none", "finite", "inf"),
    "loss": ("mean", "token"),
    "optimizer": ("sgd", "adamw"),
    "tensor": ("tp=1", "tp=2", "tp=2 sequence"),
    "context": ("cp=1", "cp=2"),
}
"""Each axis and its values (the plan family and schedule together: a schedule is a pipeline's)."""

PIPELINES = ("1f1b", "gpipe", "interleaved", "zb-h1", "zb-v")
TWO_CHUNKS = ("interleaved", "zb-v")
"""The schedules with two chunks per rank."""
HF = tuple(m for m in AXES["model"] if m.startswith("hf-"))
TENSOR = ("tp=2", "tp=2 sequence")
NO_TOKENS = ("convnet", "quirky", "random")
"""Models that read no (batch, sequence) token ids."""


@dataclass(frozen=True)
class Exclusion:
    """Value pairs no case holds: refused before any collective by design (each refusal has its test), or
    not expressible by the fuzzer. Every other pair of AXES is covered."""

    axis: str
    values: tuple[str, ...]
    other: str
    other_values: tuple[str, ...]
    why: str


EXCLUDED = (
    Exclusion("model", ("convnet", "quirky"), "plan", TWO_CHUNKS,
              "refused: 4 chunks of a net with 2-3 blocks that read parameters ('use at most 3')"),
    Exclusion("model", HF, "meta", ("meta",),
              "refused: Hugging Face norms have no reset_parameters() and their buffers are set in __init__ "
              "('pass init_fn=')"),
    Exclusion("model", ("convnet", "quirky", *HF), "loss", ("token",),
              "the fuzzer's (sum, count) loss is the LM's and RandomNet's"),
    Exclusion("plan", ("every_step",), "optimizer_sharding", ("world",),
              "refused: every_step has no boundary all-reduce to turn into a reduce-scatter"),
    Exclusion("nodes", ("2x2 hierarchical",), "plan", ("flat p=1", "flat p=2", *PIPELINES),
              "hierarchical collectives need a partition group spanning nodes (p = 4 > k = 2)"),
    Exclusion("tensor", TENSOR, "plan", ("flat p=4", "every_step"),
              "4 ranks in tensor groups of 2 leave p <= 2; tensor groups with grad_sync='every_step' are refused"),
    Exclusion("tensor", TENSOR, "nodes", ("2x2 hierarchical",),
              "the hierarchical rows hold p = 4, more than 2 tensor groups"),
    Exclusion("tensor", ("tp=2 sequence",), "model", NO_TOKENS,
              "refused: sequence parallelism splits a sequence of token ids, which these models do not read"),
    Exclusion("checkpoint", ("attention",), "model", NO_TOKENS,
              "refused: checkpoint='attention' recomputes the sequence x sequence values of a model of token ids"),
    Exclusion("context", ("cp=2",), "model", ("tied_lm", *NO_TOKENS),
              "refused: no fused attention for the context ranks to exchange (data parallelism trains it alike)"),
    Exclusion("context", ("cp=2",), "plan", PIPELINES,
              "refused: context parallelism with pipeline stages is not built"),
    Exclusion("context", ("cp=2",), "tensor", TENSOR,
              "refused: context parallelism with tensor groups is not built"),
    Exclusion("context", ("cp=2",), "meta", ("meta",),
              "the models with attention are the Hugging Face ones, which a meta model excludes (above)"),
    Exclusion("context", ("cp=2",), "loss", ("token",),
              "the fuzzer's (sum, count) loss is the LM's and RandomNet's, which have no attention"),
)

RANDOM_ONLY = ("memory_budget_bytes", "max_gathers_in_flight")
"""The Plan fields only the random seeds draw (a budget below a bucket is a refusal, not a pairing); every
other Plan field is set by some covering case (tests/test_fuzz.py), through an axis or drawn beside it."""
DEVICE_ONLY = ("cuda_graph",)
"""The Plan fields that change nothing on the CPU the fuzzer trains on (a CUDA graph needs a CUDA device: "auto" is
off there, True refused): tests/test_cuda_graph.py checks them on a CPU, tests/test_cuda_paths.py on a GPU."""


def _constraints() -> list[dict]:
    return [{"operator": "not", "condition": {"operator": "and", "conditions": [
        {"operator": "in", "left": e.axis, "values": list(e.values)},
        {"operator": "in", "left": e.other, "values": list(e.other_values)}]}} for e in EXCLUDED]


def excluded(a: str, x: str, b: str, y: str) -> Exclusion | None:
    """The exclusion that keeps value ``x`` of axis ``a`` from value ``y`` of axis ``b``, if one does."""
    for e in EXCLUDED:
        for (p, v), (q, w) in (((a, x), (b, y)), ((b, y), (a, x))):
            if p == e.axis and v in e.values and q == e.other and w in e.other_values:
                return e
    return None


def covering_rows() -> list[dict[str, str]]:
    """The covering design: each row a dict axis -> value; every pair not ``excluded`` in some row."""
    from covertable import make

    return make(AXES, constraints=_constraints())


def _splits(net: RandomNet) -> bool:
    """Whether tensor parallelism (tp=2) splits ``net`` (rank-local: its trace analysed)."""
    from micscompile.lowering.tensor_split import TensorSplitError, analyse

    batch = net.batches(1, 2)[0]
    try:
        analyse(mc.trace(net, batch, _mean, num_model_inputs=net.inputs), 2)
    except TensorSplitError:
        return False
    return True


def cover(index: int, row: dict[str, str]) -> FuzzCase:
    """Covering row ``index`` as a case: its axis values, the rest drawn from ``random.Random(index)``."""
    rng = random.Random(index)
    model, kind, nodes = row["model"], row["plan"], row["nodes"]
    hf = model.startswith("hf-")
    local = HF_BATCH if hf else LOCAL_BATCH
    plan: dict = {}
    layers = rng.choice([2, 4, 6])
    if kind in PIPELINES:
        # the chunks must not outnumber the blocks that read parameters: 4 stages of 2 chunks only for the
        # 6-block LM, 4 stages only for it and the Hugging Face models (the conv net and the quirky graph
        # have 2-3 such blocks, a RandomNet may have 4)
        many = model == "tied_lm" or (hf and kind not in TWO_CHUNKS)
        stages = 4 if many and row["tensor"] == "tp=1" and rng.random() < 0.35 else 2  # (tp=2: 2 stages of 1)
        if stages == 4 and model == "tied_lm":
            layers = 6
        plan.update(pipeline_stages=stages, partition_size=1 if stages == 4 or row["tensor"] in TENSOR else
                    rng.choice([1, 2]))
        if kind != "1f1b":
            plan["pipeline_schedule"] = kind
        if kind == "interleaved":
            plan["pipeline_chunks"] = 2
        ms = [m for m in (1, 2, 3, 4) if local % m == 0 and (kind != "interleaved" or m % stages == 0)]
    else:
        p = {"flat p=1": 1, "flat p=2": 2, "flat p=4": 4}.get(kind) or rng.choice([2, 4])
        if nodes == "2x2 hierarchical":
            p = 4
        plan["partition_size"] = p
        if kind == "every_step":
            plan["grad_sync"] = "every_step"
        ms = [m for m in (1, 2, 3, 4) if local % m == 0]
    if row["tensor"] in TENSOR:
        plan["tensor_parallel_size"] = 2
    if row["tensor"] == "tp=2 sequence":
        plan["sequence_parallel"] = True
    m = rng.choice(ms)
    if m > 1:
        plan["micro_batches"] = m
    if nodes != "1x4":
        plan["gpus_per_node"] = 2
        if nodes == "2x2 hierarchical":
            plan["hierarchical"] = True
        elif plan["partition_size"] == 4:
            plan["hierarchical"] = rng.choice(["auto", False])
    if kind not in PIPELINES and rng.random() < 0.25:  # (a pipeline's tied weight needs a bucket of its own)
        plan["bucket_bytes"] = 1 << rng.randint(8, 14)
    if row["checkpoint"] != "none":
        plan["checkpoint"] = {"full": True, "selective": "selective", "attention": "attention"}.get(
            row["checkpoint"]) or rng.choice([True, "selective"])  # offload: after either
        if rng.random() < 0.4:
            plan["checkpoint_every"] = 2
        if row["checkpoint"] == "offload":
            plan["offload_activations"] = True
    if row["precision"] != "fp32":
        plan["param_dtype"] = {"bf16": torch.bfloat16, "fp16": torch.float16}[row["precision"]]
        if rng.random() < 0.5:
            plan["reduce_dtype"] = plan["param_dtype"]
    if row["codegen"] != "eager":
        plan["codegen"] = row["codegen"]
    if row["optimizer_sharding"] != "auto":
        plan["optimizer_sharding"] = row["optimizer_sharding"]
    if row["context"] == "cp=2":
        plan.update(context_parallel_size=2, context_parallel_exchange="ulysses")
    prefetch = None
    if rng.random() < 0.3:  # a pipeline takes a prefetch distance only (its gathers stay in their phase)
        pipe = kind in PIPELINES
        prefetch = mc.Prefetch(distance=rng.randint(0, 3), keep_live=0 if pipe else rng.randint(0, 2),
                               across_micro_steps=not pipe and m > 1 and rng.random() < 0.5)
    seed = index
    # a block writing in place what recomputation reads is refused (docs/reliability.md), and so is, under
    # tensor groups, a weight two matmuls read split differently (docs/usage.md): a RandomNet without them
    while model == "random" and (row["checkpoint"] != "none" and any(b.kind == "inplace"
                                                                     for b in RandomNet(seed).blocks)
                                 or row["tensor"] in TENSOR and not _splits(RandomNet(seed))):
        seed += 1000
    clip = {"none": None, "finite": rng.choice([0.05, 1.0]), "inf": float("inf")}[row["clip"]]
    return FuzzCase(seed=seed, model=model.split("-")[0], layers=layers, hf=model[3:] if hf else "gpt2",
                    gpus_per_node=plan.pop("gpus_per_node", None), plan=tuple(plan.items()), prefetch=prefetch,
                    opt=row["optimizer"], clip=clip,
                    counted=row["loss"] == "token", meta=row["meta"] == "meta", arena=row["arena"] == "arena",
                    row=tuple(row.items()))


def coverage_table(rows: list[dict[str, str]], outcomes: list[str]) -> list[str]:
    """One line per pair of axes: its value pairs, how many some case trained with parity, how many only
    refusals held, how many failed, how many are excluded (and by what), and any left uncovered."""
    lines = [f"{'axes':<32} {'pairs':>5} {'trained':>7} {'refused':>7} {'failed':>6} {'excluded':>8} {'uncovered':>9}"]
    names = list(AXES)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            counts = collections.Counter()
            for x in AXES[a]:
                for y in AXES[b]:
                    seen = {o for r, o in zip(rows, outcomes) if r[a] == x and r[b] == y}
                    counts["pairs"] += 1
                    counts["failed" if "failed" in seen else "trained" if "parity" in seen else "refused" if seen
                           else "excluded" if excluded(a, x, b, y) else "uncovered"] += 1
            lines.append(f"{a + ' x ' + b:<32} {counts['pairs']:>5} {counts['trained']:>7} {counts['refused']:>7} "
                         f"{counts['failed']:>6} {counts['excluded']:>8} {counts['uncovered']:>9}")
    return lines


class _StepRecord(LossScaler):
    """A loss scaler that remembers which steps it skipped (a non-finite fp16 gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.history: list[bool] = []

    def update(self, finite: bool) -> None:
        self.history.append(finite)
        super().update(finite)

    @property
    def skipped(self) -> list[int]:
        return [i for i, finite in enumerate(self.history) if not finite]


def _init_fn(case: FuzzCase):
    """A meta model's ``init_fn``: the default (``reset_parameters()``) but for the quirky model, whose root's
    ``temp`` has none: there the module's own parameters are drawn from N(0, 1) (a user's init_fn)."""
    if case.model != "quirky":
        return None

    def init(module):
        if callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        else:
            with torch.no_grad():
                for p in module.parameters(recurse=False):
                    p.normal_()
    return init


def _sum_count(logits, y):
    """The token-weighted loss: cross-entropy summed over the targets that are not ignored, and their count."""
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=-100, reduction="sum"), (y != -100).sum()


def _mean(logits, y):
    return F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=-100)


def setup(case: FuzzCase, global_batch: int):
    """(build the model, model -> loss_fn, the global batches, num_model_inputs) of ``case``."""
    if case.model == "hf":
        from micscompile.zoo import hf_models

        def build():
            return hf_models.build(case.hf, seq_len=HF_SEQ)
        gen = torch.Generator().manual_seed(1)
        probe = build()
        batches = [hf_models.lm_batch(probe, global_batch, HF_SEQ, gen) for _ in range(STEPS)]
        return build, lambda m: hf_models.lm_loss, batches, 1
    if case.model == "random":
        def build():
            return RandomNet(case.seed)
        probe = build()
        loss = _sum_count if case.counted else _mean
        return build, lambda m: loss, probe.batches(STEPS, global_batch, padded=case.counted), probe.inputs
    if case.model == "tied_lm":
        vocab = 29 if dict(case.plan).get("tensor_parallel_size", 1) == 1 else 30  # (a vocabulary tp divides)
        batches = lm_batches(STEPS, global_batch, vocab=vocab)
        if case.counted:  # sample i keeps (i * 7 + k) % 6 of its 6 targets: ranks hold unequal counts
            for k, (_, y) in enumerate(batches):
                for i in range(global_batch):
                    y[i, (i * 7 + k) % 6:] = -100
        return (lambda: TiedLM(vocab, layers=case.layers)), (lambda m: _sum_count if case.counted else _mean), batches, 1
    cls, make_loss, make_batches = MODELS[case.model]
    return cls, make_loss, make_batches(STEPS, global_batch), 1


def _optimizer(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)
    return lambda ps: torch.optim.AdamW(ps, lr=1e-3)


def run_case(rank: int, world: int, case: FuzzCase) -> dict:
    """Train ``case`` on this rank and its reference: parity errors. Raises what the plan raises."""
    stage = "plan"
    try:
        plan = mc.Plan(**case.kwargs)
        rp = plan.resolve(world, case.gpus_per_node or world)
        stage = "reference"  # (an error here, even from micscompile.cli.parity, is the fuzzer's own: failed)
        # ranks (tensor groups; with context parallelism, context groups) that each take their own slice of the
        # global batch
        chains = rp.data_parallel_size // rp.context
        local_batch = HF_BATCH if case.model == "hf" else LOCAL_BATCH
        build, make_loss, batches, n_in = setup(case, local_batch * chains)
        torch.manual_seed(0)
        model = build()
        init_fn = _init_fn(case)
        if case.meta:
            torch.manual_seed(1)
            initialize(model, init_fn)
        opt = _optimizer(case.opt)
        pieces = chains * plan.micro_batches

        def reference(batches, dtype=plan.param_dtype, reduce_dtype=plan.reduce_dtype, scaler=None, compiled=False,
                      skip_steps=(), split_sums=1):
            return train_reference_mixed(copy.deepcopy(model), make_loss, opt, batches, pieces, dtype,
                                         num_model_inputs=n_in, max_grad_norm=case.clip, reduce_dtype=reduce_dtype,
                                         micro_batches=plan.micro_batches, loss_scaler=scaler, compiled=compiled,
                                         skip_steps=skip_steps, split_sums=split_sums,
                                         partition_size=None if plan.grad_sync == "every_step" else rp.partition_size)
        scaler = _StepRecord()
        ref_losses, ref_state = reference(batches, scaler=scaler)
        # the same reference summed in the reverse order: how far summation order alone moves each value
        rev_losses, rev_state = reference([[torch.cat(x.chunk(pieces)[::-1]) for x in b] for b in batches])
        # and computed in float64 (skipping the steps an fp16 reference's loss scale skipped): how far rounding
        # alone moves it
        exact = reference(batches, torch.float64, torch.float32, skip_steps=scaler.skipped)
        if case.meta:
            with torch.device("meta"):
                model = build()
            torch.manual_seed(1)
        group = rank // rp.tensor  # (a tensor group's ranks take the same slice)
        chain = group // (rp.stages * rp.partition_size) * rp.partition_size + group % rp.partition_size
        if rp.context > 1:  # (a context group's ranks too: each its part of the sequences; flat plans, tp = 1)
            chain = rank // rp.context
        local = [tuple(x[chain * local_batch : (chain + 1) * local_batch] for x in b) for b in batches]
        stage = "compile"
        step = mc.compile(model, plan, loss_fn=make_loss(model), optimizer=opt, example_inputs=local[0],
                          num_model_inputs=n_in, prefetch=None if case.prefetch is None else (case.prefetch,),
                          arena=case.arena, max_grad_norm=case.clip, init_fn=init_fn, cluster=case.cluster(world))
        stage = "steps"
        losses = [float(step(*b)) for b in local]
        state = step.full_state_dict()
    except Exception as exc:  # noqa: BLE001 - the class, message and place are the outcome
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return {"error": f"{type(exc).__name__}: {exc}", "stage": stage, "where": f"{frame.filename}:{frame.lineno}",
                "ours": str(Path(frame.filename).resolve()).startswith(MICSCOMPILE)}
    def errors(losses, state):
        return [rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)] + [
            rel_error(state[k], ref_state[k]) for k in sorted(ref_state)]
    if state.keys() != ref_state.keys():
        return {"error": f"state dict keys differ: {sorted(state.keys() ^ ref_state.keys())}", "stage": "steps",
                "ours": True}
    floor = [max(f, r) for f, r in zip(errors(rev_losses, rev_state), errors(*exact))]
    errs = errors(losses, state)
    mixed = plan.param_dtype != torch.float32 or plan.reduce_dtype != torch.float32
    if step.codegen is not None and not _within(errs, floor, mixed):
        # Inductor's regions round as fused kernels do: the floor of a reference compiled alike (docs/design.md;
        # only where the others fall short, since compiling the reference takes tens of seconds)
        # Under AdamW its state's worst distance is every tensor's floor, as for the tensor-parallel floor below:
        # regions cut otherwise than the reference's (a pipeline's chunks) round other sums, and which near-zero
        # gradients that flips (2 lr each) is chance
        compiled = errors(*reference(batches, compiled=True))
        level = max(compiled[len(losses):], default=0.0) if case.opt == "adamw" else 0.0
        floor = [max(f, c if i < len(losses) else max(c, level)) for i, (f, c) in enumerate(zip(floor, compiled))]
    if rp.tensor > 1 and not _within(errs, floor, mixed):
        # a tensor-parallel matmul rounds each rank's partial product before summing them: the floor of a
        # reference whose matmuls by a weight sum tp partial products alike (docs/design.md). Its state's
        # worst distance is every tensor's floor: AdamW's first steps are lr * sign(g), so which near-zero
        # gradients a second rounding flips (2 lr each) is chance, and the reference flips others than the run
        split = errors(*reference(batches, split_sums=rp.tensor, skip_steps=scaler.skipped))
        level = max(split[len(losses):], default=0.0)
        floor = [max(f, s if i < len(losses) else level) for i, (f, s) in enumerate(zip(floor, split))]
    return {
        "errors": errs, "floor": floor,
        "names": [f"loss {i}" for i in range(len(losses))] + sorted(ref_state),
        "mixed": mixed,
        "codegen": step.codegen_choice if rank == 0 else None,
    }


def _within(errors: list[float], floor: list[float], mixed: bool) -> bool:
    """Every value within the tolerance or ORDER_MARGIN times its noise floor (the judge's rule)."""
    tol = LOW_PRECISION_TOLERANCE if mixed else TOLERANCE
    return all(e <= max(tol, ORDER_MARGIN * f) for e, f in zip(errors, floor))


def classify(case: FuzzCase, timeout_s: float) -> tuple[str, str]:
    """(outcome, detail) of one case on ``WORLD`` fresh gloo ranks."""
    try:
        values = launch(run_case, WORLD, case, timeout_s=timeout_s, pg_timeout_s=min(60.0, timeout_s))
    except RuntimeError as exc:  # a rank crashed or hung
        return "failed", str(exc).splitlines()[0][:300]
    return judge(values)


def judge(values: list[dict]) -> tuple[str, str]:
    """(outcome, detail) from every rank's ``run_case`` result."""
    errors = [v for v in values if "error" in v]
    if errors:
        first = errors[0]
        disagree = any(hint in first["error"] for hint in AGREEMENT_HINTS.values())  # (every rank had the same input)
        disagree = disagree or first["error"].startswith(INTERNAL)  # a check of micscompile's own consistency
        if not disagree and len(errors) == len(values) and all(
                e["error"] == first["error"] and e["stage"] in ("plan", "compile") and e["ours"] for e in errors):
            return "refused", first["error"][:300]
        return "failed", f"{first['stage']}: {first['error'][:300]} (at {first.get('where', '?')})"
    tol = LOW_PRECISION_TOLERANCE if values[0]["mixed"] else TOLERANCE
    # each value within the tolerance, or within ORDER_MARGIN times what reordering the reference's sum or
    # rounding moves it (AdamW turns noise on a near-zero gradient into whole lr-sized steps)
    worst, floor, name = max((e, f, n) for v in values for e, f, n in zip(v["errors"], v["floor"], v["names"]))
    bad = [(e, f, n) for v in values for e, f, n in zip(v["errors"], v["floor"], v["names"])
           if e > max(tol, ORDER_MARGIN * f)]
    if bad:
        e, f, n = max(bad)
        return "failed", f"parity: {n} error {e:.2e} > {tol:.0e} and > {ORDER_MARGIN} x its noise floor {f:.1e}"
    within = "" if worst <= tol else f", within {ORDER_MARGIN} x the noise floor {floor:.1e} of {name}"
    return "parity", f"max error {worst:.1e}{within}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="cases")
    ap.add_argument("--seed", type=int, default=0, help="the first case's seed (case i: seed + i)")
    ap.add_argument("--replay", type=int, default=None, help="run the one case of this seed")
    ap.add_argument("--cover", action="store_true",
                    help="run the covering design (every pair of AXES' values) instead of random seeds")
    ap.add_argument("--cover-row", type=int, default=None, help="run one row of the covering design")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before a case counts as hung")
    ap.add_argument("--json", type=Path, default=None, help="also write the outcomes here")
    args = ap.parse_args(argv)
    rows = covering_rows() if args.cover or args.cover_row is not None else []
    if args.cover_row is not None:
        if not 0 <= args.cover_row < len(rows):
            ap.error(f"--cover-row: the covering design has rows 0-{len(rows) - 1}")
        cases = {f"row {args.cover_row}": cover(args.cover_row, rows[args.cover_row])}
    elif args.cover:
        cases = {f"row {i}": cover(i, row) for i, row in enumerate(rows)}
    else:
        seeds = [args.replay] if args.replay is not None else range(args.seed, args.seed + args.n)
        cases = {f"seed {seed}": draw(seed) for seed in seeds}
    outcomes: dict[str, tuple[str, str, FuzzCase]] = {}
    start = time.perf_counter()
    for i, (label, case) in enumerate(cases.items()):
        outcome, detail = classify(case, args.timeout)
        outcomes[label] = (outcome, detail, case)
        print(f"[{i + 1}/{len(cases)}] {label}: {outcome:<8} {case.id}  ({detail})  "
              f"{time.perf_counter() - start:.0f} s", flush=True)
    counts = collections.Counter(o for o, _, _ in outcomes.values())
    labels = list(outcomes)
    print(f"\n{labels[0]} - {labels[-1]}: {len(outcomes)} configurations, {counts['parity']} trained with parity, "
          f"{counts['refused']} refused before any collective, {counts['failed']} failed, "
          f"{time.perf_counter() - start:.0f} s")
    if args.cover and len(cases) == len(rows):
        print("\nEvery pair of axis values, by what the cases holding it did:")
        print("\n".join(coverage_table(rows, [o for o, _, _ in outcomes.values()])))
        for e in EXCLUDED:
            print(f"  excluded: {e.axis} {'/'.join(e.values)} x {e.other} {'/'.join(e.other_values)}: {e.why}")
    refusals = collections.Counter(detail.split(":")[0] + ": " + detail.split(":", 1)[1][:90]
                                   for o, detail, _ in outcomes.values() if o == "refused")
    for why, n in refusals.most_common():
        print(f"  refused x{n}: {why}")
    for label, (outcome, detail, case) in outcomes.items():
        if outcome == "failed":
            how = f"--cover-row {label[4:]}" if case.row else f"--replay {label[5:]}"
            print(f"  FAILED {label} {case.id}: {detail}\n    replay: OMP_NUM_THREADS=1 python "
                  f"benchmarks/fuzz_plans.py {how}")
    if args.json:
        import json

        args.json.write_text(json.dumps({label: {"outcome": o, "detail": d, "case": c.id, "row": dict(c.row)}
                                         for label, (o, d, c) in outcomes.items()}, indent=1))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
