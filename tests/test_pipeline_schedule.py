"""The pipeline schedule IR: generators, string form, validation, simulation and golden grids."""

import re

import pytest

import micscompile.core.pipeline_schedule as ps
from micscompile.core.pipeline_schedule import (
    COMPUTE,
    Op,
    PipeAction,
    PipeSchedule,
    ScheduleError,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    one_f_one_b,
    zb_v,
    zero_bubble,
)

GRID_1F1B_4x8 = """\
step 0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21
r0   F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
r1   .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
r2   .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
r3   .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  ."""

# Megatron interleaving, S=2 v=2 m=4: rank 0 holds chunks 0 and 2, rank 1 chunks 1 and 3.
# Rank 0 warms up with 2*(2-0-1) + (2-1)*2 = 4 forwards (F0.0 F1.0 F0.2 F1.2), rank 1 with 2.
GRID_INTERLEAVED_2x4x2 = """\
step 0    1    2    3    4    5    6    7    8    9    10   11   12   13   14   15   16   17
r0   F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 .    B2.2 .    B3.2 B2.0 B3.0
r1   .    F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 F2.1 B0.1 F3.1 B1.1 F2.3 B2.3 F3.3 B3.3 B2.1 B3.1 ."""

GRID_GPIPE_4x4 = """\
step 0  1  2  3  4  5  6  7  8  9  10 11 12 13
r0   F0 F1 F2 F3 .  .  .  .  .  .  B3 B2 B1 B0
r1   .  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0 .
r2   .  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .  .
r3   .  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .  ."""


def edited(schedule: PipeSchedule, old: str, new: str) -> PipeSchedule:
    """The schedule with one exact piece of its string form replaced (hand-breaking it)."""
    text = str(schedule)
    assert text.count(old) == 1, f"{old!r} must occur once in\n{text}"
    return PipeSchedule.parse(text.replace(old, new))


def test_module_docstring_shows_the_real_string_form():
    assert str(one_f_one_b(2, 2)) in "\n".join(line.strip() for line in ps.__doc__.splitlines())


@pytest.mark.parametrize("kind, stages, micro_batches, chunks",
                         [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("1f1b", 1, 3, 1), ("interleaved", 2, 4, 2),
                          ("interleaved", 4, 8, 3), ("interleaved", 1, 2, 3)])
def test_string_form_round_trips(kind, stages, micro_batches, chunks):
    s = make_schedule(kind, stages, micro_batches, chunks)
    text = str(s)
    assert text.splitlines()[0] == f"pipeline {kind} stages={stages} chunks={chunks} micro_batches={micro_batches}"
    assert PipeSchedule.parse(text) == s
    assert PipeSchedule.parse(f"\n{text}\n\n") == s


def test_actions_print_as_op_mb_dot_chunk():
    actions = [PipeAction(Op.FORWARD, 3, 1), PipeAction(Op.SEND_ACT, 3, 1), PipeAction(Op.RECV_GRAD, 0, 2),
               PipeAction(Op.ALL_REDUCE)]
    assert [str(a) for a in actions] == ["F3.1", "SA3.1", "RG0.2", "AR"]
    assert [PipeAction.parse(str(a)) for a in actions] == actions


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_every_generated_schedule_validates(stages):
    for m in range(1, 9):
        schedules = [gpipe(stages, m), one_f_one_b(stages, m)]
        schedules += [interleaved_1f1b(stages, m, v) for v in (1, 2, 3) if v == 1 or m % stages == 0]
        for s in schedules:
            s.validate()
            for r, actions in enumerate(s.ranks):
                assert {a.chunk for a in actions if a.chunk is not None} == set(s.chunks_of(r))
                assert [a.op for a in actions].count(Op.ALL_REDUCE) == 1 and actions[-1].op is Op.ALL_REDUCE
                p2p = [a for a in actions if a.op not in (Op.FORWARD, Op.BACKWARD, Op.ALL_REDUCE)]
                assert (len(p2p) > 0) == (stages > 1), "a one-rank pipeline has no P2P, a longer one does"


