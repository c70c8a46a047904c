"""What a real training run needs, on 4 real gloo ranks in one launch: gradient clipping
(``max_grad_norm``, ``step.grad_norm``, a non-finite norm skipped on every rank) and the token-weighted
loss (``loss_fn`` returning ``(loss_sum, count)``), each against single-process eager PyTorch on the same
global batch, for flat plans p in {1, 2, 4}, s in {1, 3} and pipeline plans; bad input refused first."""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from harness import launch, run_cases
from models import TiedLM, lm_batches
from torch.nn import functional as F

import micscompile as mc
from micscompile.cli.parity import LOW_PRECISION_TOLERANCE, TOLERANCE, rel_error, state_error, train_reference_mixed
from micscompile.runtime.loss_scale import LossScaler

WORLD, STEPS, LOCAL_BATCH = 4, 4, 6
HELD_OUT = lm_batches(1, LOCAL_BATCH * WORLD, seed=1)[0]
MAX_NORM = 0.05  # below every step's norm: the clipping acts on each step
pytestmark = pytest.mark.multiproc


def lm_sum_count(out, y):
    """The token-weighted loss: summed cross-entropy over the targets that are not ignored, and their count."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum"), (y != -100).sum()


def lm_mean(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100)


def padded_batches(global_batch: int, padded: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Targets padded with ignore_index unevenly: sample i keeps (i * 7) % 6 of its 6 targets (some none),
    so micro-batches and ranks hold different numbers of tokens (``padded=False``: none padded; the
    mean of per-micro-batch means is then the whole batch's mean)."""
    out = []
    for k, (x, y) in enumerate(lm_batches(STEPS, global_batch)):
        y = y.clone()
        for i in range(global_batch if padded else 0):
            y[i, (i * 7 + k) % 6:] = -100
        out.append((x, y))
    return out


@dataclass(frozen=True)
class Case:
    p: int
    s: int
    stages: int = 1
    counted: bool = True
    """loss_fn returns (loss_sum, count); False: the mean loss."""
    clip: float | None = MAX_NORM
    opt: str = "sgd"
    v: int = 1
    """Pipeline chunks per rank (interleaved 1F1B when > 1)."""

    @property
    def id(self) -> str:
        pipe = f"-S{self.stages}" + (f"v{self.v}" if self.v > 1 else "") if self.stages > 1 else ""
        return f"p{self.p}-s{self.s}{pipe}-{'sumcount' if self.counted else 'mean'}-clip{self.clip}-{self.opt}"


CASES = [Case(p, s) for p in (1, 2, 4) for s in (1, 3)] + [
    Case(2, 3, counted=False),  # the mean loss: the step's own 1 / (n * s) scale, clipped
    Case(4, 3, clip=None, opt="adamw"),  # the token mean alone
    Case(2, 1, clip=float("inf")),  # the norm measured, never clipped
    Case(2, 2, stages=2),  # t = 2, d = 1: the tied embedding on both stages, counted once
    Case(1, 3, stages=2, opt="adamw"),  # t = 1, d = 2: one replica of each shard counted
    Case(1, 2, stages=2, v=2),  # interleaved: each rank holds two chunks, evaluated in chunk order
]


def _optimizer(name: str, groups: bool = True):
    """SGD with momentum or AdamW; weight decay 0.1 on the parameters of two or more dimensions only:
    through ``mc.decay_groups`` for the step, and by hand for eager (``groups=False``: one group)."""
    def make(params):
        if not groups:
            spec = params
        elif isinstance(params, mc.ShardParams):
            spec = mc.decay_groups(params, weight_decay=0.1)
        else:  # eager: the same rule written out
            spec = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        if name == "sgd":
            return torch.optim.SGD(spec, lr=0.5, momentum=0.9)
        return torch.optim.AdamW(spec, lr=1e-2)
    return make


