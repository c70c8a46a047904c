"""NCCL's point-to-point semantics on gloo, for tests of the pipeline runtime.

On CUDA, ``torch.distributed.batch_isend_irecv`` coalesces the batch (ProcessGroupNCCL supports
coalescing, so ``distributed_c10d`` returns the coalescing manager's one Work), the received
data is there only once that Work is waited for, and NCCL reads a send buffer at any time until
then. ``nccl_p2p()`` makes gloo's ``batch_isend_irecv`` return that way: one Work per batch; every
receive buffer holds NaN (integers: -1) until the Work is waited for; a send buffer written before
then raises. It shows what the runtime reads and when, not ordering or deadlock: matching is still
by gloo's tags and sends do not block (``PipeSchedule.check_nccl`` models those rules).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def _poison(t: torch.Tensor) -> None:
    t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else -1)


class BatchWork:
    """The one Work of a coalesced batch."""

    def __init__(self, works: list, received: list, sent: list) -> None:
        self.works, self.received, self.sent = works, received, sent

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        for dst, staged in self.received:
            dst.copy_(staged)
        for t, snapshot in self.sent:
            if not torch.equal(t, snapshot):
                raise AssertionError("a send buffer was written before its batch's Work was waited for")
        self.works, self.received, self.sent = [], [], []
        return True

    def is_completed(self) -> bool:
        return not self.works


@contextlib.contextmanager
def nccl_p2p():
    """Within: ``dist.batch_isend_irecv`` as on CUDA (see the module docstring)."""
    real = dist.batch_isend_irecv

    def batch_isend_irecv(ops: list[dist.P2POp]) -> list[BatchWork]:
        staged, received, sent = [], [], []
        for op in ops:
            if op.op is dist.irecv:
                tmp = torch.empty_like(op.tensor)
                received.append((op.tensor, tmp))
                _poison(op.tensor)
                staged.append(dist.P2POp(dist.irecv, tmp, op.peer, op.group, op.tag))
            else:
                sent.append((op.tensor, op.tensor.clone()))
                staged.append(op)
        return [BatchWork(real(staged), received, sent)]

    dist.batch_isend_irecv = batch_isend_irecv
    try:
        yield
    finally:
        dist.batch_isend_irecv = real
