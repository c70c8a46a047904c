"""Collectives as graph operations, and the accounting of what they move.

The rewritten graph calls the functions at the bottom of this file. Each takes the
``Comm`` (the graph's first placeholder) explicitly: process groups, layouts and
statistics are never global. Issue functions start an asynchronous collective and
return a ``Pending``; ``collective_wait`` blocks on it where the graph needs the
result. On NCCL, ``Work.wait()`` makes the current stream wait on the collective's
stream (no device-wide sync), and c10d keeps the buffers alive until it finishes.

Byte accounting (``CommStats``): ``bytes`` is what one rank sends on the wire under
the ring algorithm (docs/design.md): all-gather and reduce-scatter move (g-1)/g of the
full buffer, all-reduce 2(g-1)/g. A collective whose group spans several nodes is
counted as inter-node (the ring's slowest hop carries all of it), otherwise intra.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from micscompile.core.errors import Error, InternalError
from micscompile.core.sharding import BucketLayout, flat_view, pack_grads, unpack_param

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_TO_ALL = "all_to_all"
SEND = "send"
"""A pipeline's point-to-point send of activations or gradients to the next or previous stage."""


def ring_wire_bytes(kind: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for a ring collective over ``nbytes`` (the full buffer)."""
    factor = 2 if kind == ALL_REDUCE else 1
    return factor * nbytes * (group_size - 1) // group_size


@dataclass(frozen=True)
class GroupInfo:
    """A process group and what the accounting needs to know about it."""

    name: str
    """"shard" (partition group), "replicate" (replication group) or "world"."""
    group: Any
    """The ProcessGroup (None = default group)."""
    ranks: tuple[int, ...]
    """Global ranks in group order."""
    rank: int
    """This rank's index in the group."""
    spans_nodes: bool

    @property
    def size(self) -> int:
        return len(self.ranks)

    def label(self) -> str:
        if len(self.ranks) <= 6:
            return f"{self.name}{list(self.ranks)}"
        r = self.ranks
        return f"{self.name}[{r[0]}, {r[1]}, ..., {r[-1]}]"


@dataclass
class CommRow:
    calls: int = 0
    bytes: int = 0
    intra_node_bytes: int = 0
    inter_node_bytes: int = 0
    """What the node's inter-node link carries for these collectives: a ring spanning nodes sends
    all its bytes through its slowest hop; the k rings of a hierarchical gather share the link."""
    tensor_bytes: int = 0
    """Sum of the full buffers' sizes (not what crossed the wire)."""


class CommStats:
    """Calls and bytes per (collective kind, group name), for one rank."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], CommRow] = {}
        self.groups: dict[str, GroupInfo] = {}
        self.live_gathered_bytes = 0
        """Gathered-parameter bytes between their all-gather issue and their release."""
        self.peak_gathered_bytes = 0

    def gathered(self, nbytes: int) -> None:
        """``nbytes`` of gathered parameters became live (> 0) or were released (< 0)."""
        self.live_gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.live_gathered_bytes)

    def record(self, kind: str, group: GroupInfo, nbytes: int, parallel_rings: int = 1) -> None:
        """``parallel_rings``: this many rings like this rank's run at once through the node's
        inter-node link (the k rings of a hierarchical gather's first stage)."""
        wire = ring_wire_bytes(kind, nbytes, group.size)
        self._count(kind, group, nbytes, wire, wire * parallel_rings if group.spans_nodes else None)

    def record_send(self, group: GroupInfo, nbytes: int, inter_node: bool) -> None:
        """A point-to-point send of ``nbytes`` to one peer of ``group`` (a pipeline's activations or
        gradients): all of it on the wire, through the node's NICs where the peer is on another node.
        (The peer's receive is its sender's bytes: only sends are counted.)"""
        self._count(SEND, group, nbytes, nbytes, nbytes if inter_node else None)

    def _count(self, kind: str, group: GroupInfo, tensor_bytes: int, wire: int, nic_bytes: int | None) -> None:
        """One call over ``group`` sending ``wire`` bytes; ``nic_bytes``: what it puts through the node's
        inter-node link (None: it stays inside the node)."""
        row = self.rows.setdefault((kind, group.name), CommRow())
        self.groups[group.name] = group
        row.calls += 1
        row.bytes += wire
        row.tensor_bytes += tensor_bytes
        if nic_bytes is None:
            row.intra_node_bytes += wire
        else:
            row.inter_node_bytes += nic_bytes

    def __getitem__(self, key: tuple[str, str]) -> CommRow:
        return self.rows.get(key, CommRow())

    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.rows.values())

    def counts(self) -> dict[tuple[str, str], dict[str, int]]:
        """Each row's counts, as they stand (``since`` takes what was added after)."""
        return {k: vars(r).copy() for k, r in self.rows.items()}

    def since(self, counts: dict[tuple[str, str], dict[str, int]]) -> dict[tuple[str, str], dict[str, int]]:
        """What each row gained after ``counts`` was taken (what one step's collectives add: ``add`` adds it again,
        for a step replayed as a CUDA graph, whose collectives the host no longer calls)."""
        return {k: {f: v - counts.get(k, {}).get(f, 0) for f, v in vars(r).items()} for k, r in self.rows.items()}

    def restore(self, counts: dict[tuple[str, str], dict[str, int]]) -> None:
        """Every row back to ``counts`` (a row added since is dropped): undoes what was counted after it was taken."""
        self.rows.clear()
        self.rows.update((k, CommRow(**c)) for k, c in counts.items())

    def add(self, gained: dict[tuple[str, str], dict[str, int]]) -> None:
        for key, delta in gained.items():
            row = self.rows.setdefault(key, CommRow())
            for f, v in delta.items():
                setattr(row, f, getattr(row, f) + v)

    def reset(self) -> None:
        self.rows.clear()
        self.peak_gathered_bytes = self.live_gathered_bytes

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {f"{k}/{g}": vars(r).copy() for (k, g), r in sorted(self.rows.items())}

    def __str__(self) -> str:
        head = f"{'collective':<16}{'group':<22}{'calls':>7}{'bytes/rank':>14}{'intra-node':>14}{'inter-node':>14}"
        lines = [head, "-" * len(head)]
        for (kind, gname), r in sorted(self.rows.items()):
            label = self.groups[gname].label()
            lines.append(
                f"{kind:<16}{label:<22}{r.calls:>7}{fmt_bytes(r.bytes):>14}"
                f"{fmt_bytes(r.intra_node_bytes):>14}{fmt_bytes(r.inter_node_bytes):>14}"
            )
        return "\n".join(lines)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise InternalError("unreachable: TiB returns")


@dataclass
class Comm:
    """Everything the graph's collectives need on one rank."""

    layouts: tuple[BucketLayout, ...]
    shard: GroupInfo
    replicate: GroupInfo
    world: GroupInfo
    inter: GroupInfo | None = None
    """Hierarchical stage groups (when the partition group spans nodes): the group's ranks with
    this rank's local index, one per node ..."""
    intra: GroupInfo | None = None
    """... and the group's ranks on this rank's node."""
    tensor: GroupInfo | None = None
    """The tensor-parallel group (consecutive ranks in one node), with ``Plan.tensor_parallel_size`` > 1."""
    context: GroupInfo | None = None
    """The context-parallel group (the ranks sharing each sample's sequence), with ``Plan.context_parallel_size``
    > 1."""
    stats: CommStats = field(default_factory=CommStats)
    micro_step: int = 0
    micro_steps: int = 1
    """Set by the runtime before each micro-step (a pipeline chunk's: before each of its backwards); the
    carried gathers, the accumulation and the second hop depend on them."""
    carried: deque = field(default_factory=deque)
    """(bucket, Pending) gathers issued for the next micro-step, in issue order."""
    arena: Any = None
    """The rank's ``Arena`` (planned buffers), or None: allocate as usual."""
    copy_stream: Any = None
    """CUDA stream of activation offload copies (micscompile.passes.offload), made on first use."""
    grads: list = field(default_factory=list)
    """The part's fp32 gradient accumulators, one per bucket (set by the runtime): the graph adds
    each micro-step's reduced shard into them (``accumulate``, ``accumulate_local``)."""
    second_hops: list = field(default_factory=list)
    """The second hops ``second_hop`` started in the last micro-step (``Pending``), waited at the boundary."""
    optimizer_shards: int = 1
    """d with ``Plan.optimizer_sharding="world"`` (the second hop is then a reduce-scatter), else 1."""
    updates: dict = field(default_factory=dict)
    """``optimizer_sharding="world"``: bucket -> the last optimizer step's update gather (``Pending``), waited
    just before the bucket's next gather: under the next step's forward until then (``settle``)."""

    def alloc(self, name: str, numel: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A flat buffer for a collective (``like``'s device, ``dtype`` or its dtype): the arena's next
        planned one, else a new tensor."""
        dtype = dtype or like.dtype
        if self.arena is None:
            return like.new_empty(numel, dtype=dtype)
        return self.arena.take(name, numel, dtype)


class CollectiveError(Error, RuntimeError):
    """A collective failed or timed out in the middle of a step: another rank died, hung or left
    the step. Raised instead of the backend's error, naming the collective and its group."""


@contextlib.contextmanager
def guarded(what: str) -> Iterator[None]:
    """Turn the backend's error from a collective into a ``CollectiveError`` that names ``what`` was
    waited for: gloo's RuntimeError (the peer closed its connection, or the group's timeout passed),
    NCCL's ``DistBackendError`` (a RuntimeError: the collective timed out or failed in a blocking
    wait, its communicator aborted)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CollectiveError(f"{what} failed: {first}") from exc


def step_failure(exc: CollectiveError, rank: int, step: int, timeout: datetime.timedelta | None) -> CollectiveError:
    """The error a step raises when one of its collectives failed: which rank, which step, what."""
    limit = f"{timeout.total_seconds():g} s" if timeout is not None else "the process group's"
    return CollectiveError(f"rank {rank}, step {step}: {exc}. Another rank died, hung or left the step "
                           f"(collectives give up after {limit}: mc.compile(timeout=...)); this rank stops here")


def default_timeout() -> datetime.timedelta:
    """The default process group's timeout (what ``init_process_group`` was given)."""
    pg = dist.group.WORLD
    for device in getattr(pg, "_device_types", ()):
        with contextlib.suppress(Exception):
            return pg._get_backend(device).options._timeout
    return dist.default_pg_timeout


def set_timeout(groups, timeout: datetime.timedelta) -> None:
    """Every collective on these groups gives up after ``timeout``, counted from its issue (c10d's
    per-group timeout: on gloo, and on NCCL with blocking wait, the waiting rank raises; on NCCL
    without it the watchdog kills the process, ``check_nccl_timeout``). A DeviceMesh's groups
    otherwise get the backend's default (30 min on gloo, 10 on NCCL), whatever
    ``init_process_group`` was given."""
    seen = set()
    for g in groups:
        pg = g.group if g.group is not None else dist.group.WORLD
        if id(pg) not in seen:
            seen.add(id(pg))
            dist.distributed_c10d._set_pg_timeout(timeout, pg)


BLOCKING_WAIT_VARS = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
"""What ProcessGroupNCCL reads, first name first, when each process group is created."""


def nccl_blocking_wait(environ=os.environ) -> bool:
    """Whether ProcessGroupNCCL's ``Work.wait()`` blocks the host until the collective is done and
    raises ``DistBackendError`` past the group's timeout (c10d's getCvarBool: 1/y/yes/t/true)."""
    for name in BLOCKING_WAIT_VARS:
        if name in environ:
            return environ[name].strip().lower() in ("1", "y", "yes", "t", "true")
    return False


NCCL_WITHOUT_BLOCKING_WAIT = (
    "mc.compile(timeout=...) on NCCL without TORCH_NCCL_BLOCKING_WAIT=1: a dead or hung rank will not "
    "raise CollectiveError. NCCL's Work.wait() does not block the host, so the step never sees the "
    "failure; ProcessGroupNCCL's watchdog finds the collective past the timeout and kills the process "
    "(SIGABRT, 'Watchdog caught collective operation timeout' in the log) about 60 s later "
    "(4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC). For CollectiveError within the timeout, launch every "
    "rank with TORCH_NCCL_BLOCKING_WAIT=1 in its environment (read when init_process_group creates "
    "the group; e.g. TORCH_NCCL_BLOCKING_WAIT=1 torchrun ...): each collective wait then also blocks "
    "the host until the collective is done. docs/gpu.md, 'A dead or hung rank on NCCL'")


def check_nccl_timeout(backend: str, device: torch.device, environ=os.environ) -> None:
    """Warn when the step's collectives run on NCCL (``device`` is a GPU and ``backend``, as
    ``dist.get_backend()`` names it, has NCCL) without blocking wait: ``timeout`` then cannot raise
    ``CollectiveError``, only arm the watchdog."""
    if device.type == "cuda" and "nccl" in backend and not nccl_blocking_wait(environ):
        warnings.warn(NCCL_WITHOUT_BLOCKING_WAIT, RuntimeWarning, stacklevel=3)


class Pending(NamedTuple):
    work: Any
    """The async Work handle (None when nothing was sent)."""
    result: torch.Tensor | None
    """Valid after the wait."""
    finish: Callable[[], torch.Tensor] | None = None
    """Run at the wait, after ``work``: the rest of a chained collective; returns the result."""
    what: str = "collective"
    """What is waited for, e.g. "all_gather of bucket 3 over shard[0, 1]" (for errors)."""


def gather_full(layouts, shards: list[torch.Tensor], shard: GroupInfo, aliases: dict[str, list[str]]) -> dict:
    """Every parameter of ``layouts`` unsharded on CPU, under each of its aliases (an all-gather per
    bucket over the partition group: every rank of it must call this)."""
    full = {}
    for lay, local in zip(layouts, shards):
        gathered = local
        if lay.partition_size > 1:
            gathered = local.new_empty(lay.padded_numel)
            dist.all_gather_single(gathered, local, group=shard.group)
        for slot in lay.slots:
            t = unpack_param(gathered, slot.offset, slot.numel, slot.shape).detach().cpu().clone()
            for alias in aliases[slot.name]:
                full[alias] = t
    return full


# ---- operations inserted into the graph (call_function targets) ----------------------


def _gather_input(shard: torch.Tensor, out: torch.Tensor, index: int) -> torch.Tensor:
    """What a rank sends into the gather ``out``: its ``shard``, or, with mixed precision, the
    shard cast into its own chunk of ``out`` (an in-place gather: the cast needs no buffer and the
    wire carries the low precision)."""
    if out.dtype == shard.dtype and out.numel() > shard.numel():
        return shard
    own = out.view(-1, shard.numel())[index]
    own.copy_(shard)
    return own


def all_gather_issue(comm: Comm, bucket: int, shard: torch.Tensor, hierarchical: bool = False) -> Pending:
    """Start gathering a bucket over the partition group into a [p * row_numel] buffer in the
    layout's ``gather_dtype`` (p = 1, mixed precision: only the cast)."""
    layout = comm.layouts[bucket]
    if comm.updates:
        settle(comm, bucket)  # its shard is whole again
    if hierarchical:
        pending = _hierarchical_all_gather(comm, layout, shard, f"AG{bucket}")
    else:
        out = comm.alloc(f"AG{bucket}", layout.padded_numel, shard, layout.gather_dtype)
        src = _gather_input(shard, out, comm.shard.rank)
        work = None
        if layout.partition_size > 1:
            work = dist.all_gather_single(out, src, group=comm.shard.group, async_op=True)
            comm.stats.record(ALL_GATHER, comm.shard, layout.full_bytes)
        pending = Pending(work, out, what=_what(ALL_GATHER, bucket, comm.shard))
    comm.stats.gathered(layout.full_bytes)
    return pending


def all_gather_next(comm: Comm, bucket: int, shard: torch.Tensor, hierarchical: bool = False) -> None:
    """Start the next micro-step's gather of a bucket (nothing on the last micro-step)."""
    if comm.micro_step < comm.micro_steps - 1:
        comm.carried.append((bucket, all_gather_issue(comm, bucket, shard, hierarchical)))


def all_gather_carried(comm: Comm, bucket: int, shard: torch.Tensor, hierarchical: bool = False) -> Pending:
    """The gather the previous micro-step issued for this one; issued here on the first micro-step."""
    if comm.micro_step == 0:
        return all_gather_issue(comm, bucket, shard, hierarchical)
    carried_bucket, pending = comm.carried.popleft()
    if carried_bucket != bucket:
        raise InternalError(f"the previous micro-step gathered bucket {carried_bucket} for this one, "
                           f"which needs bucket {bucket}: the graph's carried gathers are out of order")
    return pending


def _what(kind: str, bucket: int, group: GroupInfo) -> str:
    return f"{kind} of bucket {bucket} over {group.label()}"


def collective_wait(comm: Comm, pending: Pending) -> torch.Tensor:
    """Block until the collective is done and return its result: the host on gloo; on NCCL the
    current stream, and the host too with TORCH_NCCL_BLOCKING_WAIT=1 (only then can a timeout
    raise here)."""
    with guarded(pending.what):
        if pending.work is not None:
            pending.work.wait()
        return pending.finish() if pending.finish is not None else pending.result


def release(comm: Comm, bucket: int, *params: torch.Tensor) -> None:
    """The gathered parameters' last use: the graph drops them right after this node."""
    comm.stats.gathered(-comm.layouts[bucket].full_bytes)


def _packed(comm: Comm, bucket: int, like: torch.Tensor, grads: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    """The bucket's gradients packed, in ``grad_dtype``, into its flat buffer (the arena's, planned)."""
    layout = comm.layouts[bucket]
    return pack_grads(layout, grads, comm.alloc(f"RS{bucket}", layout.padded_numel, like, layout.grad_dtype))


def reduce_scatter_issue(
    comm: Comm, bucket: int, like: torch.Tensor, *grads: torch.Tensor | None, hierarchical: bool = False,
) -> Pending:
    """Start summing a bucket's gradients over the partition group; result = own shard."""
    layout = comm.layouts[bucket]
    flat = _packed(comm, bucket, like, grads)
    if hierarchical:
        return _hierarchical_reduce_scatter(comm, layout, flat, f"RS{bucket}")
    out = comm.alloc(f"RS{bucket}", layout.row_numel, flat)
    work = dist.reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=comm.shard.group, async_op=True)
    comm.stats.record(REDUCE_SCATTER, comm.shard, layout.grad_bytes)
    return Pending(work, out, what=_what(REDUCE_SCATTER, bucket, comm.shard))


def all_reduce_issue(comm: Comm, bucket: int, like: torch.Tensor, *grads: torch.Tensor | None) -> Pending:
    """grad_sync="every_step": sum full gradients over all ranks; result = own shard's row."""
    layout = comm.layouts[bucket]
    flat = _packed(comm, bucket, like, grads)
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=comm.world.group, async_op=True)
    comm.stats.record(ALL_REDUCE, comm.world, layout.grad_bytes)
    return Pending(work, flat.view(layout.partition_size, layout.row_numel)[comm.shard.rank],
                   what=_what(ALL_REDUCE, bucket, comm.world))


def accumulate(comm: Comm, bucket: int, grad: torch.Tensor) -> None:
    """This micro-step's reduced gradient shard of a bucket added into its fp32 accumulator (the
    first micro-step copies it), right after the reduction, so that the bucket's second hop can
    start there (``second_hop``). In a pipeline chunk, a micro-step is one of the chunk's backwards."""
    acc = comm.grads[bucket]
    acc.copy_(grad) if comm.micro_step == 0 else acc.add_(grad)


def accumulate_local(comm: Comm, bucket: int, like: torch.Tensor, *grads: torch.Tensor | None,
                     written: tuple[int, ...] = ()) -> torch.Tensor:
    """p = 1: the bucket's gradients added (and cast) straight into their slots of its
    fp32 accumulator, the first micro-step packing them in (``pack_grads``): no pack buffer, no
    extra copy. The slots in ``written`` (their gradients None here) their matmuls accumulate
    (``accumulate_mm``): the first micro-step must not zero them. Returns the accumulator."""
    layout, acc = comm.layouts[bucket], comm.grads[bucket]
    if comm.micro_step == 0:
        return pack_grads(layout, grads, acc, written)
    pairs = [(flat_view(acc, slot.offset, slot.numel, tuple(g.shape)), g) for slot, g in zip(layout.slots, grads)
             if g is not None]
    if pairs:
        torch._foreach_add_(*map(list, zip(*pairs)))  # one dispatch (one kernel per dtype group on a GPU)
    return acc


def accumulate_mm(comm: Comm, bucket: int, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """p = 1: a weight's gradient ``a @ b`` computed straight into its slot of the bucket's
    accumulator (``passes.accumulate_in_matmuls``): the first micro-step's matmul writes the slot,
    later ones add to it inside the GEMM (``addmm_``, beta 1). No gradient buffer, and no pass over
    it to copy or add it (``accumulate_local`` leaves the slot to this)."""
    s = comm.layouts[bucket].slots[slot]
    view = flat_view(comm.grads[bucket], s.offset, s.numel, s.shape)
    if comm.micro_step == 0:
        torch.mm(a, b, out=view)
    else:
        view.addmm_(a, b)


def second_hop(comm: Comm, bucket: int, dtype: torch.dtype) -> None:
    """2-hop's second hop, on the last micro-step (earlier ones: nothing): the bucket's accumulated
    gradient shard all-reduced over "replicate" in ``dtype`` as soon as it is final, under the rest
    of the backward; the step waits for it at the boundary (``comm.second_hops``)."""
    if comm.micro_step == comm.micro_steps - 1:
        start, kind = (reduce_scatter_start, REDUCE_SCATTER) if comm.optimizer_shards > 1 else (all_reduce_start, ALL_REDUCE)
        comm.second_hops.append(start(comm.stats, comm.replicate, comm.grads[bucket], dtype,
                                      what=_what(f"second-hop {kind}", bucket, comm.replicate)))


def all_reduce_start(stats: CommStats, group: GroupInfo, acc: torch.Tensor, dtype: torch.dtype,
                     what: str | None = None) -> Pending:
    """The all-reduce of a gradient accumulator (or the loss), summed in ``dtype``
    (Plan.reduce_dtype): in place when ``acc`` has that dtype, else through a cast copy written
    back at the wait (``collective_wait``)."""
    buf = acc if acc.dtype == dtype else acc.to(dtype)
    work = dist.all_reduce(buf, group=group.group, async_op=True)
    stats.record(ALL_REDUCE, group, buf.numel() * buf.element_size())
    return Pending(work, acc, None if buf is acc else lambda: acc.copy_(buf),
                   what=what or f"boundary all_reduce over {group.label()}")


def reduce_scatter_start(stats: CommStats, group: GroupInfo, acc: torch.Tensor, dtype: torch.dtype,
                         what: str | None = None) -> Pending:
    """``optimizer_sharding="world"``: a gradient accumulator reduce-scattered over ``group`` (the
    replicas) in ``dtype``. Cut into ``group.size`` rows, its row ``group.rank`` becomes the sum over the
    group (written back at the wait); the other rows are left as they were: the optimizer reads only
    this rank's row, and the update gather (``update_gather_start``) overwrites the parameters' others."""
    buf = acc if acc.dtype == dtype else acc.to(dtype)
    row = acc.view(group.size, -1)[group.rank]
    out = buf.new_empty(row.numel())
    work = dist.reduce_scatter_single(out, buf, op=dist.ReduceOp.SUM, group=group.group, async_op=True)
    stats.record(REDUCE_SCATTER, group, buf.numel() * buf.element_size())
    return Pending(work, row, lambda: row.copy_(out), what=what or f"boundary reduce_scatter over {group.label()}")


def settle(comm: Comm, bucket: int | None = None) -> None:
    """Wait for the update gather of ``bucket`` (None: of every bucket) the last optimizer step left in flight."""
    for b in [bucket] if bucket is not None else list(comm.updates):
        pending = comm.updates.pop(b, None)
        if pending is not None:
            collective_wait(comm, pending)


def update_gather_start(stats: CommStats, group: GroupInfo, shard: torch.Tensor, bucket: int,
                        dtype: torch.dtype | None = None) -> Pending:
    """``optimizer_sharding="world"``: after the optimizer stepped row ``group.rank`` of a bucket's shard,
    every replica's row all-gathered into every replica's shard: in place, or in ``dtype`` (the plan's
    param_dtype: what the next gathers cast the shard to anyway) into a buffer whose other rows are
    copied into the shard at the wait, this rank's own row keeping its fp32 master (the wire carries
    as many bytes as the second half of a ``dtype`` all-reduce; ``exact_rows`` restores the masters)."""
    rows = shard.view(group.size, -1)
    what = _what("update all_gather", bucket, group)
    if dtype is None or dtype == shard.dtype:
        work = dist.all_gather_single(shard, rows[group.rank], group=group.group, async_op=True)
        stats.record(ALL_GATHER, group, shard.numel() * shard.element_size())
        return Pending(work, shard, what=what)
    buf = shard.new_empty(shard.numel(), dtype=dtype)
    low = buf.view(group.size, -1)
    low[group.rank].copy_(rows[group.rank])
    work = dist.all_gather_single(buf, low[group.rank], group=group.group, async_op=True)
    stats.record(ALL_GATHER, group, buf.numel() * buf.element_size())

    def finish() -> torch.Tensor:
        others = [r for r in range(group.size) if r != group.rank]
        rows[others] = low[others].to(shard.dtype)
        return shard
    return Pending(work, None, finish, what=what)


def exact_rows(group: GroupInfo, shard: torch.Tensor) -> None:
    """Every replica's fp32 master row of a shard all-gathered into every replica's shard (after update
    gathers in a low precision, before the shard is exported: a state dict, the full parameters)."""
    with guarded(f"exact all_gather over {group.label()}"):
        dist.all_gather_single(shard, shard.view(group.size, -1)[group.rank], group=group.group)


# ---- hierarchical collectives (a partition group of p ranks over m = p / k nodes) -----------
#
# Group index i = node * k + local. Stage groups: ``inter`` (the m ranks with this rank's local
# index, by node) and ``intra`` (the k ranks of this node, by local index). Flat buffers only
# (gloo has no coalescing); the same calls run on NCCL.


def _hierarchical_all_gather(comm: Comm, layout: BucketLayout, shard: torch.Tensor, name: str) -> Pending:
    """(1) all-gather across nodes among the ranks with this local index (the k of them run at once,
    sharing the node's link): [C_local, C_{k+local}, ...]; at the wait, (3) all-gather those inside
    the node and (2) reorder [local][node] -> [node][local]: exactly the flat [C0, ..., C_{p-1}]."""
    inter, intra = comm.inter, comm.intra
    m, k, row = inter.size, intra.size, layout.row_numel
    across = comm.alloc(name, m * row, shard, layout.gather_dtype)
    work = dist.all_gather_single(across, _gather_input(shard, across, inter.rank), group=inter.group, async_op=True)
    comm.stats.record(ALL_GATHER, inter, across.numel() * across.element_size(), parallel_rings=k)

    def finish() -> torch.Tensor:
        inside = comm.alloc(name, k * m * row, across)
        dist.all_gather_single(inside, across, group=intra.group)
        comm.stats.record(ALL_GATHER, intra, inside.numel() * inside.element_size())
        result = comm.alloc(name, k * m * row, across)
        result.view(m, k, row).copy_(inside.view(k, m, row).transpose(0, 1))
        return result

    return Pending(work, None, finish, what=f"hierarchical {_what(ALL_GATHER, layout.index, comm.shard)}")


def _hierarchical_reduce_scatter(comm: Comm, layout: BucketLayout, flat: torch.Tensor, name: str) -> Pending:
    """Inside the node first: reorder [node][local] -> [local][node] and reduce-scatter over the k
    ranks (each gets the node's sum of the m chunks with its local index); then across nodes,
    asynchronously: reduce-scatter those m chunks over the inter group. Result: own chunk, summed
    over all p ranks."""
    inter, intra = comm.inter, comm.intra
    m, k, row = inter.size, intra.size, layout.row_numel
    by_local = comm.alloc(name, k * m * row, flat)
    by_local.view(k, m, row).copy_(flat.view(m, k, row).transpose(0, 1))
    partial = comm.alloc(name, m * row, flat)
    with guarded(f"hierarchical {_what(REDUCE_SCATTER, layout.index, intra)}"):
        dist.reduce_scatter_single(partial, by_local, op=dist.ReduceOp.SUM, group=intra.group)
    comm.stats.record(REDUCE_SCATTER, intra, by_local.numel() * by_local.element_size())
    out = comm.alloc(name, row, flat)
    work = dist.reduce_scatter_single(out, partial, op=dist.ReduceOp.SUM, group=inter.group, async_op=True)
    comm.stats.record(REDUCE_SCATTER, inter, partial.numel() * partial.element_size(), parallel_rings=k)
    return Pending(work, out, what=f"hierarchical {_what(REDUCE_SCATTER, layout.index, inter)}")


# ---- tensor parallelism (lowering.tensor_split): collectives over the "tensor" group ----------------
# Blocking: a tensor-parallel collective sits on the compute's critical path (its result is the next
# op's input). ``comm`` is None while the split propagates shapes: each then returns a value of its
# result's shape alone. Bytes are counted as for every collective (ring_wire_bytes over the group).

def tensor_all_reduce(comm: Comm | None, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """A partial value summed (or its maximum taken, ``op="max"``) over the tensor-parallel ranks."""
    if comm is None:
        return x.clone()
    out = x.contiguous().clone()
    with guarded(f"{op} all_reduce over {comm.tensor.label()}"):
        dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=comm.tensor.group)
    comm.stats.record(ALL_REDUCE, comm.tensor, out.numel() * out.element_size())
    return out


def tensor_all_gather(comm: Comm | None, x: torch.Tensor, dim: int, segments: int, tp: int) -> torch.Tensor:
    """A value split along ``dim`` (in ``segments``, ``core.tensor_layout``) made whole on every tensor rank."""
    from micscompile.core.tensor_layout import S, assemble

    if comm is None:
        return assemble([x] * tp, S(dim, segments))
    pieces = [torch.empty_like(x) for _ in range(tp)]
    with guarded(f"all_gather over {comm.tensor.label()}"):
        dist.all_gather(pieces, x.contiguous(), group=comm.tensor.group)
    full = assemble(pieces, S(dim, segments))
    comm.stats.record(ALL_GATHER, comm.tensor, full.numel() * full.element_size())
    return full


def tensor_reduce_scatter(comm: Comm | None, x: torch.Tensor, dim: int, segments: int, tp: int) -> torch.Tensor:
    """A partial value summed over the tensor ranks, each keeping its piece along ``dim`` (in ``segments``):
    sequence parallelism's conversion where tensor parallelism all-reduces."""
    from micscompile.core.tensor_layout import S, local_piece

    if comm is None:
        return local_piece(x, S(dim, segments), 0, tp).contiguous()
    pieces = [local_piece(x, S(dim, segments), r, tp).contiguous() for r in range(tp)]
    out = torch.empty_like(pieces[0])
    with guarded(f"reduce_scatter over {comm.tensor.label()}"):
        dist.reduce_scatter(out, pieces, group=comm.tensor.group)
    comm.stats.record(REDUCE_SCATTER, comm.tensor, x.numel() * x.element_size())
    return out


def tensor_slice(comm: Comm | None, x: torch.Tensor, dim: int, segments: int, tp: int) -> torch.Tensor:
    """This tensor rank's piece of a replicated value (no communication)."""
    from micscompile.core.tensor_layout import S, local_piece

    return local_piece(x, S(dim, segments), 0 if comm is None else comm.tensor.rank, tp).contiguous()


def tensor_shard_start(comm: Comm | None, like: torch.Tensor, size: int) -> torch.Tensor:
    """Where this tensor rank's piece of a dim split into pieces of ``size`` starts (its first vocabulary id):
    a 0-d tensor of ``like``'s dtype and device (a value an Inductor region can take as an input)."""
    return torch.full((), 0 if comm is None else comm.tensor.rank * size, dtype=like.dtype, device=like.device)


TENSOR_OPS = (tensor_all_reduce, tensor_all_gather, tensor_reduce_scatter, tensor_slice, tensor_shard_start)
"""The tensor-parallel ops a split graph calls (``insert_collectives`` binds their ``comm``)."""


# ---- context parallelism (lowering.context_split): over the "context" group ------------------------------------
# The c ranks of a context group each hold L = s / c consecutive tokens of every sample: rank r tokens [r L, (r+1) L).
# ``comm`` is None while the split propagates shapes (rank 0's view).

def _context(comm: Comm | None) -> tuple[int, int]:
    """(this rank's index in its context group, the group's size); (0, 1) before ``comm`` is bound."""
    return (0, 1) if comm is None or comm.context is None else (comm.context.rank, comm.context.size)


def context_positions(comm: Comm | None, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The global positions of this rank's ``length`` tokens: ``arange(r L, (r+1) L)``, where the trace had
    ``arange(L)`` (rotary angles, position ids); on ``device`` (the trace's meta until ``retarget_device``)."""
    r, _ = _context(comm)
    return torch.arange(r * length, (r + 1) * length, dtype=dtype, device=device)


def context_slice(comm: Comm | None, table: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """This rank's ``length`` rows of a position table along ``dim``, where the trace sliced its first ``length``."""
    r, _ = _context(comm)
    return table.narrow(dim, r * length, length)


def context_slice_backward(comm: Comm | None, grad: torch.Tensor, shape: list[int], dim: int,
                           length: int) -> torch.Tensor:
    """``context_slice``'s backward: ``grad`` placed at this rank's rows of a zero table of ``shape``."""
    r, _ = _context(comm)
    out = grad.new_zeros(shape)
    out.narrow(dim, r * length, length).copy_(grad)
    return out


def context_to_heads(comm: Comm | None, x: torch.Tensor, c: int) -> torch.Tensor:
    """Ulysses' first all-to-all over the c context ranks: (b, h, L, e) of this rank's tokens for every head ->
    (b, h/c, c L, e), every token of this rank's h/c heads, in the sequence's order."""
    b, h, length, e = x.shape
    if comm is None:
        return x.new_empty((b, h // c, c * length, e))
    send = x.reshape(b, c, h // c, length, e).transpose(0, 1).contiguous()  # piece j: heads j h/c.. for rank j
    recv = torch.empty_like(send)
    with guarded(f"all_to_all over {comm.context.label()}"):
        dist.all_to_all_single(recv, send, group=comm.context.group)
    comm.stats.record(ALL_TO_ALL, comm.context, send.numel() * send.element_size())
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * length, e)  # recv[j]: rank j's tokens of my heads


def context_to_tokens(comm: Comm | None, y: torch.Tensor, c: int) -> torch.Tensor:
    """Ulysses' second all-to-all, ``context_to_heads``' inverse: (b, h/c, c L, e) -> (b, h, L, e), laid out as the
    fused attention kernels lay out theirs ((b, L, h, e) in memory: a ``transpose(1, 2)`` of it is contiguous)."""
    b, hc, s, e = y.shape
    length = s // c
    if comm is None:
        return y.new_empty((b, length, hc * c, e)).transpose(1, 2)
    send = y.reshape(b, hc, c, length, e).permute(2, 0, 1, 3, 4).contiguous()  # piece j: rank j's tokens
    recv = torch.empty_like(send)
    with guarded(f"all_to_all over {comm.context.label()}"):
        dist.all_to_all_single(recv, send, group=comm.context.group)
    comm.stats.record(ALL_TO_ALL, comm.context, send.numel() * send.element_size())
    # recv[j]: my tokens of rank j's heads -> (b, L, c h/c, e) in memory, viewed (b, h, L, e)
    return recv.permute(1, 3, 0, 2, 4).contiguous().view(b, length, c * hc, e).transpose(1, 2)


CONTEXT_OPS = (context_positions, context_slice, context_slice_backward, context_to_heads, context_to_tokens)
"""The context-parallel ops a split graph calls (``insert_collectives`` binds their ``comm``)."""
GROUP_OPS = TENSOR_OPS + CONTEXT_OPS
"""Every op of a split graph whose ``comm`` ``insert_collectives`` binds."""
