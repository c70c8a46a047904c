"""The pipeline schedules by name, and the one rule a schedule's name, stages S, micro-batches m and chunks per
rank v must meet (``check_schedule``): what ``Plan`` checks when it is made and resolved, and what
``core.pipeline_schedule`` checks before it builds one."""

from __future__ import annotations

from micscompile.core.errors import ScheduleError

SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1", "interleaved-zb", "zb-v")
"""The pipeline schedules a Plan names (``Plan.pipeline_schedule``; ``core.pipeline_schedule`` builds them)."""
INTERLEAVED = ("interleaved", "interleaved-zb", "zb-v")
"""Those that run v > 1 chunks per rank (the others one)."""
CHOSEN_CHUNKS = ("interleaved", "interleaved-zb")
"""Those whose v the Plan chooses (``Plan.pipeline_chunks``); ZB-V's is 2."""
ZERO_BUBBLE = ("zb-h1", "interleaved-zb", "zb-v")
"""Those that split each backward into B and W (``passes.weight_split``)."""


def check_kind(kind: str, chunks: int) -> None:
    """Raise ScheduleError unless ``kind`` is a schedule that runs ``chunks`` chunks per rank."""
    if kind not in SCHEDULES:
        raise ScheduleError(f"unknown pipeline schedule {kind!r}: valid kinds are {', '.join(SCHEDULES)}")
    if kind not in INTERLEAVED and chunks != 1:
        raise ScheduleError(f"{kind!r} runs one chunk per rank; chunks={chunks} needs kind "
                            + " or ".join(repr(k) for k in INTERLEAVED))
    if kind == "zb-v" and chunks != 2:
        raise ScheduleError(f"'zb-v' runs two chunks per rank in a V: chunks=2, got {chunks}")


def check_schedule(kind: str, stages: int, micro_batches: int, chunks: int = 1) -> None:
    """Raise ScheduleError unless the named schedule exists for (S, m, v), without building it
    (``Plan.resolve`` asks before anything is traced; ``make_schedule`` before it builds)."""
    check_kind(kind, chunks)
    if kind != "zb-v" and chunks > 1 and micro_batches % stages:
        ok = [k * stages for k in range(max(1, micro_batches // stages), micro_batches // stages + 2)]
        raise ScheduleError(f"{kind} with chunks={chunks} needs micro_batches to be a multiple of "
                            f"stages={stages}, got {micro_batches}: use micro_batches in {ok}, or chunks=1")


__all__ = ["CHOSEN_CHUNKS", "INTERLEAVED", "SCHEDULES", "ZERO_BUBBLE", "check_kind", "check_schedule"]
