"""At p = 1 a weight's gradient matmul writes straight into the gradient accumulator.

With nothing to reduce-scatter, each bucket's gradients go into its fp32 accumulator
(``collectives.accumulate_local``): the first micro-step copies them in, later ones add them. A
linear layer's weight gradient is one ``mm`` whose only reader is that copy or add, so the
runtime graph computes it in place instead (``collectives.accumulate_mm``): ``mm(out=)`` into the
accumulator's slot on the first micro-step, ``addmm_`` (beta 1) on later ones. Per micro-step
that saves a gradient-sized buffer and a pass that reads and writes it: for bench_peers' GPT, 3.1M
of its 3.3M parameters, 10.4 -> 8.1 ms per micro-step on one core of this machine
(``mm`` into a buffer plus ``_foreach_add_``, against ``addmm_``). DDP and eager PyTorch pay that
pass (autograd's ``AccumulateGrad``).

Only a ``mm`` of the accumulator's dtype and its slot's shape, read by nothing else and the gradient
of no other slot, qualifies (a mixed-precision gradient is cast as it is added and stays as it
was). Runs on the graph the runtime executes, after lowering (it never changes the Program: the
simulator still prices the matmul and the add, so its p = 1 peak errs high by the gradients'
buffers), before ``out_variants`` and unless Inductor generates the compute.
"""

from __future__ import annotations

import torch
import torch.fx

from micscompile.core import collectives as C
from micscompile.passes.context import PassContext
from micscompile.trace import META_BYTES

_MM = torch.ops.aten.mm.default
_GRADS_FROM = 3
"""``accumulate_local(comm, bucket, like, *grads)``: where its gradients start."""


def accumulate_in_matmuls_pass(graph: torch.fx.Graph, ctx: PassContext) -> torch.fx.Graph:
    for acc in [n for n in graph.nodes if n.target is C.accumulate_local]:
        comm, bucket = acc.args[0], acc.args[1]
        layout = ctx.layouts[bucket]
        args, written = list(acc.args), list(acc.kwargs.get("written", ()))
        for i, slot in enumerate(layout.slots):
            mm = args[_GRADS_FROM + i]  # (read by nothing else, and the gradient of this slot only)
            if not (isinstance(mm, torch.fx.Node) and mm.target is _MM and len(mm.users) == 1
                    and args.count(mm) == 1):
                continue
            val = mm.meta.get("val")
            if not (isinstance(val, torch.Tensor) and val.dtype == layout.dtype and tuple(val.shape) == slot.shape):
                continue
            with graph.inserting_before(mm):
                new = graph.call_function(C.accumulate_mm, (comm, bucket, i, *mm.args))
                new.meta.update({k: v for k, v in mm.meta.items() if k not in ("val", "tensor_meta", META_BYTES)})
            args[_GRADS_FROM + i] = None
            written.append(i)
            acc.args = tuple(args)
            graph.erase_node(mm)
        if written:
            acc.kwargs = {**acc.kwargs, "written": tuple(written)}
    graph.lint()
    return graph
