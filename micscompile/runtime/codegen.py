"""Inductor codegen (``Plan.codegen="inductor"``): the compute between communication points
runs as kernels Inductor generated (C++ on CPU, Triton on GPU).

Terms:

* A *communication point* is every node of the step's graph that is not an ATen op: the
  collectives' issues and waits, the unpacks of a gathered bucket, releases, gradient packs,
  offloads, placeholders and the output. The Program put them where they are; this pass never
  moves one.
* A *region* is a maximal run of consecutive ATen nodes between two communication points (the
  ``getitem``s of a multi-output op first move right after it). A region that only takes views
  (nothing to compute) stays as it is; every other one becomes one call of a compiled function.
* A region's *key* is its ops, their constant arguments and how they connect, and the shape,
  stride and dtype of its inputs: the same layer at another depth has the same key. Regions with
  one key share one compile (``compile_regions``' ``cache``).

Memory: Inductor allocates each region's outputs and temporaries itself, so with
``codegen="inductor"`` the arena keeps the collectives' buffers (gathered parameters, gradient
buckets, shards) and the ops' ``out=`` rewrite (``passes.out_variants``) does not run; what the
regions allocate is counted outside the arena (``step.memory_stats()``).

Invariants: the order of the communication points is unchanged; every ATen node ends up in
exactly one region; a compiled region reads only values computed before it and its outputs are
what later nodes read.
"""

from __future__ import annotations

import hashlib
import operator
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from micscompile.core.collectives import fmt_bytes
from micscompile.core.errors import Error
from micscompile.core.program import Action, Kind
from micscompile.cost_model.node_cost import _is_view, node_work
from micscompile.cost_model.simulator import compute_time_s
from micscompile.trace import META_BYTES, META_FQN, META_REGION, copy_node


class CodegenError(Error, RuntimeError):
    """Inductor could not compile a region; the message names the region and its ops."""


@dataclass
class Region:
    """One run of ATen nodes between communication points, as compiled (or left eager)."""

    index: int
    graph_name: str
    """Which graph it is in ("step", or a pipeline chunk's "chunk 1 forward")."""
    ops: int
    """Nodes in the run (views included)."""
    first: str
    last: str
    key: str
    inputs: int
    outputs: int
    compiled: bool
    """False: only views, run as they were."""
    reused_from: int | None = None
    """The region whose compiled function this one calls (same key), or None if compiled here."""
    compile_s: float = 0.0
    """Seconds Inductor took for this region (0 when reused or eager)."""
    output_bytes: int = 0
    """Bytes of the outputs Inductor allocates for later nodes (its temporaries die inside the call)."""
    cache_hit: bool = False
    """Inductor's FX graph cache (on disk, shared by the ranks of a host and by later runs) had it."""

    def status(self) -> str:
        if not self.compiled:
            return "eager (nothing read after it)" if self.outputs == 0 else "eager (views only)"
        if self.reused_from is not None:
            return f"reuses #{self.reused_from}"
        return f"compiled {self.compile_s * 1e3:.0f} ms" + (" (Inductor cache hit)" if self.cache_hit else "")


@dataclass
class CodegenReport:
    """Every region of a step's graphs, printable as a table: ``print(step.codegen)``."""

    regions: list[Region]

    @property
    def compiled(self) -> list[Region]:
        return [r for r in self.regions if r.compiled and r.reused_from is None]

    @property
    def compile_s(self) -> float:
        return sum(r.compile_s for r in self.regions)

    @property
    def inductor_output_bytes(self) -> int:
        """Bytes of the region outputs Inductor allocates per micro-batch (outside the arena)."""
        return sum(r.output_bytes for r in self.regions if r.compiled)

    def __str__(self) -> str:
        n_calls = sum(r.compiled for r in self.regions)
        head = (f"Inductor codegen: {len(self.regions)} regions, {n_calls} run compiled, {len(self.compiled)} "
                f"distinct compiles in {self.compile_s:.2f} s.\nBuffers: the arena holds the collectives' "
                f"(gathered parameters, gradient buckets); Inductor allocates the regions' outputs "
                f"({fmt_bytes(self.inductor_output_bytes)} per micro-batch) and temporaries")
        rows = [f"{'#':>4}  {'graph':<20} {'ops':>4} {'in':>3} {'out':>3} {'out bytes':>10}  {'first .. last':<40} "
                f"status"]
        for r in self.regions:
            span = f"{r.first} .. {r.last}" if r.first != r.last else r.first
            rows.append(f"{r.index:>4}  {r.graph_name:<20} {r.ops:>4} {r.inputs:>3} {r.outputs:>3} "
                        f"{fmt_bytes(r.output_bytes):>10}  {span[:40]:<40} {r.status()}")
        return "\n".join([head, *rows])


