"""Parity, communication volume and bad input on 4 real gloo ranks (one launch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_cases import (
    ARENA_OFF,
    ARENA_PAIRS,
    CASES,
    CKPT,
    CKPT_TWINS,
    EXTRA,
    MIXED,
    MIXED_TWINS,
    REAL_TWINS,
    STEPS,
    Case,
    run_all,
)
from harness import assert_parity, launch

from micscompile.cli.parity import LOW_PRECISION_TOLERANCE, TOLERANCE, rel_error

WORLD = 4
pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(run_all, WORLD, timeout_s=480)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parity_with_single_process_eager(results, case: Case):
    """fp32 plans against fp32 eager; mixed-precision plans against ``train_reference_mixed`` (eager
    ``model.to(param_dtype)`` on each rank's micro-batch, fp32 master weights)."""
    tolerance = LOW_PRECISION_TOLERANCE if case.reduce_dtype != torch.float32 else TOLERANCE
    assert_parity(results, case, tolerance)
    for rank, res in enumerate(results):
        assert res[case]["own_shard_err"] <= tolerance, (rank, res[case]["own_shard_err"])


@pytest.mark.parametrize("case", MIXED, ids=lambda c: c.id)
def test_mixed_precision_moves_low_precision_on_the_wire(results, case: Case):
    """The cast is folded into the gather: every all-gather carries param_dtype (half the bytes of
    the fp32 twin in bf16), every reduce-scatter and all-reduce of gradients reduce_dtype; the
    collectives are the same calls. And the low-precision run really computes in low precision:
    its parameters differ from the fp32 twin's by far more than the fp32 tolerance."""
    twin = MIXED_TWINS[case]
    for rank, res in enumerate(results):
        mixed, fp32 = res[case], dict(res[twin])
        if case.param_dtype == torch.float16:  # loss scaling: the gradient norm's all-reduce, once per step
            world = ("all_reduce", "world")
            fp32["calls"] = {**fp32["calls"], world: fp32["calls"].get(world, 0) + STEPS}
        assert mixed["calls"] == fp32["calls"], rank
        for (kind, group), nbytes in fp32["measured"].items():
            if group == "world" and kind == "all_reduce" and case.grad_sync == "2hop":
                continue  # the loss: fp32 either way
            dtype = case.param_dtype if kind == "all_gather" else case.reduce_dtype
            assert mixed["measured"][(kind, group)] * 4 == nbytes * dtype.itemsize, (rank, kind, group)
        assert mixed["measured"] == mixed["predicted"], rank
    if case.param_dtype != torch.float32:
        err = max(rel_error(results[0][case]["state"][k], v) for k, v in results[0][twin]["state"].items())
        assert err > 10 * TOLERANCE, err


@pytest.mark.parametrize("case", [c for c in EXTRA if c.meta], ids=lambda c: c.id)
def test_meta_model_equals_real_model(results, case: Case):
    twin = dataclasses.replace(case, meta=False, reinit=True)
    assert twin in REAL_TWINS
    # the meta model was initialised by compile with init_fn (seed 1); its twin was built for real
    # and given the same init_fn under the same seed: after training, the two agree bit for bit
    for rank, res in enumerate(results):
        meta_state, real_state = res[case]["state"], res[twin]["state"]
        assert meta_state.keys() == real_state.keys()
        for k in real_state:
            assert torch.equal(meta_state[k], real_state[k]), (rank, k)


@pytest.mark.parametrize("case", [c for c in CASES if c.arena], ids=lambda c: c.id)
def test_ops_allocate_outside_the_arena_what_the_lifetimes_plan(results, case: Case):
    """With the collectives' buffers and the ops' ``out=`` results in the arena, what the remaining
    ops allocate themselves (counted by a dispatch mode over a real step) peaks at the lifetimes'
    count of them (a few bytes less: multi-output ops' metadata rounds up)."""
    for rank, res in enumerate(results):
        arena_bytes, n_buffers, planned, measured = res[case]["memory"]
        assert n_buffers > 0 and arena_bytes > 0, (rank, res[case]["memory"])
        assert 0.9 * planned <= measured <= 1.01 * planned + 1024, (rank, measured, planned)


@pytest.mark.parametrize("case", ARENA_OFF, ids=lambda c: c.id)
def test_arena_changes_no_numbers(results, case: Case):
    """The same plan with every buffer allocated per use: bitwise the same training; the ops then
    allocate (counted) at least what the lifetimes list (more when an async collective's Work holds
    its buffers past their last use), far more than beside an arena."""
    twin = ARENA_PAIRS[case]
    for rank, res in enumerate(results):
        assert res[case]["losses"] == res[twin]["losses"], rank
        for k, v in res[twin]["state"].items():
            assert torch.equal(res[case]["state"][k], v), (rank, k)
        arena_bytes, _, planned, measured = res[case]["memory"]
        assert arena_bytes == 0 and measured >= 0.9 * planned, (rank, res[case]["memory"])
        assert measured > 1.5 * res[twin]["memory"][3], (rank, res[case]["memory"], res[twin]["memory"])


@pytest.mark.parametrize("case", CKPT, ids=lambda c: c.id)
def test_checkpointing_changes_no_numbers(results, case: Case):
    """Recomputing activations in backward runs the same ops on the same inputs: the losses and
    parameters are bitwise those of the same plan without checkpointing. Checkpointing every block
    adds no gather (the recomputation uses the backward's gather); a segment of several blocks
    gathers its earlier blocks a third time for the recomputation."""
    twin = CKPT_TWINS[case]
    assert twin in CASES
    for rank, res in enumerate(results):
        assert res[case]["losses"] == res[twin]["losses"], rank
        for k, v in res[twin]["state"].items():
            assert torch.equal(res[case]["state"][k], v), (rank, k)
        gathers, base = res[case]["calls"][("all_gather", "shard")], res[twin]["calls"][("all_gather", "shard")]
        assert gathers == base if case.checkpoint_every == 1 else gathers > base, (rank, gathers, base)


def _padded_model_elements(layouts, p: int) -> int:
    return sum(p * row for row, _, _ in layouts)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.model == "convnet" and not c.meta  # flat gathers: not hierarchical, nor
             and (c.hierarchical is False or not (c.k and c.p > c.k))],  # "auto" where the group spans nodes
    ids=lambda c: c.id)