def _schedule(optimizer):
    """Linear warmup over 2 steps, then cosine to 0 at STEPS: what LLM recipes run."""
    import math

    def factor(i):
        return (i + 1) / 2 if i < 2 else 0.5 * (1 + math.cos(math.pi * (i - 2) / (STEPS - 2)))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _reference(model, loss_fn, opt, batches, clip, scheduled: bool = True, held_out=None):
    """Eager on the whole global batch: losses, norms before clipping, final state, and the
    evaluation loss of the trained model on the held-out batch (``eval()``, no grad)."""
    model = copy.deepcopy(model)
    optim = opt(list(model.parameters()))
    schedule = _schedule(optim) if scheduled else None
    losses, norms = [], []
    for x, y in batches:
        optim.zero_grad()
        loss = lm_mean(model(x), y)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optim.step()
        if schedule is not None:
            schedule.step()
        losses.append(float(loss.detach()))
    model.eval()
    with torch.no_grad():
        x, y = HELD_OUT if held_out is None else held_out
        evaluation = float(lm_mean(model(x), y))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}, evaluation


def run_case(case: Case, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = TiedLM(layers=4)
    chains = world // case.stages
    batches = padded_batches(LOCAL_BATCH * chains, padded=case.counted)
    opt = _optimizer(case.opt)
    held_out = tuple(t[: LOCAL_BATCH * chains] for t in HELD_OUT)  # one local batch per chain
    ref_losses, ref_norms, ref_state, ref_eval = _reference(model, lm_mean, opt, batches, case.clip, held_out=held_out)
    plan = mc.Plan(partition_size=case.p, micro_batches=case.s, pipeline_stages=case.stages, pipeline_chunks=case.v,
                   pipeline_schedule="interleaved" if case.v > 1 else "1f1b")
    chain = rank // (case.stages * case.p) * case.p + rank % case.p if case.stages > 1 else rank
    local = [tuple(t[chain * LOCAL_BATCH : (chain + 1) * LOCAL_BATCH] for t in b) for b in batches]
    step = mc.compile(model, plan, loss_fn=lm_sum_count if case.counted else lm_mean, optimizer=opt,
                      example_inputs=local[0], max_grad_norm=case.clip)
    schedule = _schedule(step.optimizer)
    losses, norms, lrs = [], [], []
    for b in local:
        lrs.append(step.optimizer.param_groups[0]["lr"])  # the rate this step trains at
        losses.append(float(step(*b)))
        schedule.step()
        if case.clip is not None:
            norms.append(float(step.grad_norm))
    # the trained weights on a held-out batch, forward only
    before = {k: v.clone() for k, v in step.local_shards().items()}
    step.track_memory = True
    value = float(step.evaluate(*(t[chain * LOCAL_BATCH:(chain + 1) * LOCAL_BATCH] for t in held_out)))
    memory = step.memory_stats()
    programs = step.eval_program.values() if isinstance(step.eval_program, dict) else [step.eval_program]
    evaluation = {
        "err": rel_error(torch.tensor(value), torch.tensor(ref_eval)), "value": value, "ref": ref_eval,
        "unchanged": all(torch.equal(v, before[k]) for k, v in step.local_shards().items()),
        "kinds": sorted({k[0] for k in step.eval_stats.rows}),
        "program_kinds": sorted({a.kind.name for p in programs for a in p.micro_step + p.boundary}),
        "peak": memory.evaluate_measured_peak_bytes,
        "train_peak": memory.arena_bytes + memory.outside_planned_peak_bytes,
    }
    return {
        "evaluation": evaluation, "lrs": lrs, "groups": [(g["weight_decay"], len(g["params"]))
                                                        for g in step.optimizer.param_groups],
        "losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
        "loss_err": max(rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, ref_losses)),
        "norm_err": max((rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(norms, ref_norms)), default=0.0),
        "state_err": state_error(step.full_state_dict(), ref_state),
        "skipped": step.skipped_steps,
    }


