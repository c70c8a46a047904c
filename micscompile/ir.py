"""The compiler's intermediate representation, for tools and tests that read a step's plan rather than train
with it: the Program (an ordered list of Actions of each Kind), the resolved plan it was lowered for, and the
static memory planner (Buffers in, a MemoryPlan of offsets out). A training loop needs none of it
(``micscompile``'s own names); ``step.program`` and ``mc.simulate`` hand these out.

    import micscompile as mc
    step = mc.compile(...)
    gathers = [a for a in step.program.micro_step if a.kind is mc.ir.Kind.ALL_GATHER]
"""

from micscompile.core.plan import ResolvedPlan
from micscompile.core.program import Action, Kind, Prefetch, Program
from micscompile.memory.planner import Buffer, MemoryPlan, MemoryPlanError, plan_memory

__all__ = ["Action", "Buffer", "Kind", "MemoryPlan", "MemoryPlanError", "Prefetch", "Program", "ResolvedPlan",
           "plan_memory"]