def test_steady_state_p2p_actions_sit_next_to_each_other():
    """The runtime batches adjacent P2P actions, so 1F1B's steady state must read F SA RG B SG RA F."""
    r1 = " ".join(map(str, one_f_one_b(4, 8).ranks[1]))
    assert "RA3.1 F3.1 SA3.1 RG1.1 B1.1 SG1.1 RA4.1 F4.1" in r1


def test_interleaved_with_one_chunk_is_one_f_one_b():
    for stages, m in [(1, 3), (2, 5), (4, 8), (3, 2)]:
        assert interleaved_1f1b(stages, m, 1).ranks == one_f_one_b(stages, m).ranks


def test_interleaved_follows_megatrons_order():
    """k-th forward: local chunk (k // S) % v of micro-batch (k // (S*v)) * S + k % S; backward mirrors chunks."""
    S, m, v = 4, 8, 3
    s = interleaved_1f1b(S, m, v)
    for r in range(S):
        for op, local in [(Op.FORWARD, lambda k: (k // S) % v), (Op.BACKWARD, lambda k: v - 1 - (k // S) % v)]:
            expected = [PipeAction(op, (k // (S * v)) * S + k % S, r + S * local(k)) for k in range(m * v)]
            assert [a for a in s.ranks[r] if a.op is op] == expected
        compute = [a.op for a in s.ranks[r] if a.op in (Op.FORWARD, Op.BACKWARD)]
        # Megatron's warm-up forwards, then the steady state opens with one more forward
        assert compute.index(Op.BACKWARD) == 2 * (S - r - 1) + (v - 1) * S + 1


@pytest.mark.parametrize("schedule, golden", [(one_f_one_b(4, 8), GRID_1F1B_4x8),
                                              (interleaved_1f1b(2, 4, 2), GRID_INTERLEAVED_2x4x2),
                                              (gpipe(4, 4), GRID_GPIPE_4x4)])
def test_golden_grids(schedule, golden):
    assert schedule.grid() == golden


@pytest.mark.parametrize("stages, micro_batches", [(2, 4), (4, 8), (4, 16), (8, 32), (3, 3)])
def test_one_f_one_b_bubble_is_s_minus_1_over_m(stages, micro_batches):
    expected = (stages - 1) / micro_batches
    assert one_f_one_b(stages, micro_batches).bubble_fraction() == pytest.approx(expected, rel=0.02)
    assert gpipe(stages, micro_batches).bubble_fraction() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("stages, micro_batches, chunks", [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (8, 32, 2),
                                                           (4, 8, 3), (4, 4, 2)])
def test_interleaved_bubble_is_s_minus_1_over_v_m(stages, micro_batches, chunks):
    """Measured, not assumed: with F:B = 1:2 split evenly over the chunks the simulated bubble of
    Megatron's order is exactly (S-1)/(v*m), v times smaller than 1F1B's."""
    s = interleaved_1f1b(stages, micro_batches, chunks)
    assert s.bubble_fraction() == pytest.approx((stages - 1) / (chunks * micro_batches), rel=0.02)


def test_in_flight_micro_batches():
    """1F1B keeps S - r micro-batches of activations on rank r, GPipe all m; interleaving keeps its warm-up + 1."""
    assert one_f_one_b(4, 8).max_in_flight() == [4, 3, 2, 1]
    assert one_f_one_b(4, 2).max_in_flight() == [2, 2, 2, 1]
    assert gpipe(4, 8).max_in_flight() == [8] * 4
    assert interleaved_1f1b(4, 8, 2).max_in_flight() == [11, 9, 7, 5]


def test_simulate_adds_one_hop_per_rank_crossing():
    s = one_f_one_b(2, 1)
    t = s.simulate([1.0, 1.0], [2.0, 2.0], p2p_s=0.5)
    assert t.spans == [[(PipeAction(Op.FORWARD, 0, 0), 0.0, 1.0), (PipeAction(Op.BACKWARD, 0, 0), 5.0, 7.0)],
                       [(PipeAction(Op.FORWARD, 0, 1), 1.5, 2.5), (PipeAction(Op.BACKWARD, 0, 1), 2.5, 4.5)]]
    assert t.makespan_s == 7.0 and t.busy_s == [3.0, 3.0]
    assert t.bubble_fraction == pytest.approx(4 / 3)


def test_a_compute_waits_for_its_own_input_not_for_receives_posted_early():
    """Rank 1 posts both receives before computing (the runtime waits for a receive right before the
    compute reading it): F0.1 starts once SA0.0 is posted (1 + 0.5), F1.1 once SA1.0 is (2 + 0.5)."""
    s = edited(gpipe(2, 2), "RA0.1 F0.1 RA1.1", "RA0.1 RA1.1 F0.1")
    t = s.simulate([1.0, 1.0], [1.0, 1.0], p2p_s=0.5)
    assert [start for _, start, _ in t.spans[1]] == [1.5, 2.5, 3.5, 4.5]
    t = edited(gpipe(2, 2), "F0.0 SA0.0 F1.0", "F0.0 F1.0 SA0.0").simulate([1.0, 1.0], [1.0, 1.0], p2p_s=0.5)
    assert [start for _, start, _ in t.spans[1]][:2] == [2.5, 3.5]  # SA0.0 now posted at 2


def test_simulate_is_bound_by_the_slowest_chunk():
    t = gpipe(2, 2).simulate([1.0, 3.0], [2.0, 6.0])
    assert t.makespan_s == 21.0 and t.busy_s == [6.0, 18.0]
    with pytest.raises(ValueError, match="need 2 forward and backward times"):
        gpipe(2, 2).simulate([1.0], [2.0, 2.0])


def test_a_broken_schedule_is_reported_as_a_deadlock():
    """Rank 0 runs a backward before sending the activation that rank 1 needs to produce its gradient."""
    s = edited(gpipe(2, 2), "SA1.0 RG1.0 B1.0", "RG1.0 B1.0 SA1.0")
    message = ("deadlock: rank 0 at step 4 (B1.0) waits for SG1.1 from rank 1, which is at step 3 (F1.1) "
               "waiting for SA1.0 from rank 0")
    for run in (lambda: s._execute([1] * 2, [1] * 2, 0.0), lambda: s.simulate([1, 1], [2, 2]), s.grid):
        with pytest.raises(ScheduleError, match=re.escape(message)):
            run()


def test_a_deadlock_names_every_blocked_rank():
    s = edited(gpipe(3, 1), "SA0.1 RG0.1 B0.1", "RG0.1 B0.1 SA0.1")
    with pytest.raises(ScheduleError, match=re.escape(
            "deadlock: rank 0 at step 3 (B0.0) waits for SG0.1 from rank 1, which is at step 3 (B0.1) waiting for "
            "SG0.2 from rank 2, which is at step 1 (F0.2) waiting for SA0.1 from rank 1")):
        s.validate()


# interleaved_1f1b(2, 4, 2) as generated before the NCCL model: every run of adjacent P2P actions is
# one batch; on NCCL a send completes only when its receive runs, and one rank's batches run in order.
OLD_INTERLEAVED_2x4x2 = """\
pipeline interleaved stages=2 chunks=2 micro_batches=4
r0: F0.0 SA0.0 F1.0 SA1.0 RA0.2 F0.2 SA0.2 RA1.2 F1.2 SA1.2 F2.0 SA2.0 RG0.2 B0.2 SG0.2 F3.0 SA3.0 RG1.2 B1.2 \
SG1.2 RA2.2 F2.2 SA2.2 RG0.0 B0.0 RA3.2 F3.2 SA3.2 RG1.0 B1.0 RG2.2 B2.2 SG2.2 RG3.2 B3.2 SG3.2 RG2.0 B2.0 RG3.0 B3.0 AR
r1: RA0.1 F0.1 SA0.1 RA1.1 F1.1 SA1.1 RA0.3 F0.3 B0.3 SG0.3 RA1.3 F1.3 B1.3 SG1.3 RA2.1 F2.1 SA2.1 RG0.1 B0.1 \
SG0.1 RA3.1 F3.1 SA3.1 RG1.1 B1.1 SG1.1 RA2.3 F2.3 B2.3 SG2.3 RA3.3 F3.3 B3.3 SG3.3 RG2.1 B2.1 SG2.1 RG3.1 B3.1 SG3.1 AR
"""


def test_nccl_rules_reject_the_old_interleaved_batching_naming_steps_and_ranks():
    """Both ranks send a gradient first (rank 0's chunk 2 to chunk 1, rank 1's chunk 3 to chunk 2) and post
    the matching receives only in later batches: with blocking sends, neither batch can finish."""
    old = PipeSchedule.parse(OLD_INTERLEAVED_2x4x2)
    old._execute([1.0] * 4, [1.0] * 4, 0.0)  # fine with eager sends (gloo) ...
    with pytest.raises(ScheduleError, match=re.escape(  # ... not on NCCL
            "NCCL deadlock: rank 0 step 14 [SG0.2] waits for RG0.1 in rank 1 step 16 [SA2.1 RG0.1]; "
            "rank 1 step 13 [SG1.3 RA2.1] waits for RG1.2 in rank 0 step 16 [SA3.0 RG1.2]")):
        old.validate()


def test_nccl_rules_reject_receives_posted_out_of_the_senders_order():
    """gloo matches by tag; NCCL matches two ranks' P2P ops in posting order: RA1.1 posted first would
    get SA0.0's data."""
    s = edited(gpipe(2, 2), "RA0.1 F0.1 RA1.1", "RA1.1 RA0.1 F0.1")
    s._execute([1.0] * 2, [1.0] * 2, 0.0)
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 1 step 0 (RA1.1) would receive SA0.0 from rank 0: NCCL matches two ranks' sends and "
            "receives in posting order, not by tag")):
        s.validate()


def test_nccl_order_posts_those_receives_one_batch_earlier():
    new = interleaved_1f1b(2, 4, 2)
    assert "B0.2 SG0.2 RG1.2 F3.0" in str(new) and "B1.3 SG1.3 RA2.1 RG0.1 F2.1" in str(new)
    assert [a for a in new.ranks[0] if a.op in (Op.FORWARD, Op.BACKWARD)] == \
        [a for a in PipeSchedule.parse(OLD_INTERLEAVED_2x4x2).ranks[0] if a.op in (Op.FORWARD, Op.BACKWARD)]


@pytest.mark.parametrize("stages", range(2, 9))
def test_every_generated_schedule_passes_the_nccl_model(stages):
    """Every schedule the generators make for S <= 8, v <= 4 and the micro-batch counts they accept
    (up to 4 groups of S for interleaving), deadlock-free under NCCL's rules and with eager sends."""
    for m in range(1, 4 * stages + 1):
        kinds = [("gpipe", 1), ("1f1b", 1)] + [("interleaved", v) for v in range(2, 5) if m % stages == 0]
        for kind, v in kinds:
            make_schedule(kind, stages, m, v).validate()


def test_batched_is_what_the_runtime_posts():
    s = interleaved_1f1b(2, 4, 2)
    for r in range(2):
        items = s.batched(r)
        assert [a for it in items for a in (it if isinstance(it, tuple) else (it,))] == list(s.ranks[r])
        assert all(all(a.op not in (Op.FORWARD, Op.BACKWARD, Op.ALL_REDUCE) for a in it)
                   for it in items if isinstance(it, tuple))
        assert not any(isinstance(x, tuple) and isinstance(y, tuple) for x, y in zip(items, items[1:]))


# gpipe(2, 2):
# r0: F0.0 SA0.0 F1.0 SA1.0 RG1.0 B1.0 RG0.0 B0.0 AR
# r1: RA0.1 F0.1 RA1.1 F1.1 B1.1 SG1.1 B0.1 SG0.1 AR
@pytest.mark.parametrize("old, new, message", [
    (" SA0.0", "", "rank 1 step 0 (RA0.1): no matching SA0.0 on rank 0"),
    ("F1.1 B1.1", "B1.1 F1.1", "rank 1 step 3 (B1.1): must come after F1.1"),
    ("r0: F0.0", "r0: F0.1", "rank 0 step 0 (F0.1): chunk 1 lives on rank 1"),
    ("RA0.1 F0.1", "F0.1 RA0.1", "rank 1 step 0 (F0.1): must come after RA0.1"),
    ("F0.0 SA0.0", "SA0.0 F0.0", "rank 0 step 0 (SA0.0): must come after F0.0"),
    ("RG0.0 B0.0", "RG0.0 SG0.0 B0.0", "rank 0 step 7 (SG0.0): has no peer chunk"),
    (" B0.1 SG0.1", "", "rank 1: B0.1 is missing"),
    ("F1.0 SA1.0", "F1.0 SA1.0 F1.0", "rank 0 step 4 (F1.0): repeats step 2"),
    ("F0.0 SA0.0", "F0.0 SA0.0 F2.0", "rank 0 step 2 (F2.0): needs mb in 0..1"),
    ("r1: RA0.1", "r1: AR RA0.1", "rank 1 step 0 (AR): AR must be the last action"),
    ("B0.0 AR", "AR B0.0", "rank 0: the last action must be AR"),
])
def test_hand_broken_schedules_name_rank_and_step(old, new, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        edited(gpipe(2, 2), old, new).validate()


def test_p2p_on_a_one_rank_pipeline_is_refused():
    with pytest.raises(ScheduleError, match=re.escape("rank 0 step 1 (SA0.0): has no peer chunk")):
        edited(gpipe(1, 1), "F0.0", "F0.0 SA0.0").validate()


@pytest.mark.parametrize("text, message", [
    ("pipeline 1f1b stages=1 chunks=1\nr0: AR", "line 1: expected 'pipeline <name>"),
    ("pipeline x stages=1 chunks=1 micro_batches=1\nr0: F0.0 X1.0 AR", "line 2: bad action 'X1.0'"),
    ("pipeline x stages=2 chunks=1 micro_batches=1\nr0: AR\nr2: AR", "line 3: expected 'r1: <actions>'"),
    ("pipeline x stages=2 chunks=1 micro_batches=1\nr0: AR", "2 stages need 2 action lists, got 1"),
])
def test_bad_text_is_refused_with_its_line(text, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        PipeSchedule.parse(text)


def test_interleaving_needs_whole_groups_of_micro_batches():
    with pytest.raises(ScheduleError, match=re.escape("multiple of stages=4, got 6: use micro_batches in [4, 8]")):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ScheduleError, match="or chunks=1"):
        interleaved_1f1b(4, 3, 2)


def test_make_schedule_names_the_valid_kinds():
    assert make_schedule("interleaved", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    assert make_schedule("1f1b", 2, 4) == one_f_one_b(2, 4) and make_schedule("gpipe", 2, 4) == gpipe(2, 4)
    assert make_schedule("zb-h1", 2, 4) == zero_bubble(2, 4) and make_schedule("interleaved-zb", 2, 4, 2) == \
        zero_bubble(2, 4, 2)
    with pytest.raises(ValueError, match="valid kinds are 1f1b, interleaved, gpipe, zb-h1, interleaved-zb"):
        make_schedule("zero_bubble", 2, 4)
    with pytest.raises(ValueError, match="needs kind 'interleaved'"):
        make_schedule("1f1b", 2, 4, chunks=2)


# ZB-H1, S=4 m=6, unit F, B and W: rank r defers each W r places (its B's come as 1F1B's backwards do)
GRID_ZB_H1_4x6 = """\
step 0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20
r0   F0 F1 F2 F3 .  .  .  B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5
r1   .  F0 F1 F2 .  .  B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5
r2   .  .  F0 F1 .  B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5
r3   .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"""


def test_zb_h1_grid():
    assert zero_bubble(4, 6).grid() == GRID_ZB_H1_4x6


@pytest.mark.parametrize("stages, micro_batches, chunks", [(2, 2, 1), (2, 5, 1), (4, 4, 1), (4, 9, 1), (8, 16, 1),
                                                           (2, 4, 2), (4, 8, 2), (4, 4, 2), (2, 6, 3), (8, 16, 2)])
def test_zero_bubble_schedules_validate_and_shrink_the_bubble(stages, micro_batches, chunks):
    """Every F, B and W once, each W after its B on the chunk's rank, deadlock-free with eager sends and
    under NCCL's rules; with F = B = W the bubble is (S - 1)(F + B - W) = (S - 1) units (ZB-H1; the paper's
    formula), a third of 1F1B's (S - 1)(F + B + W), and interleaving shrinks it further."""
    zb = zero_bubble(stages, micro_batches, chunks)
    zb.validate()
    ref = (interleaved_1f1b if chunks > 1 else lambda s, m, v: one_f_one_b(s, m))(stages, micro_batches, chunks)
    for r, acts in enumerate(zb.ranks):
        steps = {a: i for i, a in enumerate(acts)}
        weights = [a for a in acts if a.op is Op.WEIGHT]
        assert len(weights) == micro_batches * chunks
        assert all(steps[PipeAction(Op.BACKWARD, w.mb, w.chunk)] < steps[w] for w in weights)
        # its F's and B's in the reference's order: W's only fill in
        assert [a for a in acts if a.op in (Op.FORWARD, Op.BACKWARD)] == \
            [a for a in ref.ranks[r] if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert zb.split_backward and not ref.split_backward
    n = stages * chunks
    unit = zb.simulate([1.0] * n, [1.0] * n, 0.0, [1.0] * n)
    if chunks == 1:
        assert unit.makespan_s == 3 * micro_batches + stages - 1
    assert zb.bubble_fraction() < ref.bubble_fraction()


def test_zero_bubble_in_flight_and_its_string_form():
    """A micro-batch stays in flight until its W: ZB-H1's ranks each hold at most S, 1F1B's first rank's count."""
    zb = zero_bubble(4, 8)
    assert zb.max_in_flight() == [4, 4, 4, 4] and one_f_one_b(4, 8).max_in_flight() == [4, 3, 2, 1]
    assert PipeSchedule.parse(str(zb)) == zb and "W0.3" in str(zb)
    with pytest.raises(ValueError, match="needs 4 weight-gradient"):
        zb.simulate([1.0] * 4, [1.0] * 4)


@pytest.mark.parametrize("old, new, message", [
    (" W3.1 AR", " AR", "W3.1 is missing"),  # a B without its W
    ("RG1.0 B1.0 W1.0", "W1.0 RG1.0 B1.0", "must come after B1.0"),  # a W before its B
])
def test_broken_zero_bubble_schedules_are_refused(old, new, message):
    with pytest.raises(ScheduleError, match=message):
        edited(zero_bubble(2, 4), old, new).validate()


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
def test_zb_v_places_chunks_in_a_v_and_validates_for_every_m(stages):
    """ZB-V: rank r holds chunks r and 2S-1-r; chunks S-1 and S meet on the last rank and hand over without
    P2P; every m from 1 to 2S+1 validates in both P2P models (receives posted in each sender's order:
    ``_pair_order``), and the bubble is below interleaved 1F1B's at v = 2."""
    for m in range(1, 2 * stages + 2):
        s = zb_v(stages, m)
        s.validate()
        assert [s.chunks_of(r) for r in range(stages)] == [[r, 2 * stages - 1 - r] for r in range(stages)]
        assert s.rank_of(stages - 1) == s.rank_of(stages) == stages - 1
        local = {("SA", stages - 1), ("RA", stages), ("SG", stages), ("RG", stages - 1)}
        assert not [a for a in s.ranks[stages - 1] if (a.op.value, a.chunk) in local]
        if m % stages == 0:
            assert s.bubble_fraction() < interleaved_1f1b(stages, m, 2).bubble_fraction()
    assert PipeSchedule.parse(str(zb_v(stages, 4))) == zb_v(stages, 4)


def test_receives_follow_each_senders_order():
    """Before ``_pair_order``, ZB-V's second rank would post the gradient of chunk 3 before the activation
    rank 0 sent first; after it, rank 1 receives from rank 0 in rank 0's order."""
    s = zb_v(2, 4)
    from_0 = [a for a in s.ranks[1] if a.op.value in ("RA", "RG")
              and s.rank_of(a.chunk + (1 if a.op.value == "RG" else -1)) == 0]
    sent = [a for a in s.ranks[0] if a.op.value in ("SA", "SG")]
    assert [(a.mb, a.op.value) for a in from_0] == [(a.mb, "RA" if a.op.value == "SA" else "RG") for a in sent]


def _torch_order(schedule_cls, rank: int, **fields) -> list[tuple[Op, int, int]]:
    """torch.distributed.pipelining's compute order for ``rank`` (its ``_calculate_single_rank_operations``, which
    reads only these fields of the schedule), as (op, mb, chunk): its I (input backward) is our B."""
    from types import SimpleNamespace

    ops = schedule_cls._calculate_single_rank_operations(SimpleNamespace(**fields), rank)
    kind = {"F": Op.FORWARD, "I": Op.BACKWARD, "W": Op.WEIGHT}
    return [(kind[a.computation_type.value], a.microbatch_index, a.stage_index) for a in ops if a is not None]


@pytest.mark.parametrize("stages, micro_batches", [(2, 3), (2, 4), (4, 5), (4, 8), (8, 16)])
def test_zero_bubble_orders_are_torchs(stages, micro_batches):
    """Every rank's computes in torch's order: ZB-H1 with every rank deferring r W's is
    ``ScheduleInterleavedZeroBubble`` with one stage per rank, ZB-V is ``ScheduleZBVZeroBubble``."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble

    S, m = stages, micro_batches
    for ours, cls, fields in [
            (zb_v(S, m), ScheduleZBVZeroBubble, dict(pp_group_size=S, num_stages=2 * S, _n_microbatches=m)),
            (zero_bubble(S, m) if m % S == 0 else None, ScheduleInterleavedZeroBubble,
             dict(pp_group_size=S, n_local_stages=1, microbatches_per_round=S, _n_microbatches=m))]:
        for r in range(S if ours else 0):
            mine = [(a.op, a.mb, a.chunk) for a in ours.ranks[r] if a.op in COMPUTE]
            assert mine == _torch_order(cls, r, **fields), (cls.__name__, r)


@pytest.mark.parametrize("kind,S,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
                                        ("zb-h1", 4, 6, 1), ("interleaved-zb", 2, 4, 2), ("zb-v", 3, 7, 2)])
def test_a_timeline_schedule_prices_as_the_one_the_runtime_posts(kind, S, m, v):
    """``make_schedule(..., nccl=False)`` (what mc.autotune prices) leaves each receive right before its compute;
    the runtime's posts some earlier. Same computes and sends in the same order, the same timeline, the same
    activations in flight (mutation caught: `_build` dropping the last send of a rank when nccl=False)."""
    import random

    posted, timeline = ps.make_schedule(kind, S, m, v), ps.make_schedule(kind, S, m, v, nccl=False)
    moves = (ps.Op.FORWARD, ps.Op.BACKWARD, ps.Op.WEIGHT, ps.Op.SEND_ACT, ps.Op.SEND_GRAD)
    for a, b in zip(posted.ranks, timeline.ranks):
        assert [x for x in a if x.op in moves] == [x for x in b if x.op in moves]
    rng = random.Random(0)
    n = S * v
    times = [[rng.uniform(0.5, 2.0) for _ in range(n)] for _ in range(3)]
    one, two = (s.simulate(times[0], times[1], 0.1, times[2]) for s in (posted, timeline))
    assert one.makespan_s == two.makespan_s and one.spans == two.spans
    assert posted.chunk_in_flight == timeline.chunk_in_flight


def _walk(actions, saved, w_saved, acts, w_acts):
    """The walk ``cost_model.pipeline._walked_peak`` prices, one action after another (its definition)."""
    live = peak = 0
    for a in actions:
        c = a.chunk
        if a.op is Op.FORWARD:
            peak, live = max(peak, live + acts[c][0]), live + saved[c]
        elif a.op is Op.BACKWARD:
            peak, live = max(peak, live - saved[c] + acts[c][1]), live + w_saved[c] - saved[c]
        elif a.op is Op.WEIGHT:
            peak, live = max(peak, live - w_saved[c] + w_acts[c]), live - w_saved[c]
    return peak


@pytest.mark.parametrize("kind,S,m,v", [("zb-h1", 4, 8, 1), ("interleaved-zb", 4, 8, 2), ("1f1b", 4, 8, 1),
                                         ("zb-v", 4, 8, 2)])
def test_walked_peak_is_the_walk_one_action_after_another(kind, S, m, v):
    """The zero-bubble memory walk, run as running sums in numpy, is the walk action by action on every rank of each
    schedule and each ZB-H1 deferral, over random bytes (mutation caught: the live bytes before an action counted
    after it)."""
    import random

    from micscompile.cost_model.pipeline import _walked_peak, _zb_h1_order

    rng = random.Random(0)
    sched = make_schedule(kind, S, m, v)
    n = S * v
    for _ in range(20):
        mem = [[0] * n] + [[rng.randint(0, 10**10) for _ in range(n)] for _ in range(2)]
        mem += [[(rng.randint(0, 10**10), rng.randint(0, 10**10)) for _ in range(n)], [rng.randint(0, 10**10)
                                                                                       for _ in range(n)]]
        orders = list(sched.ranks) + ([_zb_h1_order(S, m, r, d) for r in range(S) for d in range(r + 1)]
                                      if kind == "zb-h1" else [])
        for actions in orders:
            assert _walked_peak(actions, tuple(mem)) == _walk(actions, *mem[1:])


def test_zb_h1_schedules_share_ranks_only_where_they_are_alike():
    """ZB-H1 schedules that differ in some ranks' deferrals share the others' wrapped actions (``_build``'s key):
    each is the schedule built alone, and each rank runs its own chunk (mutation caught: the key without the
    rank, so two ranks deferring alike share one list)."""
    import micscompile.core.pipeline_schedule as module

    S, m = 4, 8
    built = [zero_bubble(S, m, 1, d, nccl=False) for d in ((0, 0, 0, 0), (0, 1, 1, 1), (0, 1, 2, 3), (0, 1, 1, 1))]
    module._RANKS.clear()
    alone = zero_bubble(S, m, 1, (0, 1, 1, 1), nccl=False)
    assert built[1].ranks == built[3].ranks == alone.ranks
    assert built[0].ranks[0] is built[1].ranks[0]  # (rank 0 defers none in both: shared)
    for sched in built:
        for r, actions in enumerate(sched.ranks):
            assert {a.chunk for a in actions if a.op in COMPUTE} == {r}
