"""The ordered lists of passes built from the Plan, and one runner for them.

``build_pass_list``: what rewrites the trace before lowering (every prefetch candidate of the
search runs it). ``runtime_pass_list``: what rewrites the chosen graph for the runtime (its arena,
its dispatches) after lowering (it never changes the Program).

The runner times each pass, lints its result, records the change in op counts, can
hand the graph before/after to a ``log`` callable, and skips passes by name.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.fx

from micscompile.core.errors import InputError
from micscompile.core.plan import Plan
from micscompile.passes.accumulate_in_matmuls import accumulate_in_matmuls_pass
from micscompile.passes.checkpoint import checkpoint_pass
from micscompile.passes.context import PassContext
from micscompile.passes.fold_transposes import fold_transposes_pass
from micscompile.passes.insert_collectives import insert_collectives_pass
from micscompile.passes.offload import offload_pass
from micscompile.passes.out_variants import out_variants_pass
from micscompile.passes.retarget_device import retarget_device_pass
from micscompile.passes.weight_split import weight_split_pass

PassFn = Callable[[torch.fx.Graph, PassContext], torch.fx.Graph]


@dataclass(frozen=True)
class PassRecord:
    name: str
    seconds: float
    op_delta: dict[str, int]
    """Per call target: count after minus count before (only changed targets)."""

    def __str__(self) -> str:
        delta = ", ".join(f"{k} {v:+d}" for k, v in sorted(self.op_delta.items()))
        return f"{self.name:<20} {self.seconds * 1e3:8.1f} ms  {delta or 'ops unchanged'}"


def op_counts(graph: torch.fx.Graph) -> Counter:
    return Counter(
        getattr(n.target, "__name__", str(n.target)) for n in graph.nodes if n.op == "call_function"
    )


def build_pass_list(plan: Plan) -> list[tuple[str, PassFn]]:
    """The passes a Plan needs, in order."""
    passes = [("retarget_device", retarget_device_pass)]
    if plan.checkpoint:
        passes.append(("checkpoint", checkpoint_pass))
    passes.append(("insert_collectives", insert_collectives_pass))
    if plan.offload_activations:
        passes.append(("offload", offload_pass))
    if plan.weight_split:
        passes.append(("weight_split", weight_split_pass))
    return passes


def runtime_pass_list(plan: Plan, arena: bool) -> list[tuple[str, PassFn]]:
    """The runtime's rewrites of the chosen graph, none when Inductor generates the compute
    (``Plan.codegen``: its kernels fold views and allocate their own outputs): transposes of
    transposes dropped, at p = 1 weight gradients computed into their accumulators, and, with an
    arena, ops with an ``out=`` overload write into it."""
    if plan.codegen == "inductor":
        return []
    passes = [("fold_transposes", fold_transposes_pass), ("accumulate_in_matmuls", accumulate_in_matmuls_pass)]
    return passes + ([("out_variants", out_variants_pass)] if arena else [])


def run_passes(
    graph: torch.fx.Graph,
    ctx: PassContext,
    passes: list[tuple[str, PassFn]],
    *,
    disable: Iterable[str] = (),
    log: Callable[[str], None] | None = None,
    lint: bool = True,
    counts: bool = True,
) -> tuple[torch.fx.Graph, list[PassRecord]]:
    """Run ``passes`` over ``graph``, each timed and its op-count change recorded; ``lint``: each result checked
    by ``Graph.lint`` (off only where the same passes' results are checked elsewhere: autotune's pricing);
    ``counts=False``: no op counts (autotune's pricing keeps no records)."""
    disabled = set(disable)
    unknown = disabled - {name for name, _ in passes}
    if unknown:
        raise InputError(f"cannot disable unknown passes {sorted(unknown)}; passes: {[n for n, _ in passes]}")
    records = []
    for name, fn in passes:
        if name in disabled:
            continue
        before = op_counts(graph) if counts else Counter()
        if log:
            log(f"--- before {name} ---\n{_code(graph)}")
        start = time.perf_counter()
        graph = fn(graph, ctx)
        seconds = time.perf_counter() - start
        if lint:
            graph.lint()
        after = op_counts(graph) if counts else Counter()
        delta = {k: after[k] - before[k] for k in before | after if after[k] != before[k]}
        records.append(PassRecord(name, seconds, delta))
        if log:
            log(f"--- after {name} ({seconds * 1e3:.1f} ms) ---\n{_code(graph)}")
    return graph, records


def _code(graph: torch.fx.Graph) -> str:
    return graph.python_code(root_module="self").src
