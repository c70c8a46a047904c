"""The errors micscompile raises: every one a subclass of ``Error`` (``micscompile.Error``), so that a training
script can catch the project's refusals in one clause. A refusal of bad input is a ``ValueError`` as well, a
failure while running a ``RuntimeError`` as well, where Python's conventions say so."""

from __future__ import annotations


class Error(Exception):
    """Every error micscompile raises; the message says what went wrong and, for a refusal, what would work."""


class PlanError(Error, ValueError):
    """A Plan that cannot work on this world; the message says what would."""


class ScheduleError(PlanError):
    """A schedule that is malformed, inconsistent, or would deadlock, or that a plan's (S, m, v) cannot have."""


__all__ = ["Error", "PlanError", "ScheduleError"]
