"""A pipeline schedule IR: one ordered list of compute and point-to-point actions per rank.

Terms. S pipeline ranks (positions 0..S-1 of one pipeline), v model chunks per rank (v > 1
interleaves), m micro-batches. The model is cut into S*v chunks; chunk c lives on rank c % S,
so rank r holds chunks r, r+S, r+2S, ... Activations flow c -> c+1, gradients c+1 -> c.

Actions. F(mb, c) / B(mb, c) run micro-batch mb through chunk c. A zero-bubble schedule splits each
backward in two (``passes.weight_split``): B(mb, c) then computes only the gradient of the chunk's input
(what the previous chunk waits for) and W(mb, c), later on the same rank, its weight gradients. A P2P action names a chunk
of the rank that runs it: SA(mb, c) sends chunk c's output and matches RA(mb, c+1), which
receives chunk c+1's input; SG(mb, c) sends the gradient of chunk c's input and matches
RG(mb, c-1), which receives the gradient of chunk c-1's output. AR, the boundary gradient
all-reduce, is every rank's last action. A one-rank pipeline (S = 1) has no P2P actions.

String form, which PipeSchedule.parse reads back (this is one_f_one_b(2, 2)):

    pipeline 1f1b stages=2 chunks=1 micro_batches=2
    r0: F0.0 SA0.0 F1.0 SA1.0 RG0.0 B0.0 RG1.0 B1.0 AR
    r1: RA0.1 F0.1 B0.1 SG0.1 RA1.1 F1.1 B1.1 SG1.1 AR

Execution (validate, simulate, grid). The runtime sends each run of adjacent P2P actions as
one batch (``batches``) and waits for a receive right before the compute that reads it.
Two models of that run: validate() checks the schedule in both.

* Eager sends (gloo; simulate and grid): every rank runs its list in order; a send completes
  when posted; a receive never blocks, and a compute whose input comes through a receive
  starts p2p_s after the matching send is posted.
* NCCL (check_nccl): a rank's batches run one after another on its communicator's stream,
  a batch starts once the rank's earlier computes are done (the stream waits for them) and
  finishes once the batch holding each of its ops' peers has started (a send completes only
  when its receive runs); a compute waits for the batch that brings its inputs. Two ranks'
  sends and receives match in posting order (NCCL ignores tags). The model assumes the ops of
  one batch progress independently once their peers' batches run (what grouped P2P does in
  practice, as Megatron's batched P2P relies on; NCCL does not promise it for every mix of
  peers in one group).

validate() also requires each compute's inputs (F(mb, c-1); B(mb, c+1) and F(mb, c)) to come
earlier on its rank or through a receive placed before it, so the receives carry every
cross-rank dependency. Generators put each receive right before its compute and each send
right after, then post receives earlier where NCCL would deadlock (``_nccl_order``): runs of
adjacent P2P actions (SA RG, SG RA) become one batch_isend_irecv each.
"""

from __future__ import annotations

import enum
import functools
import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import accumulate, product

from micscompile.core.errors import InputError, InternalError, ScheduleError
from micscompile.core.schedules import ZERO_BUBBLE, check_schedule


class Op(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    """A zero-bubble schedule's weight-gradient half of a backward (its B computed the input gradient)."""
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    ALL_REDUCE = "AR"

    __hash__ = object.__hash__  # (members are singletons: identity, not Enum's hash of the name in Python, which
    # mc.autotune's schedule and Program simulations call tens of millions of times)


_RECVS = (Op.RECV_ACT, Op.RECV_GRAD)
_SENDS = (Op.SEND_ACT, Op.SEND_GRAD)
# the matching action of each P2P op: (its op, chunk offset)
_PEER = {Op.SEND_ACT: (Op.RECV_ACT, 1), Op.RECV_ACT: (Op.SEND_ACT, -1),
         Op.SEND_GRAD: (Op.RECV_GRAD, -1), Op.RECV_GRAD: (Op.SEND_GRAD, 1)}
_TOKEN = re.compile(r"(SA|RA|SG|RG|F|B|W)(\d+)\.(\d+)")
COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.WEIGHT)
"""The actions that run a chunk (the others move values or end the step)."""
_HEADER = re.compile(r"pipeline (\S+) stages=(\d+) chunks=(\d+) micro_batches=(\d+)")


@dataclass(frozen=True, slots=True)
class PipeAction:
    """One step of one rank; mb and chunk are None only for ALL_REDUCE."""

    op: Op
    mb: int | None = None
    chunk: int | None = None

    def __str__(self) -> str:
        return "AR" if self.op is Op.ALL_REDUCE else f"{self.op.value}{self.mb}.{self.chunk}"

    @classmethod
    def parse(cls, token: str) -> PipeAction:
        if token == "AR":
            return cls(Op.ALL_REDUCE)
        if not (match := _TOKEN.fullmatch(token)):
            raise ScheduleError(f"bad action {token!r}: expected AR or <op><mb>.<chunk> with op in F B W SA RA SG RG")
        return cls(Op(match[1]), int(match[2]), int(match[3]))


def _peer(a: PipeAction) -> PipeAction:
    op, offset = _PEER[a.op]
    return _action(op, a.mb, a.chunk + offset)


