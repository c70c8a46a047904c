"""Activation offload: graph ops that copy a checkpointed block output to host memory
after the forward's last use of it and bring it back ahead of the backward that needs it
(``passes.checkpoint`` marks the values when ``Plan.offload_activations``; ``offload_pass``
places the copies).

The reloads run in reverse forward order, each issued one segment ahead: where the
backward waits for the previous reload (the first at the start of backward), so a copy
overlaps the backward of the segment after it, and at most two reloaded outputs are
live at once. On CUDA the copies run on a side stream into pinned host memory:
``offload`` records an event after the copy; ``offload_done``, placed at the next offload
(the last one's at the end of the forward), makes the current stream wait for it, and the
offloaded value's planned lifetime runs to there: an arena slot is reused by the plan, not
the allocator, so ``record_stream`` (kept for values the allocator owns) cannot hold it,
and the lifetimes check that nothing reuses it before (``lifetimes.GraphLifetimes``).
``reload_issue`` copies back on the side stream after the offload's event and records
another; ``reload_wait`` makes the current stream wait for it. On the CPU the same Program runs
with plain copies (host and device are one memory: the numbers, the order and the
accounting are what is tested there).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx

from micscompile.core.program import REGION_BWD
from micscompile.cost_model.node_cost import META_BYTES
from micscompile.trace import META_REGION


class Offloaded(NamedTuple):
    host: torch.Tensor
    done: object
    """The copy's torch.cuda.Event (None on the CPU)."""
    device: torch.device


def _copy_stream(comm):
    if comm.copy_stream is None:
        comm.copy_stream = torch.cuda.Stream()
    return comm.copy_stream


def offload(comm, x: torch.Tensor) -> Offloaded:
    """Start copying ``x`` to host memory."""
    if not x.is_cuda:
        return Offloaded(x.clone(), None, x.device)
    stream = _copy_stream(comm)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    x.record_stream(stream)
    return Offloaded(host, done, x.device)


def offload_done(comm, off: Offloaded, src: torch.Tensor) -> None:
    """The current stream waits for ``off``'s copy to host: from here on ``src`` (the offloaded
    value, an argument so that its planned lifetime runs to here) may be overwritten."""
    if off.done is not None:
        torch.cuda.current_stream().wait_event(off.done)


class Reloading(NamedTuple):
    out: torch.Tensor
    """The device copy, valid once ``reload_wait`` returns it."""
    done: object
    """The copy's torch.cuda.Event (None on the CPU)."""


def reload_issue(comm, off: Offloaded) -> Reloading:
    """Start bringing an offloaded tensor back to its device (on CUDA: on the copy stream, after
    the offload's copy is done)."""
    if off.done is None:
        return Reloading(off.host.clone(), None)
    stream = _copy_stream(comm)
    with torch.cuda.stream(stream):
        stream.wait_event(off.done)
        out = off.host.to(off.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return Reloading(out, done)


def reload_wait(comm, r: Reloading) -> torch.Tensor:
    """The reloaded tensor; the current stream waits for its copy (and keeps it from the allocator
    until its own work on it is done)."""
    if r.done is not None:
        torch.cuda.current_stream().wait_event(r.done)
        r.out.record_stream(torch.cuda.current_stream())
    return r.out


META_OFFLOAD = "mc_offload"
"""Set by passes.checkpoint on the segment outputs the backward reads (offload candidates)."""


def offload_pass(graph: torch.fx.Graph, ctx) -> torch.fx.Graph:
    """After insert_collectives: each marked value is offloaded after its last forward use, and its
    copy waited for (``offload_done``) at the next offload, the last at the end of the forward; in
    backward order, its reload is waited right before its first backward use and issued where the
    previous one is waited (the first at the start of backward); the backward reads the reload."""
    if not ctx.plan.plan.offload_activations:
        return graph
    comm = next(n for n in graph.nodes if n.op == "placeholder")
    position = {n: i for i, n in enumerate(graph.nodes)}  # of the original nodes: insertions keep their order
    moved = []  # (first backward use, value, its offload)
    for v in [n for n in graph.nodes if n.meta.get(META_OFFLOAD)]:
        bwd = [u for u in v.users if u.meta.get(META_REGION) == REGION_BWD]
        fwd = [u for u in v.users if u not in bwd and u.op != "output"]
        if not bwd:
            continue
        last_fwd = max(fwd, key=position.__getitem__, default=v)
        with graph.inserting_after(last_fwd):
            off = graph.call_function(offload, (comm, v))
        off.meta = {**v.meta, META_BYTES: 0, META_REGION: v.meta.get(META_REGION)}  # host memory
        off.meta.pop(META_OFFLOAD)
        moved.append((min(bwd, key=position.__getitem__), v, off))
    # backward starts at the first backward node after every offload (a pipeline chunk may hold
    # backward nodes that read no forward value, e.g. a received gradient's, before its forward ends)
    offs, seen, issue_at = {off for _, _, off in moved}, 0, None
    for n in graph.nodes:
        seen += n in offs
        if seen == len(offs) and n not in offs and n.meta.get(META_REGION) == REGION_BWD:
            issue_at = n
            break
    order = {n: i for i, n in enumerate(graph.nodes)}  # the offloads' own order (not their values')
    by_offload = sorted(moved, key=lambda m: order[m[2]])
    for (_, v, off), nxt in zip(by_offload, [*by_offload[1:], None]):
        with graph.inserting_before(nxt[2] if nxt else issue_at):
            done = graph.call_function(offload_done, (comm, off, v))
        done.meta = {META_BYTES: 0, META_REGION: v.meta.get(META_REGION)}
    moved.sort(key=lambda m: position[m[0]])
    for first_use, v, off in moved:
        with graph.inserting_before(issue_at):  # the start of backward, then the previous reload's wait
            issue = graph.call_function(reload_issue, (comm, off))
        with graph.inserting_before(first_use):
            back = graph.call_function(reload_wait, (comm, issue))
        # the bytes sit on the wait, whose value the backward reads (node_cost.activation_bytes counts
        # them from there); the lifetimes allocate them at the issue
        back.meta = {**v.meta, META_REGION: REGION_BWD}
        back.meta.pop(META_OFFLOAD)
        issue.meta = {**back.meta, META_BYTES: 0}
        for u in [u for u in v.users if u.meta.get(META_REGION) == REGION_BWD]:
            u.replace_input_with(v, back)
        issue_at = back
    graph.lint()
    return graph