def test_comm_volume_matches_design_formulas(results, case: Case):
    """ConvNet re-reads every weight in backward, so the formulas hold exactly (less one gather per
    micro-step of each bucket kept live from forward into backward)."""
    r = results[0][case]
    p, s, n = case.p, case.s, WORLD
    keep = r["keep_live"]  # given (case.prefetch) or chosen by the default schedule's search
    if case.prefetch:
        assert keep == case.prefetch.keep_live
    kept = sum(p * row for row, _, _ in r["layouts"][len(r["layouts"]) - keep:])
    d = n // p
    m_pad = _padded_model_elements(r["layouts"], p)  # elements; gathered in param_dtype, reduced in reduce_dtype
    m = sum(numel for _, numel, _ in r["layouts"])
    assert 0 <= m_pad - m <= (p - 1) * len(r["layouts"])  # padding only: < p elements per bucket
    a, g = case.param_dtype.itemsize, case.reduce_dtype.itemsize
    loss = STEPS * 2 * 4 * (n - 1) // n  # the loss (fp32), and in fp16 the gradient norm of loss scaling
    loss *= 2 if case.param_dtype == torch.float16 else 1
    expected = {}
    if p > 1:
        expected[("all_gather", "shard")] = STEPS * s * (2 * m_pad - kept) * a * (p - 1) // p
    if case.grad_sync == "2hop":
        if p > 1:
            expected[("reduce_scatter", "shard")] = STEPS * s * (p - 1) * m_pad * g // p
        if d > 1:
            expected[("all_reduce", "replicate")] = STEPS * 2 * (d - 1) * (m_pad // p) * g // d
        expected[("all_reduce", "world")] = loss
    else:
        expected[("all_reduce", "world")] = STEPS * s * 2 * (n - 1) * m_pad * g // n + loss
    for res in results:
        assert res[case]["measured"] == expected


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_program_predicts_measured_bytes(results, case: Case):
    for res in results:
        assert res[case]["measured"] == res[case]["predicted"]
        calls, ordered = res[case]["calls_per_step"]
        assert calls == ordered  # the Program's collective order lists every collective the step issued


def test_tied_weight_gathered_per_use_region_and_reduced_once(results):
    case = Case("tied_lm", 2, 1, "sgd")
    r = results[0][case]
    # buckets: emb, blocks.0, blocks.1, ln; the tied emb/head weight is gathered in the emb
    # region and again in the head region (forward), once in the head's backward: 3 + 2*3 = 9,
    # less one for each bucket the default schedule keeps live from forward into backward
    assert r["calls"][("all_gather", "shard")] == STEPS * (9 - r["keep_live"])
    assert r["calls"][("reduce_scatter", "shard")] == STEPS * 4  # one per bucket, tied grad summed once


def test_bad_inputs_fail_before_any_collective(results):
    for rank, res in enumerate(results):
        bad = res["bad_inputs"]
        assert "valid partition sizes: 1, 2, 4" in bad["partition_size"], bad["partition_size"]
        assert "divisible by micro_batches=5" in bad["micro_batches"], bad["micro_batches"]
        assert "module '<root>' (DataDependent)" in bad["untraceable"], bad["untraceable"]
        assert "data-dependent control flow" in bad["untraceable"], bad["untraceable"]
        assert "memory_budget_bytes=64" in bad["budget"] and "largest bucket" in bad["budget"], bad["budget"]
        assert "ranks were given different Plans: ranks [0, 2, 3] vs ranks [1]" in bad["disagree"], bad["disagree"]
        assert "micro_batches: 1 on ranks [0, 2, 3], 2 on ranks [1]" in bad["disagree"], bad["disagree"]
        assert "ranks would issue different collectives" in bad["disagree_order"], bad["disagree_order"]
        assert "ranks [0, 2, 3] vs ranks [1]; first difference at collective #" in bad["disagree_order"], bad["disagree_order"]
        assert "partition_size: 8 does not divide 4 (world size 4)" in bad["world"], bad["world"]
        assert "optimizer Adafactor is not elementwise" in bad["optimizer"], bad["optimizer"]
        assert "expected shape (12, 3, 8)" in bad["batch_shape"], bad["batch_shape"]
        assert "takes 2 batch inputs" in bad["batch_count"], bad["batch_count"]
        assert bad["calls_after_errors"] == "0", rank
        if rank == 2:
            assert "divisible by micro_batches=4" in bad["one_rank"], bad["one_rank"]
        else:
            assert "compile failed on other ranks: rank 2: InputError" in bad["one_rank"], bad["one_rank"]
        assert "ranks start from different weights" in bad["weights"], bad["weights"]
        assert "parameters must be float32" in bad["fp16"], bad["fp16"]


def test_program_prints_every_collective(results):
    text = results[0][Case("tied_lm", 2, 3, "sgd")]["program"]
    assert "p=2 d=2 s=3" in text
    for code in ("AG0", "W:AG0", "REL0", "RS0", "W:RS0", "SH0", "W:SH0", "ARL", "OPT"):
        assert code in text, code
    assert "\nschedule: prefetch " in text and ", chosen of " in text and " priced on " in text  # no cluster= given


@pytest.mark.parametrize("case", [c for c in CASES if c.k], ids=lambda c: c.id)
def test_intra_and_inter_node_bytes_follow_gpus_per_node(results, case: Case):
    """4 ranks as 2 nodes of 2: a group spanning both nodes counts as inter-node."""
    for rank, res in enumerate(results):
        r = res[case]
        for key, total in r["measured"].items():
            kind, group = key
            spans = {"shard": case.p > case.k, "replicate": case.p < 4, "world": True, "inter": True, "intra": False}[group]
            rings = case.k if group == "inter" else 1  # the k rings of a hierarchical stage share the link
            assert r["inter_node"][key] == (total * rings if spans else 0), (rank, key)
            assert r["intra_node"][key] == (0 if spans else total), (rank, key)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_runtime_peak_of_gathered_bytes_is_the_programs(results, case: Case):
    for res in results:
        measured, planned = res[case]["peak_gathered"]
        assert measured == planned


@pytest.mark.parametrize("case", [c for c in CASES if c.hierarchical is True and c.arena and not c.mixed], ids=lambda c: c.id)
def test_hierarchical_plan_moves_less_across_nodes(results, case: Case):
    """Same model and plan, gathered flat: the hierarchical run's inter-node bytes per gather are
    (p-k)/(p-1) of the flat run's."""
    flat = dataclasses.replace(case, hierarchical=False)
    for res in results:
        hier, ref = res[case], res[flat]
        assert ("all_gather", "shard") not in hier["calls"]
        per_gather = hier["inter_node"][("all_gather", "inter")] / hier["calls"][("all_gather", "inter")]
        flat_per_gather = ref["inter_node"][("all_gather", "shard")] / ref["calls"][("all_gather", "shard")]
        assert per_gather * (case.p - 1) == pytest.approx(flat_per_gather * (case.p - case.k), rel=1e-12)
