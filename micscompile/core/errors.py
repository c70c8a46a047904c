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


class InputError(Error, ValueError):
    """An argument micscompile cannot use: a batch of the wrong shape, an unknown name, a value out of range;
    the message says what it takes."""


class InputTypeError(Error, TypeError):
    """An argument of the wrong type (a dict where a Plan goes); the message names the type it takes."""


class MissingKeyError(Error, KeyError):
    """A state dict without an entry the step needs; the message names it and the layout it expects."""


class UsageError(Error, RuntimeError):
    """A call this process cannot make as it is: no process group, no GPU for this rank, a launch whose nodes do
    not divide the world, a checkpoint view used as a tensor; the message says what to do first."""


class CompileError(Error, RuntimeError):
    """``mc.compile`` failed on another rank, or the ranks built different steps (each rank raises, naming them)."""


class InternalError(Error, RuntimeError):
    """An invariant of micscompile's own broke: a bug, to report with the message."""


__all__ = ["CompileError", "Error", "InputError", "InputTypeError", "InternalError", "MissingKeyError", "PlanError",
           "ScheduleError", "UsageError"]
