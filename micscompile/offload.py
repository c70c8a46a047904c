"""Activation offload: graph ops that copy a checkpointed block output to host memory
after the forward's last use of it and bring it back before the backward's first use
(``passes.checkpoint`` inserts them when ``Plan.offload_activations``).

On CUDA the copies run on a side stream into pinned host memory: ``offload`` records an
event after the copy and the device tensor is released to the allocator only once the
copy stream is done with it (``record_stream``); ``reload`` copies back on the side
stream and makes the current stream wait for it. On the CPU the same Program runs with
plain copies (host and device are one memory: the numbers, the order and the accounting
are what is tested there).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.fx

from micscompile.cost_model.node_cost import META_BYTES
from micscompile.trace import META_REGION, REGION_BWD


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


def reload(comm, off: Offloaded) -> torch.Tensor:
    """Bring an offloaded tensor back to its device (the current stream waits for the copy)."""
    if off.done is None:
        return off.host.clone()
    stream = _copy_stream(comm)
    with torch.cuda.stream(stream):
        stream.wait_event(off.done)
        out = off.host.to(off.device, non_blocking=True)
    torch.cuda.current_stream().wait_stream(stream)
    out.record_stream(torch.cuda.current_stream())
    return out


META_OFFLOAD = "mc_offload"
"""Set by passes.checkpoint on the segment outputs the backward reads (offload candidates)."""


def offload_pass(graph: torch.fx.Graph, ctx) -> torch.fx.Graph:
    """After insert_collectives: each marked value is offloaded after its last forward use and
    reloaded right before its first backward use; the backward reads the reloaded copy."""
    if not ctx.plan.plan.offload_activations:
        return graph
    comm = next(n for n in graph.nodes if n.op == "placeholder")
    position = {n: i for i, n in enumerate(graph.nodes)}  # of the original nodes: insertions keep their order
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
        with graph.inserting_before(min(bwd, key=position.__getitem__)):
            back = graph.call_function(reload, (comm, off))
        back.meta = {**v.meta, META_REGION: REGION_BWD}
        back.meta.pop(META_OFFLOAD)
        for u in bwd:
            u.replace_input_with(v, back)
    graph.lint()
    return graph