def _is_compute(node: torch.fx.Node) -> bool:
    """An ATen op (or a getitem of one): other namespaces (collectives, custom ops) bound regions."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _is_compute(node.args[0])
    if _read_whole(node) or any(_read_whole(i) for i in node.all_input_nodes):
        return False  # (an op whose outputs are read as one tuple, and its reader: a region's values are tensors)
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "aten"


def _read_whole(node: torch.fx.Node) -> bool:
    """Whether a multi-output op's tuple is read whole by some user (not through getitems)."""
    return isinstance(node.meta.get("val"), (tuple, list)) and any(u.target is not operator.getitem
                                                                     for u in node.users)


def _gather_getitems(graph: torch.fx.Graph) -> None:
    """Move the getitems of every multi-output ATen op right after it (they only pick an output), so
    that a communication point between an op and its getitems does not split them."""
    for node in list(graph.nodes):
        if _is_compute(node) and node.target is not operator.getitem:
            at = node
            for user in sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1]):
                at.append(user)
                at = user


def find_regions(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    """The maximal runs of consecutive ATen nodes (pure analysis once getitems sit by their producer)."""
    runs: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    for node in graph.nodes:
        if _is_compute(node):
            current.append(node)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def _boundary(run: list[torch.fx.Node]) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(inputs, outputs) of a run: the values it reads from before it, those read after it."""
    inside = set(run)
    inputs: dict[torch.fx.Node, None] = {}
    for n in run:
        for i in n.all_input_nodes:
            if i not in inside:
                inputs.setdefault(i)
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    return list(inputs), outputs


def _spec(node: torch.fx.Node) -> tuple:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise CodegenError(f"{node.name} ({node.op} {getattr(node.target, '__name__', node.target)}) feeds a "
                           f"compiled region but carries no tensor metadata (node.meta['val'])")
    return tuple(val.shape), tuple(val.stride()), val.dtype


def _key(run: list[torch.fx.Node], inputs: list[torch.fx.Node], specs: list[tuple], outputs: list[torch.fx.Node]) -> str:
    """A name-free description of the region (``specs``: its inputs' ``_spec``): equal keys compute the
    same function of inputs alike."""
    local = {n: f"i{k}" for k, n in enumerate(inputs)}
    local.update({n: f"n{k}" for k, n in enumerate(run)})

    def arg(a):
        return torch.fx.node.map_arg(a, lambda n: local[n])

    parts = [repr(specs)]
    parts += [f"{local[n]}={n.target}({arg(n.args)!r},{arg(n.kwargs)!r})" for n in run]
    parts.append(repr([local[o] for o in outputs]))
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


def _subgraph(run: list[torch.fx.Node], inputs: list[torch.fx.Node], outputs: list[torch.fx.Node]) -> torch.fx.Graph:
    g = torch.fx.Graph()
    env = {}
    for i in inputs:
        env[i] = g.placeholder(i.name)
        env[i].meta = dict(i.meta)
    for n in run:
        env[n] = copy_node(g, n, env.__getitem__)
    g.output(tuple(env[o] for o in outputs))
    return g


class CompiledRegion(nn.Module):
    """Calls one Inductor-compiled region function (shared by every region with its key).

    The function was compiled for the strides and dtypes the trace recorded, and its generated code
    asserts the strides and reads the bytes as those dtypes. An input that arrives otherwise is copied
    into them first: a sliced batch (the trace's inputs are contiguous), a receive buffer or a reloaded
    activation (contiguous where the trace's value was not), or a value whose dtype the device's kernel
    chose apart from the meta kernel the trace ran: the CPU's ``native_layer_norm`` keeps a bf16 input's
    dtype for its mean and rstd, where the meta kernel (and CUDA's) gives float32, and a region compiled
    for float32 statistics read bf16 ones as garbage (why Inductor once ran fp32 plans only)."""

    def __init__(self, fn: Callable, key: str, source: torch.fx.GraphModule, specs: list[tuple]) -> None:
        super().__init__()
        self.fn = fn
        self.key = key
        self.specs = specs
        self.__dict__["source"] = source  # the region's ATen graph, as compiled (not a submodule)

    def forward(self, *args):
        if any(a.stride() != s or a.dtype != d for a, (_, s, d) in zip(args, self.specs)):
            args = [a if a.stride() == s and a.dtype == d else
                    torch.empty_strided(a.shape, s, dtype=d, device=a.device).copy_(a)
                    for a, (_, s, d) in zip(args, self.specs)]
        return self.fn(*args)


def _fake_inputs(specs: list[tuple], device: torch.device) -> list[torch.Tensor]:
    """Fake tensors shaped like the region's inputs (``specs``: their ``_spec``) (static sizes; the ShapeEnv lets
    Inductor's FX graph cache serve a region compiled before, by this process or another)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv()):
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in specs]


def inductor_options() -> dict:
    """Inductor config for region compiles: one compile thread unless TORCHINDUCTOR_COMPILE_THREADS says
    otherwise (regions are small and every rank compiles its own: a worker pool per rank costs more
    than it saves on a shared host); never Inductor's own CUDA graphs (``TORCHINDUCTOR_CUDAGRAPHS=1``,
    "reduce-overhead"): a region would record and replay its graphs inside the step's capture
    (``Plan.cuda_graph``), which nothing in Inductor checks for."""
    threads = {} if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ else {"compile_threads": 1}
    return {**threads, "triton.cudagraphs": False}


def compile_regions(
    gm: torch.fx.GraphModule, device: torch.device, *, graph_name: str = "step",
    cache: dict[str, tuple[CompiledRegion, int]] | None = None, first_index: int = 0,
) -> list[Region]:
    """Rewrite ``gm`` in place: every region with something to compute becomes one call of an
    Inductor-compiled function (a submodule ``region_<i>``). ``cache`` (key -> (module, region
    index)) is shared across the graphs of one step, so identical regions compile once."""
    from torch._dynamo.utils import counters
    from torch._inductor import compile as inductor_compile

    cache = {} if cache is None else cache
    graph = gm.graph
    _gather_getitems(graph)
    regions: list[Region] = []
    for k, run in enumerate(find_regions(graph)):
        index = first_index + k
        inputs, outputs = _boundary(run)
        compiled = any(not _is_view(n) for n in run) and bool(outputs)
        specs = [_spec(i) for i in inputs] if compiled else []
        key = _key(run, inputs, specs, outputs) if compiled else ""
        region = Region(index, graph_name, len(run), run[0].name, run[-1].name, key, len(inputs), len(outputs),
                        compiled, output_bytes=sum(o.meta.get(META_BYTES) or 0 for o in outputs))
        regions.append(region)
        if not compiled:
            continue
        if key in cache:
            module, region.reused_from = cache[key]
        else:
            sub = torch.fx.GraphModule(gm, _subgraph(run, inputs, outputs))
            start = time.perf_counter()
            hits = counters["inductor"]["fxgraph_cache_hit"]
            try:
                fn = inductor_compile(sub, _fake_inputs(specs, device), inductor_options())
            except Exception as exc:
                ops = sorted({str(n.target) for n in run if n.target is not operator.getitem})
                raise CodegenError(f"Inductor failed on region #{index} of {graph_name} ({run[0].name} .. "
                                   f"{run[-1].name}; ops {', '.join(ops)}): {type(exc).__name__}: {exc}") from exc
            region.compile_s = time.perf_counter() - start
            region.cache_hit = counters["inductor"]["fxgraph_cache_hit"] > hits
            module = CompiledRegion(fn, key, sub, specs)
            cache[key] = (module, index)
        name = f"region_{index}"
        gm.add_submodule(name, module)
        with graph.inserting_before(run[0]):
            call = graph.call_module(name, tuple(inputs))
            call.meta = {k: run[0].meta[k] for k in (META_REGION, META_FQN) if k in run[0].meta}
            for j, out in enumerate(outputs):
                got = graph.call_function(operator.getitem, (call, j))
                got.meta = dict(out.meta)
                out.replace_all_uses_with(got)
        for n in reversed(run):
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return regions


# ---- Plan.codegen="auto": eager or Inductor, by the cost model -----------------------------------

COMPILE_S_PER_OP = 14.6 / 136
"""Inductor's compile time per op compiled, cold cache: 14.6 s for the 136 ops (4 regions) of
bench_peers' GPT (4 x 256) at p=1 on this project's 2-core CPU machine (docs/performance.md)."""
AMORTIZED_STEPS = 10_000
"""The steps a compile must pay back over (a training run's order of magnitude)."""
MIN_GAIN = 0.05
"""Below this predicted gain per step the choice would sit inside measurement noise: eager."""


@dataclass(frozen=True)
class CodegenChoice:
    """What ``Plan.codegen="auto"`` chose and why (``step.codegen_choice``)."""

    codegen: str
    reason: str
    eager_s: float | None = None
    """Predicted compute per micro-step, op by op."""
    inductor_s: float | None = None
    """Predicted compute per micro-step with fused elementwise runs."""
    compile_s: float | None = None
    captured: bool = False
    """Priced as a step replayed in a CUDA graph (``Plan.cuda_graph`` as resolved before lowering): each op at the
    device's cost per replayed kernel (``GpuSpec.graph_op_overhead_s``), not its dispatch from the host."""

    def __str__(self) -> str:
        return f"codegen: {self.codegen} (auto: {self.reason})"


def _fused_estimate(graph: torch.fx.Graph, gpu, dtype: str) -> tuple[float, float, int]:
    """(eager, fused seconds per micro-step, ops to compile) of a traced graph on ``gpu``: eager pays
    every op's dispatch and bytes; Inductor runs each maximal run of non-matmul ops inside one
    (phase, block) segment as one kernel that reads the run's inputs and writes its outputs once, and
    the matmul-class ops as they are. Blocks of one stack (``layers.3``, ``layers.7``) compile once."""
    def seconds(matmul_flops: float = 0, mem_bytes: float = 0, ops: int = 0) -> float:
        return compute_time_s(Action(Kind.COMPUTE, ops=ops, matmul_flops=matmul_flops, mem_bytes=mem_bytes), gpu, dtype)

    eager = fused = 0.0
    first: dict[tuple[str, str], str] = {}  # (phase, module pattern) -> the first module of that pattern
    to_compile = 0  # the ops of those first modules: the others reuse their compiled regions
    run: list[torch.fx.Node] = []

    def close() -> None:
        nonlocal fused
        if run:
            inputs, outputs = _boundary(run)
            moved = sum(n.meta.get(META_BYTES, 0) for n in (*inputs, *outputs))
            fused += seconds(mem_bytes=moved, ops=1)
            run.clear()

    segment = None
    for node in graph.nodes:
        if node.op != "call_function" or _is_view(node):
            continue
        work = node_work(node)
        eager += seconds(work.matmul_flops, work.mem_bytes, work.ops)
        fqn = node.meta.get(META_FQN, "")
        key = (node.meta.get(META_REGION, ""), re.sub(r"\.\d+(?=\.|$)", ".*", fqn))
        if key != segment:
            close()
            segment = key
        to_compile += first.setdefault(key, fqn) == fqn
        if work.matmul_flops:  # a matmul-class op: its own kernel, as eager
            close()
            fused += seconds(work.matmul_flops, 0, 1)
        else:
            run.append(node)
    close()
    return eager, fused, to_compile


def choose_codegen(tg, rp, cluster, captured: bool = False) -> CodegenChoice:
    """``Plan.codegen="auto"``: Inductor when the cost model predicts its compute per step at least
    ``MIN_GAIN`` faster and the time saved over ``AMORTIZED_STEPS`` steps pays for its compile; else
    eager. Without a cluster there is nothing to price it on. ``captured``: the
    step will replay as a CUDA graph, so both are priced at the device's cost per replayed kernel
    (``GpuSpec.replayed``), where an op dispatched from the host costs ``op_overhead_s``."""
    plan = rp.plan
    if cluster is None:
        return CodegenChoice("eager", "no cluster to price Inductor on", captured=captured)
    dtype = str(plan.param_dtype).removeprefix("torch.")
    gpu = cluster.gpu.replayed() if captured else cluster.gpu
    eager, fused, ops = _fused_estimate(tg.gm.graph, gpu, dtype)
    compile_s = ops * COMPILE_S_PER_OP
    saved = (eager - fused) * plan.micro_batches
    gain = eager / fused if fused > 0 else 1.0
    chosen = "inductor" if gain >= 1 + MIN_GAIN and saved * AMORTIZED_STEPS >= compile_s else "eager"
    how = "replayed in a CUDA graph" if captured else "dispatched"
    why = (f"predicted {eager * 1e3:.3f} ms of compute per micro-step op by op, {fused * 1e3:.3f} ms fused "
           f"({gain:.2f}x) on {cluster.name}, each op {how} at {gpu.op_overhead_s * 1e6:.1f} us; "
           f"{saved * AMORTIZED_STEPS:.0f} s saved over {AMORTIZED_STEPS} steps against ~{compile_s:.0f} s of compiling")
    return CodegenChoice(chosen, why, eager, fused, compile_s, captured)