@functools.lru_cache(maxsize=1 << 18)
def _action(op: Op, mb: int | None = None, chunk: int | None = None) -> PipeAction:
    """``PipeAction(op, mb, chunk)``, one object per value: a frozen dataclass is slow to make, and the search builds
    and simulates hundreds of schedules of thousands of actions each (equal actions are interchangeable)."""
    return PipeAction(op, mb, chunk)


@dataclass(frozen=True)
class Timeline:
    """When each rank ran its compute actions, from PipeSchedule.simulate."""

    makespan_s: float
    busy_s: list[float]  # compute time per rank
    spans: list[list[tuple[PipeAction, float, float]]]  # per rank: (F/B/W action, start_s, end_s)

    @property
    def bubble_fraction(self) -> float:
        """Idle time of the busiest rank over its busy time."""
        busiest = max(self.busy_s)
        return (self.makespan_s - busiest) / busiest


@dataclass(frozen=True)
class PipeSchedule:
    """A whole pipeline's schedule; build with a generator or parse(), check with validate()."""

    name: str  # generator kind, e.g. "1f1b"; one token so the string form parses back
    stages: int  # S, pipeline ranks
    chunks: int  # v, model chunks per rank
    micro_batches: int  # m
    ranks: tuple[tuple[PipeAction, ...], ...]  # one ordered action list per pipeline rank

    def __post_init__(self) -> None:
        if min(self.stages, self.chunks, self.micro_batches) < 1:
            raise ScheduleError(f"stages, chunks and micro_batches must be >= 1, got "
                                f"{self.stages}, {self.chunks}, {self.micro_batches}")
        if len(self.ranks) != self.stages:
            raise ScheduleError(f"{self.stages} stages need {self.stages} action lists, got {len(self.ranks)}")
        if not self.name or any(ch.isspace() for ch in self.name):
            raise ScheduleError(f"schedule name {self.name!r} must be one non-empty token")

    @property
    def v_shape(self) -> bool:
        """ZB-V's placement: rank r holds chunks r and 2S-1-r (the model goes down the ranks and back up), so
        chunks S-1 and S meet on the last rank and hand over without P2P. Every other schedule loops: chunk c
        on rank c % S."""
        return self.name == "zb-v"

    def rank_of(self, chunk: int) -> int:
        return chunk_rank(chunk, self.stages, self.v_shape)

    @functools.cached_property
    def split_backward(self) -> bool:
        """Whether each backward is split into B (input gradient) and W (weight gradients): a W action anywhere."""
        return any(a.op is Op.WEIGHT for acts in self.ranks for a in acts)

    def chunks_of(self, rank: int) -> list[int]:
        if self.v_shape:
            return [rank, 2 * self.stages - 1 - rank]
        return [rank + j * self.stages for j in range(self.chunks)]

    def __str__(self) -> str:
        head = f"pipeline {self.name} stages={self.stages} chunks={self.chunks} micro_batches={self.micro_batches}"
        return "\n".join([head] + [f"r{r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks)])

    @classmethod
    def parse(cls, text: str) -> PipeSchedule:
        lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not lines or not (head := _HEADER.fullmatch(lines[0][1])):
            raise ScheduleError("line 1: expected 'pipeline <name> stages=S chunks=v micro_batches=m'")
        ranks = []
        for r, (n, line) in enumerate(lines[1:]):
            label, _, body = line.partition(":")
            if label != f"r{r}":
                raise ScheduleError(f"line {n}: expected 'r{r}: <actions>', got {line[:20]!r}")
            try:
                ranks.append(tuple(PipeAction.parse(tok) for tok in body.split()))
            except ScheduleError as e:
                raise ScheduleError(f"line {n}: {e}") from None
        return cls(head[1], int(head[2]), int(head[3]), int(head[4]), tuple(ranks))

    def _must_precede(self, a: PipeAction) -> list[PipeAction]:
        """What must come earlier on a's rank: for a send, the compute whose result it ships; for a
        compute, each input (F(mb, c-1); F(mb, c) and B(mb, c+1)), or the receive that brings it
        from another rank. These orders are what make receives carry every data dependency."""
        if a.op in _SENDS:
            return [PipeAction(Op.FORWARD if a.op is Op.SEND_ACT else Op.BACKWARD, a.mb, a.chunk)]
        if a.op is Op.WEIGHT:
            return [PipeAction(Op.BACKWARD, a.mb, a.chunk)]
        if a.op not in (Op.FORWARD, Op.BACKWARD):
            return []
        own = [PipeAction(Op.FORWARD, a.mb, a.chunk)] if a.op is Op.BACKWARD else []
        if (recv := self._input_recv(a)) is not None:
            return own + [recv]
        producer = a.chunk + (-1 if a.op is Op.FORWARD else 1)  # on this rank: F(mb, c-1) / B(mb, c+1)
        return own + ([PipeAction(a.op, a.mb, producer)] if 0 <= producer < self.stages * self.chunks else [])

    def _check_structure(self) -> None:
        """Everything validate() checks except deadlock; simulate() relies on it."""
        n = self.stages * self.chunks
        seen: dict[PipeAction, tuple[int, int]] = {}  # action -> (rank, step)
        for r, actions in enumerate(self.ranks):
            if not actions or actions[-1].op is not Op.ALL_REDUCE:
                raise ScheduleError(f"rank {r}: the last action must be AR")
            for i, a in enumerate(actions):
                where = f"rank {r} step {i} ({a})"
                if a.op is Op.ALL_REDUCE:
                    if i != len(actions) - 1:
                        raise ScheduleError(f"{where}: AR must be the last action, once")
                    continue
                if a.mb is None or a.chunk is None or not (0 <= a.mb < self.micro_batches and 0 <= a.chunk < n):
                    raise ScheduleError(f"{where}: needs mb in 0..{self.micro_batches - 1} and chunk in 0..{n - 1}")
                if self.rank_of(a.chunk) != r:
                    raise ScheduleError(f"{where}: chunk {a.chunk} lives on rank {self.rank_of(a.chunk)}")
                if a in seen:
                    raise ScheduleError(f"{where}: repeats step {seen[a][1]} of that rank")
                if a.op in _PEER and (self.stages == 1 or not 0 <= _peer(a).chunk < n
                                      or self.rank_of(_peer(a).chunk) == r):
                    raise ScheduleError(f"{where}: has no peer chunk on another rank to exchange with")
                for need in self._must_precede(a):
                    if need not in seen:
                        raise ScheduleError(f"{where}: must come after {need}")
                seen[a] = (r, i)
        ops = COMPUTE if self.split_backward else (Op.FORWARD, Op.BACKWARD)
        for c, mb, op in product(range(n), range(self.micro_batches), ops):
            if PipeAction(op, mb, c) not in seen:
                raise ScheduleError(f"rank {self.rank_of(c)}: {PipeAction(op, mb, c)} is missing")
        for a, (r, i) in seen.items():
            if a.op in _PEER and (peer := _peer(a)) not in seen:
                raise ScheduleError(f"rank {r} step {i} ({a}): no matching {peer} on rank {self.rank_of(peer.chunk)}")

    @functools.cached_property
    def _homes(self) -> list[int]:
        """Each chunk's rank (``rank_of``)."""
        return [self.rank_of(c) for c in range(self.stages * self.chunks)]

    def _sender(self, op: Op, chunk: int) -> int | None:
        """The chunk whose send brings compute ``op`` of ``chunk`` its input from another rank (a forward's from the
        chunk below, a backward's from the one above), or None: none (the first forward, the last backward, a W)
        or one on its own rank (ZB-V's chunks S-1 and S hand over locally)."""
        other = chunk - 1 if op is Op.FORWARD else chunk + 1 if op is Op.BACKWARD else -1
        homes = self._homes
        return other if 0 <= other < len(homes) and homes[other] != homes[chunk] else None

    def _input_recv(self, a: PipeAction) -> PipeAction | None:
        """The receive that brings compute ``a``'s input from another rank, if any (``_sender``)."""
        if self._sender(a.op, a.chunk) is None:
            return None
        return _action(Op.RECV_ACT if a.op is Op.FORWARD else Op.RECV_GRAD, a.mb, a.chunk)

    def batched(self, rank: int) -> list[PipeAction | tuple[PipeAction, ...]]:
        """``rank``'s actions as the runtime runs them: each run of adjacent P2P actions one tuple
        (one batch_isend_irecv), computes and AR as they are."""
        out: list = []
        for a in self.ranks[rank]:
            if a.op in _PEER and out and isinstance(out[-1], tuple):
                out[-1] += (a,)
            else:
                out.append((a,) if a.op in _PEER else a)
        return out

    @functools.cached_property
    def _program(self) -> tuple[list[list[tuple]], int]:
        """(per rank, what ``_execute`` runs, in integers; how many sends): once per schedule, as every pipeline
        candidate of ``mc.autotune`` simulates one. (0, index in the rank's actions, phase, chunk, the send it reads
        or -1, action) for a compute (phase: 0 F, 1 B, 2 W), (1, index, send) for a send; receives and the boundary
        take no time."""
        ids: dict[tuple, int] = {}  # (op, mb, chunk) of a send -> its index
        phase = {op: k for k, op in enumerate(COMPUTE)}
        out = []
        for actions in self.ranks:
            mine = []
            for i, a in enumerate(actions):
                op, mb, c = a.op, a.mb, a.chunk
                if op in phase:  # (the send its input comes by, keyed without making the actions)
                    src = self._sender(op, c)
                    kind = Op.SEND_ACT if op is Op.FORWARD else Op.SEND_GRAD
                    send = -1 if src is None else ids.setdefault((kind, mb, src), len(ids))
                    mine.append((0, i, phase[op], c, send, a))
                elif op in _SENDS:
                    mine.append((1, i, ids.setdefault((op, mb, c), len(ids))))
            out.append(mine)
        return out, len(ids)

    def _execute(self, forward_s: Sequence[float], backward_s: Sequence[float], p2p_s: float,
                 weight_s: Sequence[float] = ()) -> Timeline:
        """Run the lists in the eager-send model, O(actions): a rank whose next compute reads a value
        not yet sent sleeps until the send is posted. Assumes _check_structure passed, so a compute's
        local inputs are done when its rank reaches it."""
        S, (program, sends) = self.stages, self._program
        pos, clock, busy = [0] * S, [0.0] * S, [0.0] * S
        spans: list[list[tuple[PipeAction, float, float]]] = [[] for _ in range(S)]
        posted: list[float | None] = [None] * sends  # send -> posted_s
        waiting: dict[int, int] = {}  # unposted send -> the rank blocked on it
        times = (forward_s, backward_s, weight_s)
        runnable = deque(range(S))
        while runnable:
            r = runnable.popleft()
            mine, at, now, work, out = program[r], pos[r], clock[r], busy[r], spans[r]
            while at < len(mine):
                item = mine[at]
                if item[0] == 0:
                    _, _, phase, chunk, send, a = item
                    if send >= 0:
                        if (sent := posted[send]) is None:
                            waiting[send] = r
                            break
                        now = max(now, sent + p2p_s)
                    start, now = now, now + times[phase][chunk]
                    work += now - start
                    out.append((a, start, now))
                else:
                    posted[item[2]] = now
                    if item[2] in waiting:
                        runnable.append(waiting.pop(item[2]))
                at += 1
            pos[r], clock[r], busy[r] = at, now, work
        if any(pos[r] < len(program[r]) for r in range(S)):
            raise ScheduleError("deadlock: " + self._describe_waits(
                [program[r][pos[r]][1] if pos[r] < len(program[r]) else len(self.ranks[r]) for r in range(S)]))
        return Timeline(max(clock), busy, spans)

    def _describe_waits(self, pos: list[int]) -> str:
        """Each blocked rank's wait-for chain: 'rank 1 at step 4 (F2.1) waits for SA2.0 from rank 0, which
        is at ...'. Only computes block, and the sender of each is blocked too (else it would have posted)."""
        at = {r: acts[i] for r, (acts, i) in enumerate(zip(self.ranks, pos)) if i < len(acts)}

        def waits(r: int) -> tuple[str, int]:
            send = _peer(self._input_recv(at[r]))
            return f"{send} from rank {self.rank_of(send.chunk)}", self.rank_of(send.chunk)

        chains, named = [], set()
        for r in at:
            if r in named:
                continue
            what, q = waits(r)
            text = f"rank {r} at step {pos[r]} ({at[r]}) waits for {what}"
            named.add(r)
            while q not in named:
                named.add(q)
                what, peer = waits(q)
                text, q = text + f", which is at step {pos[q]} ({at[q]}) waiting for {what}", peer
            chains.append(text)
        return "; ".join(chains)

    def check_nccl(self) -> None:
        """Raise ScheduleError if the runtime's batches would deadlock under NCCL's P2P rules (module
        docstring), naming each stuck rank, the step of its batch or compute, and what it waits for."""
        self._checked  # noqa: B018
        self._check_pair_order()
        if not (model := _NcclModel(self)).run():
            raise ScheduleError(f"NCCL deadlock: {model.describe()}")

    def _check_pair_order(self) -> None:
        """NCCL matches the sends and receives between two ranks in the order each posts them (it
        ignores tags): the k-th receive rank q posts from rank r must be for r's k-th send to q."""
        sent: dict[tuple[int, int], list[PipeAction]] = {}
        for r, actions in enumerate(self.ranks):
            for a in actions:
                if a.op in _SENDS:
                    sent.setdefault((r, self.rank_of(_peer(a).chunk)), []).append(a)
        taken: dict[tuple[int, int], int] = {}
        for q, actions in enumerate(self.ranks):
            for i, a in enumerate(actions):
                if a.op in _RECVS:
                    pair = (self.rank_of(_peer(a).chunk), q)
                    k = taken[pair] = taken.get(pair, -1) + 1
                    if (got := sent[pair][k]) != _peer(a):
                        raise ScheduleError(f"rank {q} step {i} ({a}) would receive {got} from rank {pair[0]}: "
                                            "NCCL matches two ranks' sends and receives in posting order, not by tag")

    def validate(self) -> None:
        """Raise ScheduleError naming the rank, step and action of the first problem found: malformed,
        or deadlocked with eager sends (gloo) or under NCCL's P2P rules."""
        self._check_structure()
        n = self.stages * self.chunks
        self._execute([1.0] * n, [1.0] * n, 0.0, [1.0] * n)
        self.check_nccl()

    def simulate(self, forward_s: Sequence[float], backward_s: Sequence[float], p2p_s: float = 0.0,
                 weight_s: Sequence[float] | None = None) -> Timeline:
        """Timeline for per-chunk compute times (len S*v each) and a fixed time per P2P hop. A split
        schedule's ``backward_s`` are its B (input-gradient) times and ``weight_s`` its W times (required)."""
        n = self.stages * self.chunks
        if len(forward_s) != n or len(backward_s) != n:
            raise InputError(f"need {n} forward and backward times (one per chunk), "
                             f"got {len(forward_s)} and {len(backward_s)}")
        if self.split_backward and (weight_s is None or len(weight_s) != n):
            raise InputError(f"a zero-bubble schedule needs {n} weight-gradient (W) times, one per chunk")
        self._checked  # noqa: B018 (once per schedule: it is immutable)
        return self._execute(forward_s, backward_s, p2p_s, weight_s or ())

    @functools.cached_property
    def _checked(self) -> bool:
        self._check_structure()
        return True

    def bubble_fraction(self, forward_s: float = 1.0, backward_s: float = 2.0) -> float:
        """Bubble with a uniform model: each of a rank's v chunks takes 1/v of its forward/backward (a split
        backward: half of it in B, half in W)."""
        n, v = self.stages * self.chunks, self.chunks
        if self.split_backward:
            return self.simulate([forward_s / v] * n, [backward_s / 2 / v] * n, 0.0, [backward_s / 2 / v] * n).bubble_fraction
        return self.simulate([forward_s / v] * n, [backward_s / v] * n).bubble_fraction

    @functools.cached_property
    def chunk_in_flight(self) -> list[int]:
        """Per chunk: the most micro-batches whose forward ran and backward did not (saved activations; cached:
        every pipeline candidate's memory reads it)."""
        most = [0] * (self.stages * self.chunks)
        for actions in self.ranks:
            live = [0] * len(most)
            for a in actions:
                if a.op is Op.FORWARD:
                    live[a.chunk] += 1
                    most[a.chunk] = max(most[a.chunk], live[a.chunk])
                elif a.op is Op.BACKWARD:
                    live[a.chunk] -= 1
        return most

    def max_in_flight(self) -> list[int]:
        """Per rank, the most micro-batch-chunks forwarded whose backward has not finished with them (their
        B, or where the backward is split their W: activation memory)."""
        done = Op.WEIGHT if self.split_backward else Op.BACKWARD
        return [max(accumulate(((a.op is Op.FORWARD) - (a.op is done) for a in acts), initial=0))
                for acts in self.ranks]

    def grid(self) -> str:
        """Step x rank picture with unit-time F, B and W and free P2P; '.' marks idle steps."""
        n = self.stages * self.chunks
        timeline = self.simulate([1.0] * n, [1.0] * n, 0.0, [1.0] * n)
        steps = round(timeline.makespan_s)
        cells = [["."] * steps for _ in self.ranks]
        for r, spans in enumerate(timeline.spans):
            for a, start, _ in spans:
                cells[r][round(start)] = f"{a.op.value}{a.mb}" if self.chunks == 1 else str(a)
        width = max(len(str(steps - 1)), *(len(cell) for row in cells for cell in row))
        label = max(len("step"), len(f"r{self.stages - 1}"))
        rows = [["step"] + [str(t) for t in range(steps)]] + [[f"r{r}"] + row for r, row in enumerate(cells)]
        return "\n".join(" ".join([row[0].ljust(label)] + [cell.ljust(width) for cell in row[1:]]).rstrip()
                         for row in rows)


def chunk_rank(chunk: int, stages: int, v_shape: bool) -> int:
    """The pipeline rank chunk ``chunk`` runs on: ``chunk % stages``, or in a V (ZB-V) down the ranks and back up."""
    return (chunk if chunk < stages else 2 * stages - 1 - chunk) if v_shape else chunk % stages


def _build(name: str, stages: int, micro_batches: int, chunks: int,
           order: Callable[[int], list[tuple[Op, int, int]]], nccl: bool = True,
           key: Callable[[int], object] | None = None) -> PipeSchedule:
    """Wrap each rank's (op, mb, chunk) compute order: receive right before, send right after, AR last
    (a W neither receives nor sends; a value between two chunks of one rank is handed over, not sent). ``nccl``:
    then receives posted as NCCL needs them (``_pair_order``, ``_nccl_order``); without, the schedule a timeline
    prices (``simulate`` reads the computes and the sends only: a receive takes no time where it is posted).
    ``key``: what rank r's order depends on besides the schedule's shape, where its wrapped actions may be
    shared with another schedule's (ZB-H1's deferrals: ``memory_neutral`` builds many that differ in a few ranks)."""
    ranks = []
    for r in range(stages):
        if key is None:
            ranks.append(_rank_actions(name, stages, chunks, order(r)))
            continue
        shared = (name, stages, micro_batches, chunks, r, key(r))
        if shared not in _RANKS:
            if len(_RANKS) > 16384:
                _RANKS.clear()
            _RANKS[shared] = _rank_actions(name, stages, chunks, order(r))
        ranks.append(_RANKS[shared])
    s = PipeSchedule(name, stages, chunks, micro_batches, tuple(ranks))
    if nccl:
        return _nccl_order(_pair_order(s))
    # (not checked again: its computes and sends, all a timeline reads, are those of the schedule the runtime
    # posts, which is; test_a_timeline_schedule_prices_as_the_one_the_runtime_posts)
    s.__dict__["_checked"] = True
    return s


_RANKS: dict[tuple, tuple[PipeAction, ...]] = {}
"""``_build``'s ranks shared by key."""


def _rank_actions(name: str, stages: int, chunks: int, order: list[tuple[Op, int, int]]) -> tuple[PipeAction, ...]:
    """One rank's ``order`` wrapped as ``_build`` wraps it."""
    n, v_shape = stages * chunks, name == "zb-v"

    def elsewhere(c: int, other: int) -> bool:
        return 0 <= other < n and chunk_rank(other, stages, v_shape) != chunk_rank(c, stages, v_shape)

    acts: list[PipeAction] = []
    for op, mb, c in order:
        if op is Op.WEIGHT:
            acts.append(_action(op, mb, c))
            continue
        fwd = op is Op.FORWARD
        if elsewhere(c, c - 1 if fwd else c + 1):
            acts.append(_action(Op.RECV_ACT if fwd else Op.RECV_GRAD, mb, c))
        acts.append(_action(op, mb, c))
        if elsewhere(c, c + 1 if fwd else c - 1):
            acts.append(_action(Op.SEND_ACT if fwd else Op.SEND_GRAD, mb, c))
    return (*acts, _action(Op.ALL_REDUCE))


def _pair_order(s: PipeSchedule) -> PipeSchedule:
    """Post receives earlier until each rank receives from each peer in the order the peer sends to it (NCCL
    matches two ranks' P2P ops in posting order, ignoring tags): where a rank would post the receive of a later
    send first, the receive of the earlier send moves right before it (posted earlier, it only holds its buffer
    longer). ZB-V needs it: a rank sends its neighbour activations and gradients of two chunks in one order."""
    sends: dict[tuple[int, int], list[PipeAction]] = {}
    for r, actions in enumerate(s.ranks):
        for a in actions:
            if a.op in _SENDS:
                sends.setdefault((r, s.rank_of(_peer(a).chunk)), []).append(a)
    ranks = []
    for q, actions in enumerate(s.ranks):
        acts, taken, i = list(actions), {}, 0
        while i < len(acts):
            a = acts[i]
            if a.op in _RECVS:
                r = s.rank_of(_peer(a).chunk)
                k = taken.get(r, 0)
                expected = _peer(sends[r, q][k])
                if expected != a:  # (it sits later in this rank's list: post it here, first)
                    acts.remove(expected)
                    acts.insert(i, expected)
                    a = expected
                taken[r] = k + 1
            i += 1
        ranks.append(tuple(acts))
    return replace(s, ranks=tuple(ranks))


class _NcclModel:
    """A schedule run under NCCL's rules (module docstring) as far as it goes. Batches are kept by
    index (one emptied by _nccl_order's edits stays, and is a no-op), so progress survives edits
    made after each rank's first unfinished batch: the model's end state does not depend on the
    order its events are taken in."""

    def __init__(self, s: PipeSchedule) -> None:
        self.schedule = s
        S = s.stages
        self.items: list[list] = [[] for _ in range(S)]  # per rank: computes, AR and batches (lists)
        self.batches: list[list[list[PipeAction]]] = [[] for _ in range(S)]
        self.home: dict[PipeAction, tuple[int, int]] = {}  # P2P action -> (rank, its batch)
        self.computes: list[list[list]] = [[] for _ in range(S)]  # per rank: [compute or AR, batch it waits for]
        self.before: list[list[int]] = [[] for _ in range(S)]  # per batch: computes ahead of it
        self.reader: dict[PipeAction, list] = {}  # receive -> the computes entry that waits for it
        for r in range(S):
            for a in s.batched(r):
                if isinstance(a, tuple):  # a batch, as the runtime posts it (editable here: a list)
                    self.before[r].append(len(self.computes[r]))
                    self.batches[r].append(list(a))
                    self.items[r].append(self.batches[r][-1])
                    self.home.update((p2p, (r, len(self.batches[r]) - 1)) for p2p in a)
                    continue
                recv = s._input_recv(a) if a.op is not Op.ALL_REDUCE else None
                entry = [a, -1 if recv is None else self.home[recv][1]]
                if recv is not None:
                    self.reader[recv] = entry
                self.computes[r].append(entry)
                self.items[r].append(a)
        for r in range(S):  # the runtime waits for every batch before the boundary
            self.computes[r][-1][1] = len(self.batches[r]) - 1
        self.done, self.started, self.finished = [0] * S, [0] * S, [0] * S

    def run(self) -> bool:
        """Advance until nothing can; whether every rank reached its end."""
        changed = True
        while changed:
            changed = False
            for r in range(self.schedule.stages):
                computes, batches = self.computes[r], self.batches[r]
                while self.done[r] < len(computes) and computes[self.done[r]][1] < self.finished[r]:
                    self.done[r] += 1
                    changed = True
                k = self.started[r]
                if k == self.finished[r] < len(batches) and self.done[r] >= self.before[r][k]:
                    self.started[r] += 1
                    changed = True
                if self.finished[r] < self.started[r] and all(
                        self.home[p][1] < self.started[self.home[p][0]] for p in map(_peer, batches[self.finished[r]])):
                    self.finished[r] += 1
                    changed = True
        return all(d == len(c) for d, c in zip(self.done, self.computes))

    def waiting(self) -> list[tuple[int, PipeAction]]:
        """(rank, receive) for each running batch's send whose receive sits in a later batch of its rank
        than the first unfinished one."""
        out = []
        for r in range(self.schedule.stages):
            k = self.finished[r]
            for a in self.batches[r][k] if k < self.started[r] else ():
                if a.op not in _SENDS:  # (a receive's late send cannot be posted earlier: its compute is not done)
                    continue
                q, j = self.home[recv := _peer(a)]
                if j > self.finished[q]:
                    out.append((q, recv))
        return out

    def post_earlier(self, q: int, recv: PipeAction) -> None:
        """Move ``recv`` into rank q's first unfinished batch."""
        f, (_, j) = self.finished[q], self.home[recv]
        self.batches[q][j].remove(recv)
        self.batches[q][f].append(recv)
        self.home[recv] = (q, f)
        self.reader[recv][1] = f

    def schedule_now(self) -> PipeSchedule:
        ranks = tuple(tuple(a for it in items for a in (it if isinstance(it, list) else (it,))) for items in self.items)
        return replace(self.schedule, ranks=ranks)

    def _step(self, r: int, item) -> int:
        i = 0
        for it in self.items[r]:
            if it is item:
                return i
            i += len(it) if isinstance(it, list) else 1
        raise InternalError(item)

    def _batch(self, r: int, k: int) -> str:
        b = self.batches[r][k]
        return f"rank {r} step {self._step(r, b)} [{' '.join(map(str, b))}]"

    def describe(self) -> str:
        """What each stuck rank waits for: its running batch's missing peers, or the batch its compute needs."""
        out = []
        for r in range(self.schedule.stages):
            k = self.finished[r]
            if k < self.started[r]:
                missing = [f"{p} in {self._batch(*self.home[p])}" for p in map(_peer, self.batches[r][k])
                           if self.home[p][1] >= self.started[self.home[p][0]]]
                out.append(f"{self._batch(r, k)} waits for " + " and ".join(missing))
            elif self.done[r] < len(self.computes[r]):
                a, need = self.computes[r][self.done[r]]
                if need >= k:
                    out.append(f"rank {r} step {self._step(r, a)} ({a}) waits for its batch {self._batch(r, need)}")
        return "; ".join(out)


def _nccl_order(s: PipeSchedule) -> PipeSchedule:
    """Post receives earlier until the schedule runs to its end under NCCL's rules: while a running
    batch waits for a receive its peer posts in a later batch, move that receive into the peer's
    first unfinished batch (a receive posted early only holds its buffer longer: the runtime waits
    for it right before the compute that reads it)."""
    model = _NcclModel(s)
    while not model.run():
        if not (moves := model.waiting()):
            raise ScheduleError(f"NCCL deadlock that posting receives earlier cannot fix: {model.describe()}")
        for q, recv in moves:
            model.post_earlier(q, recv)
    return model.schedule_now()


def gpipe(stages: int, micro_batches: int, nccl: bool = True) -> PipeSchedule:
    """All forwards, then all backwards in reverse: every rank holds m micro-batches of activations."""
    return _build("gpipe", stages, micro_batches, 1, lambda r: [(Op.FORWARD, mb, r) for mb in range(micro_batches)]
                  + [(Op.BACKWARD, mb, r) for mb in reversed(range(micro_batches))], nccl)


def one_f_one_b(stages: int, micro_batches: int, nccl: bool = True) -> PipeSchedule:
    """Synchronous 1F1B: rank r warms up with S-1-r forwards, alternates F and B, then drains."""
    return _interleaved("1f1b", stages, micro_batches, 1, nccl)


def interleaved_1f1b(stages: int, micro_batches: int, chunks: int, nccl: bool = True) -> PipeSchedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021) with v = chunks model chunks per rank.

    Forwards go depth first in groups of S micro-batches: a rank's k-th forward runs local chunk
    (k // S) % v of micro-batch (k // (S*v)) * S + k % S; its k-th backward runs local chunk
    v-1 - (k // S) % v of the same micro-batch. Rank r warms up with 2(S-1-r) + (v-1)S forwards
    (at most m*v), then alternates F and B, then drains. At v = 1 this is plain 1F1B with S-1-r
    warm-up forwards: Megatron defines its count only for v > 1, and 2(S-1-r) would keep more
    activations alive for the same bubble.
    """
    return _interleaved("interleaved", stages, micro_batches, chunks, nccl)


def _interleaved(name: str, stages: int, micro_batches: int, chunks: int, nccl: bool) -> PipeSchedule:
    """``interleaved_1f1b``'s schedule, named ``name`` (1F1B is its v = 1)."""
    S, v, total = stages, chunks, micro_batches * chunks
    check_schedule("interleaved", S, micro_batches, v)

    def order(r: int) -> list[tuple[Op, int, int]]:
        warmup = min(total, S - 1 - r if v == 1 else 2 * (S - 1 - r) + (v - 1) * S)
        steady = [x for i in range(total - warmup) for x in ((Op.FORWARD, warmup + i), (Op.BACKWARD, i))]
        drain = [(Op.BACKWARD, k) for k in range(total - warmup, total)]
        seq = [(Op.FORWARD, k) for k in range(warmup)] + steady + drain
        return [(op, (k // (S * v)) * S + k % S,
                 r + S * (v - 1 - (k // S) % v if op is Op.BACKWARD else (k // S) % v)) for op, k in seq]
    return _build(name, stages, micro_batches, chunks, order, nccl)


def zero_bubble(stages: int, micro_batches: int, chunks: int = 1, deferred: tuple[int, ...] | None = None,
                nccl: bool = True) -> PipeSchedule:
    """Zero-bubble pipelines (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): every backward split into
    B, the input gradient the previous stage waits for, and W, the weight gradients nothing waits for; a rank
    runs its F's and B's in (interleaved) 1F1B's order and defers its W's to fill the bubbles: after its r-th
    B, rank r runs the W of the B r places before each B; the W's left over close its list. At v = 1 this is
    ZB-H1: the last ranks' drain bubbles hold the deferred W's, and no rank holds more micro-batches than
    1F1B's first rank (S). At v > 1 it is an interleaved zero-bubble schedule: W deferred as
    torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble`` (the paper's ZB1P) defers them, on
    interleaved 1F1B's warm-up of 2(S-1-r) + (v-1)S forwards (ZB1P's (v-1)S + S-1-r makes two ranks post
    their sends and receives in orders NCCL cannot match, which it ignores tags to do). ``deferred``: per rank,
    how many W's it holds back at most (default r; 0 runs each W right after its B). A W neither sends nor
    receives, so any deferral is deadlock-free; ``cost_model.pipeline.memory_neutral`` picks ZB-H1's."""
    S, v = stages, chunks
    kind = "zb-h1" if v == 1 else "interleaved-zb"
    check_schedule(kind, S, micro_batches, v)
    if deferred is not None and (len(deferred) != S or min(deferred) < 0):
        raise ScheduleError(f"deferred needs one count >= 0 per rank ({S}), got {deferred}")
    held = (lambda r: r) if deferred is None else deferred.__getitem__
    return _build(kind, stages, micro_batches, chunks, lambda r: zero_bubble_order(S, micro_batches, v, r, held(r)), nccl,
                  key=held)


def zero_bubble_order(stages: int, micro_batches: int, chunks: int, rank: int, deferred: int) -> list[tuple[Op, int, int]]:
    """``zero_bubble``'s computes on ``rank`` as (op, mb, chunk), W's held back by ``deferred`` B's."""
    S, v, r, d = stages, chunks, rank, deferred
    total = micro_batches * chunks
    warmup = min(total, S - 1 - r if v == 1 else 2 * (S - 1 - r) + (v - 1) * S)  # (interleaved 1F1B's)
    seq = [(Op.FORWARD, k) for k in range(warmup)]
    for j in range(total):  # the j-th B, after its steady-state forward; the W of the (j - d)-th
        seq += ([(Op.FORWARD, warmup + j)] if warmup + j < total else []) + [(Op.BACKWARD, j)]
        seq += [(Op.WEIGHT, j - d)] if j >= d else []
    seq += [(Op.WEIGHT, j) for j in range(max(0, total - d), total)]
    return [(op, (k // (S * v)) * S + k % S,
             r + S * (v - 1 - (k // S) % v if op is not Op.FORWARD else (k // S) % v)) for op, k in seq]


def zb_v(stages: int, micro_batches: int, nccl: bool = True) -> PipeSchedule:
    """ZB-V (Qi et al. 2024, section 6; torch.distributed.pipelining's ``ScheduleZBVZeroBubble``): two chunks per
    rank in a V (``PipeSchedule.v_shape``), each backward split into B and W. Rank r warms up with 2(S-r)-1
    forwards of its first chunk, then r pairs of (second, first), then S-r rounds of its second chunk's
    F, B, W; in the steady state it runs F, B, W of its first chunk and then of its second; it drains with r
    pairs of B's, then S-r of (B, W) of the first chunk, then the W's left. The order is generated for
    max(m, 2S-1) micro-batches and the others dropped, as torch does."""
    S, m = stages, micro_batches
    check_schedule("zb-v", S, m, 2)
    n_micro = max(2 * S - 1, m)

    def order(r: int) -> list[tuple[Op, int, int]]:
        c0, c1 = r, 2 * S - 1 - r
        count = {(op, c): 0 for op in COMPUTE for c in (c0, c1)}
        seq: list[tuple[Op, int, int]] = []

        def run(*ops: tuple[Op, int]) -> None:
            for op, c in ops:
                seq.append((op, count[op, c], c))
                count[op, c] += 1

        f0, f1, b0, b1, w0, w1 = ((op, c) for op in COMPUTE for c in (c0, c1))
        for _ in range(2 * (S - r) - 1):
            run(f0)
        for _ in range(r):
            run(f1, f0)
        for _ in range(S - r):
            run(f1, b1, w1)
        while count[f1] < count[f0] or count[f0] < n_micro:
            run(*([f0] if count[f0] < n_micro else []), b0, w0, f1, b1, w1)
        for _ in range(r):
            run(b0, b1)
        for _ in range(S - r):
            run(b0, w0)
        for w, b in ((w1, b1), (w0, b0)):
            while count[w] < count[b]:
                run(w)
        return [(op, mb, c) for op, mb, c in seq if mb < m]
    return _build("zb-v", S, m, 2, order, nccl)

@functools.lru_cache(maxsize=256)
def make_schedule(kind: str, stages: int, micro_batches: int, chunks: int = 1,
                  deferred: tuple[int, ...] | None = None, nccl: bool = True) -> PipeSchedule:
    """The named schedule; the interleaved kinds take chunks > 1, the zero-bubble ones ``deferred``
    (``zero_bubble``; cached: schedules are immutable). ``nccl=False``: its receives right before their computes,
    not where NCCL needs them posted (``_build``): what pricing and memory read, the same timeline, built in a
    fraction of the time (``mc.autotune`` builds one per pipeline shape and ZB-H1 deferral)."""
    check_schedule(kind, stages, micro_batches, chunks)
    if kind == "interleaved":
        return interleaved_1f1b(stages, micro_batches, chunks, nccl)
    if kind == "zb-v":
        return zb_v(stages, micro_batches, nccl)
    if kind in ZERO_BUBBLE:
        return zero_bubble(stages, micro_batches, chunks, deferred, nccl)
    return (gpipe if kind == "gpipe" else one_f_one_b)(stages, micro_batches, nccl)