def nonfinite(rank: int, world: int) -> dict:
    """A step whose gradient is not finite: skipped on every rank, counted, warned about once; the
    next finite step trains as the eager run that never saw it."""
    torch.manual_seed(0)
    model = TiedLM(layers=2)
    batches = padded_batches(LOCAL_BATCH * world)
    local = [tuple(t[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH] for t in b) for b in batches]
    opt = _optimizer("adamw", groups=False)
    _, _, ref_state, _ = _reference(model, lm_mean, opt, batches[1:2], 1.0, scheduled=False)
    step = mc.compile(model, mc.Plan(partition_size=2), loss_fn=lm_sum_count, optimizer=opt,
                      example_inputs=local[0], max_grad_norm=1.0)
    saved = {k: v.clone() for k, v in step.local_shards().items()}
    name = next(n for n, p in step.params.items() if p.numel())
    with torch.no_grad():  # an overflowing weight on every rank: the norm is not finite
        step.params[name][0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(*local[0])
        first_norm = float(step.grad_norm)
        with torch.no_grad():  # the weight put back: the next step is the eager run's first
            step.params[name][0] = saved[name][0]
        unchanged = all(torch.equal(v, saved[k]) for k, v in step.local_shards().items())
        step(*local[1])
    return {"first_norm": first_norm, "norm_finite": bool(torch.isfinite(step.grad_norm)),
            "skipped": step.skipped_steps, "warnings": [str(w.message) for w in caught], "unchanged": unchanged,
            "state_err": state_error(step.full_state_dict(), ref_state)}


def fp16_overflow(rank: int, world: int) -> dict:
    """fp16 with a loss 30x too large, for p in {1, 2, 4} x s in {1, 3}: the first steps overflow and are
    skipped on every rank while the scale backs off, then training goes on and the scale grows again
    (interval 2); the eager reference scaled the same way (``train_reference_mixed``) gives the same
    losses and weights."""
    out = {}
    for p, s in ((p, s) for p in (1, 2, 4) for s in (1, 3)):
        torch.manual_seed(0)
        model = TiedLM(layers=2)
        batches = lm_batches(8, LOCAL_BATCH * world)
        opt = lambda ps: torch.optim.SGD(ps, lr=0.01)  # noqa: E731
        big = lambda model: (lambda out, y: lm_mean(out, y) * 30)  # noqa: E731
        ref_scaler = LossScaler(growth_interval=2)
        ref_losses, ref_state = train_reference_mixed(copy.deepcopy(model), big, opt, batches, world * s,
                                                      torch.float16, loss_scaler=ref_scaler)
        local = [tuple(t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for t in b) for b in batches]
        step = mc.compile(model, mc.Plan(partition_size=p, micro_batches=s, param_dtype=torch.float16),
                          loss_fn=big(model), optimizer=opt, example_inputs=local[0])
        step.loss_scaler.growth_interval = 2
        losses, scales = [], []
        for b in local:
            losses.append(float(step(*b)))
            scales.append(step.loss_scaler.scale)
        out[(p, s)] = {"losses": losses, "ref_losses": ref_losses, "scales": scales, "skipped": step.skipped_steps,
                       "ref_scaler": (ref_scaler.scale, ref_scaler.growth_tracker),
                       "saved": step.state_dict()["loss_scale"],
                       "state_err": state_error(step.full_state_dict(), ref_state)}
    return out


def short_last_batch(rank: int, world: int) -> dict:
    """A last batch with fewer samples than the step's shape (here 4 of 6 per rank), padded to it with
    targets of ignore_index: with the counted loss, exactly eager's step on the short global batch. An
    unpadded one is refused, naming the shape the step takes."""
    torch.manual_seed(0)
    model = TiedLM(layers=2)
    full, short = lm_batches(2, LOCAL_BATCH * world)
    real = 4
    x, y = (t[rank * LOCAL_BATCH : rank * LOCAL_BATCH + real] for t in short)  # this rank's 4 real samples
    globally = tuple(torch.cat([t[r * LOCAL_BATCH : r * LOCAL_BATCH + real] for r in range(world)]) for t in short)
    _, _, ref_state, _ = _reference(model, lm_mean, _optimizer("sgd", groups=False), [full, globally], None,
                                    scheduled=False)
    step = mc.compile(model, mc.Plan(partition_size=2, micro_batches=3), loss_fn=lm_sum_count,
                      optimizer=_optimizer("sgd", groups=False),
                      example_inputs=tuple(t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for t in full))
    step(*(t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for t in full))
    refused = []
    for run in (step, step.evaluate):  # both refuse it before any collective
        try:
            run(x, y)
            refused.append("no error")
        except ValueError as exc:
            refused.append(str(exc))
    pad = LOCAL_BATCH - real
    step(torch.cat([x, x.new_zeros(pad, x.shape[1])]), torch.cat([y, y.new_full((pad, y.shape[1]), -100)]))
    return {"refused": refused, "state_err": state_error(step.full_state_dict(), ref_state)}


class DropLM(TiedLM):
    """TiedLM with dropout after the embedding: evaluation must run it as in ``eval()``."""

    def __init__(self) -> None:
        super().__init__(layers=2)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, idx):
        x = self.drop(self.emb(idx))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def dropout_eval(rank: int, world: int) -> dict:
    """A model with dropout evaluates as eager's ``eval()`` (twice the same), and trains after it."""
    torch.manual_seed(0)
    model = DropLM()
    with torch.no_grad():
        ref = float(lm_mean(copy.deepcopy(model).eval()(HELD_OUT[0]), HELD_OUT[1]))
    local = tuple(t[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for t in HELD_OUT)
    step = mc.compile(model, mc.Plan(partition_size=2, micro_batches=3), loss_fn=lm_sum_count,
                      optimizer=_optimizer("sgd"), example_inputs=local)
    values = [float(step.evaluate(*local)) for _ in range(2)]
    return {"values": values, "ref": ref, "train": float(step(*local)), "training": model.training}


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Each raises before any collective (the cases after it would hang otherwise)."""
    torch.manual_seed(0)
    model = TiedLM(layers=1)
    x, y = lm_batches(1, LOCAL_BATCH)[0]
    out = {}
    for key, kwargs in {
        "negative": dict(loss_fn=lm_sum_count, max_grad_norm=-1.0),
        "string": dict(loss_fn=lm_sum_count, max_grad_norm="1"),
        "triple": dict(loss_fn=lambda o, y: (*lm_sum_count(o, y), y.sum())),
        "count_with_grad": dict(loss_fn=lambda o, y: (lm_sum_count(o, y)[0], o.sum())),
    }.items():
        try:
            mc.compile(model, mc.Plan(partition_size=2), optimizer=_optimizer("sgd"), example_inputs=(x, y), **kwargs)
            out[key] = "no error"
        except Exception as exc:  # noqa: BLE001 - the message is what the test checks
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def run_all(rank: int, world: int) -> dict:
    results = run_cases(rank, world, bad_inputs, run_case, CASES)
    results["nonfinite"] = nonfinite(rank, world)
    results["dropout"] = dropout_eval(rank, world)
    results["fp16"] = fp16_overflow(rank, world)
    results["short"] = short_last_batch(rank, world)
    return results


@pytest.fixture(scope="module")
def results():
    return launch(run_all, WORLD, timeout_s=400)


def test_bad_input_is_refused_before_any_collective(results):
    for res in results:
        bad = res["bad_inputs"]
        assert "max_grad_norm must be a positive number" in bad["negative"]
        assert "max_grad_norm must be a positive number" in bad["string"]
        assert "(loss_sum, count)" in bad["triple"]
        assert "must not depend on the parameters" in bad["count_with_grad"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parity_with_eager(results, case):
    """Losses, gradient norms before clipping and the trained weights match eager with
    ``clip_grad_norm_`` on the whole batch's token mean; every rank reports the same."""
    for res in results:
        r = res[case]
        assert r["loss_err"] <= TOLERANCE, (r["losses"], r["ref_losses"])
        assert r["norm_err"] <= TOLERANCE, (r["norms"], r["ref_norms"])
        err, name = r["state_err"]
        assert err <= TOLERANCE, (name, err)
        assert r["skipped"] == 0
    assert all(res[case]["losses"] == results[0][case]["losses"] for res in results)
    r0 = results[0][case]
    assert r0["lrs"][0] < r0["lrs"][1] > r0["lrs"][-1]  # warmed up, then decayed
    assert [wd for wd, _ in r0["groups"]] == [0.1, 0.0]  # weights decayed; biases and norms not
    if case.clip is not None:
        assert all(res[case]["norms"] == results[0][case]["norms"] for res in results)
        if case.clip < float("inf"):  # the clipping acted on every step
            assert min(results[0][case]["ref_norms"]) > case.clip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_evaluate_matches_eager_eval(results, case):
    """``step.evaluate`` on a held-out batch: eager's loss of the trained model; forward only (gathers,
    the loss's all-reduce, nothing else; weights untouched) in less memory than the training step."""
    for res in results:
        e = res[case]["evaluation"]
        assert e["err"] <= TOLERANCE, (e["value"], e["ref"])
        assert e["unchanged"]
        assert set(e["kinds"]) <= {"all_gather", "all_reduce"}, e["kinds"]
        assert "REDUCE_SCATTER" not in e["program_kinds"] and "OPTIMIZER" not in e["program_kinds"]
        assert e["peak"] < e["train_peak"], (e["peak"], e["train_peak"])


def test_evaluate_runs_the_model_as_in_eval_mode(results):
    for res in results:
        d = res["dropout"]
        assert d["values"][0] == d["values"][1]
        assert rel_error(torch.tensor(d["values"][0]), torch.tensor(d["ref"])) <= TOLERANCE, d
        assert d["training"]  # the model's own mode is left as it was
        assert d["train"] == d["train"]  # a step after evaluate still runs (a number, not nan)


@pytest.mark.parametrize("ps", [(p, s) for p in (1, 2, 4) for s in (1, 3)], ids=lambda ps: f"p{ps[0]}-s{ps[1]}")
def test_fp16_overflow_backs_off_and_recovers(results, ps):
    for res in results:
        r = res["fp16"][ps]
        scales = r["scales"]
        assert scales[0] == 2.0 ** 14 and r["skipped"] >= 1  # the first step overflowed at 2**15
        assert any(b > a for a, b in zip(scales, scales[1:]))  # grew again after 2 finite steps
        assert (scales[-1], r["saved"]["growth_tracker"]) == r["ref_scaler"] and r["saved"]["scale"] == scales[-1]
        assert all(math.isfinite(v) for v in r["losses"])
        assert max(rel_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(r["losses"], r["ref_losses"])) \
            <= LOW_PRECISION_TOLERANCE
        err, name = r["state_err"]
        assert err <= LOW_PRECISION_TOLERANCE, (name, err)
    assert all(res["fp16"][ps]["scales"] == results[0]["fp16"][ps]["scales"] for res in results)


def test_a_short_last_batch_padded_with_ignore_index_is_exact(results):
    for res in results:
        r = res["short"]
        for said in r["refused"]:
            assert "expected shape (6, 6)" in said and "pad a shorter batch" in said
        err, name = r["state_err"]
        assert err <= TOLERANCE, (name, err)


def test_nonfinite_norm_skips_the_step_on_every_rank(results):
    for res in results:
        r = res["nonfinite"]
        assert not r["first_norm"] < float("inf")  # inf or nan
        assert r["skipped"] == 1 and r["norm_finite"]  # the first step skipped, the second ran
        assert r["unchanged"]
        assert sum("optimizer step is skipped" in w for w in r["warnings"]) == 1
        err, name = r["state_err"]
        assert err <= TOLERANCE, (name, err)
