"""The Dynamo frontend: ``torch.compile(loss, backend=mc.backend(plan, optimizer=...))``.

What is compiled is a callable whose result is the scalar loss of a batch: a function such as
``lambda x, y: loss_fn(model(x), y)``, or a module whose forward returns its loss. Each call of
the compiled callable is then one MiCS training step on this rank's local batch (forward,
backward, gradient sync, optimizer update of the sharded parameters), and returns the global mean
loss, as ``mc.compile``'s ``TrainStep`` does.

How: Dynamo captures the callable into one FX graph (torch-level ops, the model's parameters and
buffers as graph inputs) and hands it to ``MiCSBackend``, which checks it and returns a function
that, on its first call, builds the TrainStep with ``mc.compile`` from *that* graph: the model
given to the trace is a ``Replay`` of it (the user's parameters, buffers and submodules, so FQNs,
blocks and state-dict keys are the model's own) whose forward runs Dynamo's nodes one by one,
marking the module each came from (``nn_module_stack``) as module hooks would. The trace then
adds loss and backward, and the same pass pipeline follows.

Refused, with what to change, before any collective (never silently trained unsharded):

* a graph break: Dynamo would split the loss into several graphs and run the code between them
  eagerly, so no one graph holds forward, loss and backward to shard. The error names the
  break's source line and Dynamo's reason.
* a graph whose output is not one scalar; parameters of more than one root module; graph inputs
  that are neither the model's tensors nor the callable's arguments (or their sizes);
* ``Plan.micro_batches > 1`` with a graph Dynamo specialized to the whole batch: the step runs
  the graph once per micro-batch, so compile with ``dynamic=True`` (the replay then gives the
  graph's symbolic sizes the micro-batch's);
* a second graph for the same backend (a recompile: other batch shapes, a changed guard), which
  would start again from the model's untouched weights;
* ``torch._dynamo.config.suppress_errors`` (Dynamo would fall back to eager on any refusal);
* a module attribute Dynamo lifted into the graph (a float, with ``dynamic=True``) whose value
  changes between calls; ``pipeline_stages > 1`` (not yet: the loss must be pinned to the last
  stage).

``torch.compiler.set_stance("force_eager")`` or ``TORCHDYNAMO_DISABLE=1`` skip the backend
entirely: ``backend.step`` stays None.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.fx
from torch import nn

from micscompile.core.errors import Error, InputTypeError
from micscompile.core.plan import Plan
from micscompile.trace import MODULE_MARKS


class GraphBreakError(Error, RuntimeError):
    """Dynamo split the compiled callable at a graph break; the message names the source line."""


class CaptureError(Error, RuntimeError):
    """The graph Dynamo captured cannot be trained as one MiCS step; the message says why."""


def _where(frames) -> str:
    f = frames[-1] if frames else None
    return f"{f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`" if f else "<unknown location>"


def _refuse_suppressed_errors() -> None:
    """Under ``suppress_errors`` Dynamo runs a graph eagerly when its backend raises: a refusal would
    train nothing, silently."""
    import torch._dynamo.config as dynamo_config

    if dynamo_config.suppress_errors:
        raise CaptureError("torch._dynamo.config.suppress_errors is True: a refused graph would silently run "
                           "eagerly, unsharded; set it to False to compile with micscompile")


def _is_state(source: str) -> bool:
    """A parameter's or buffer's source ("...._parameters['weight']")."""
    return "._parameters[" in source or "._buffers[" in source


def _current_tx():
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx()


def check_no_graph_break(tx) -> None:
    """Refuse a graph Dynamo compiles because it hit a graph break (its reason and source line)."""
    reason = getattr(tx.output, "compile_subgraph_reason", None)
    if reason is not None and reason.graph_break:
        raise GraphBreakError(
            f"graph break at {_where(reason.user_stack)} (Dynamo: {(reason.reason.strip() or '?').splitlines()[0]}). "
            f"micscompile shards one graph holding the whole forward and loss; with a graph break the code "
            f"between the graphs would run eagerly and unsharded. Remove the break "
            f"(torch._dynamo.explain(fn)(*args) lists them; fullgraph=True stops at the first)")


_ROOT = re.compile(r"^(.*?)\._(?:modules|parameters|buffers)\[")


def _fqn(path: str, root: str) -> str:
    """ "L['self'].blocks.0.ln" or "L['self'].blocks[0]" -> "blocks.0.ln" / "blocks.0" below ``root``."""
    rest = path[len(root):] if path.startswith(root) else path
    rest = re.sub(r"\[(\d+)\]", r".\1", rest)
    rest = re.sub(r"\['([^']+)'\]", r".\1", rest)
    return rest.lstrip(".")


class Replay(nn.Module):
    """Dynamo's graph as a module: the root module's parameters, buffers and children (the same
    objects, so FQNs are the model's), and a forward that replays the graph's nodes on
    ``inputs`` (the callable's tensor arguments), returning the loss."""

    def __init__(self, gm: torch.fx.GraphModule, root: nn.Module, root_expr: str, slots: list,
                 dynamic_batch: list[bool]) -> None:
        super().__init__()
        self._modules.update(root._modules)
        self._parameters.update(root._parameters)
        self._buffers.update(root._buffers)
        self._non_persistent_buffers_set = set(root._non_persistent_buffers_set)
        self.__dict__["_graph"] = gm
        self.__dict__["_root_expr"] = root_expr
        self.__dict__["slots"] = slots
        """Per graph input: ("state", fqn), ("input", index into the call's tensors), ("const", a module
        attribute's value) or ("size", (index, "size" | "stride" | "storage_offset", dim or None))."""
        self.__dict__["dynamic_batch"] = dynamic_batch
        """Per input: whether Dynamo kept its batch dimension symbolic (it replays at any micro-batch size)."""

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        interpreter = _MarkingInterpreter(self._graph, self._root_expr)
        loss = interpreter.run(*(self._arg(kind, ref, inputs) for kind, ref in self.slots))[0]
        interpreter.leave_all()  # not on an exception: the trace's error names the module that failed
        return loss

    def _arg(self, kind: str, ref, inputs: tuple[torch.Tensor, ...]):
        if kind == "state":  # the traced stand-in while the trace runs
            owner, _, name = ref.rpartition(".")
            return getattr(self.get_submodule(owner), name)
        if kind == "input":
            return inputs[ref]
        if kind == "const":
            return ref
        index, what, dim = ref
        value = getattr(inputs[index], what)()
        return value if dim is None else value[dim]


class _MarkingInterpreter(torch.fx.Interpreter):
    """Runs Dynamo's nodes, telling the trace in progress which module each one came from."""

    def __init__(self, gm: torch.fx.GraphModule, root_expr: str) -> None:
        super().__init__(gm)
        self.root_expr = root_expr
        self.stack: list[str] = []

    def run_node(self, n: torch.fx.Node):
        if MODULE_MARKS and n.op not in ("placeholder", "output"):
            enter, leave = MODULE_MARKS[-1]
            want = [_fqn(path, self.root_expr) for path, _ in (n.meta.get("nn_module_stack") or {}).values()]
            keep = 0
            while keep < min(len(want), len(self.stack)) and want[keep] == self.stack[keep]:
                keep += 1
            while len(self.stack) > keep:
                self.stack.pop()
                leave()
            for fqn in want[keep:]:
                self.stack.append(fqn)
                enter(fqn)
        return super().run_node(n)

    def leave_all(self) -> None:
        while self.stack and MODULE_MARKS:
            self.stack.pop()
            MODULE_MARKS[-1][1]()


_SIZE = re.compile(r"^(.*)\.(size\(\)|stride\(\)|storage_offset\(\))(?:\[(\d+)\])?$")
"""A dynamic size of an input: "L['x'].size()[0]", "L['x'].stride()[1]", "L['x'].storage_offset()"."""


def _source(n: torch.fx.Node) -> str:
    ga = n.meta.get("grapharg")
    name = ga.source.name if ga is not None else n.name
    return name() if callable(name) else name


def _dynamic_batches(vals: list) -> list[bool]:
    """Per input: whether its batch dimension is a symbol of its own, which the replay may set to the
    micro-batch size. Not when Dynamo specialized it, nor when duck sizing gave another dimension
    (of any input) the same symbol: setting it would change that dimension too."""
    def symbols(size) -> set:
        return set(size.node.expr.free_symbols) if isinstance(size, torch.SymInt) else set()

    others = set().union(*(symbols(d) for v in vals if isinstance(v, torch.Tensor) for d in v.shape[1:]))
    return [isinstance(v, torch.Tensor) and v.dim() > 0 and isinstance(v.shape[0], torch.SymInt)
            and v.shape[0].node.expr.is_Symbol and not symbols(v.shape[0]) & others for v in vals]


def _capture(gm: torch.fx.GraphModule, example_inputs: list, tx) -> tuple[Replay, list[int]]:
    """The Replay of ``gm`` and the positions of the callable's tensors among the graph inputs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sources = [_source(n) for n in placeholders]
    roots = list(dict.fromkeys(m.group(1) for name in sources if _is_state(name) for m in [_ROOT.match(name)] if m))
    if len(roots) > 1:
        raise CaptureError(f"the graph reads parameters of {len(roots)} modules ({', '.join(roots)}): put them "
                           f"in one nn.Module (e.g. the loss's parameters in the model)")
    if not roots:
        raise CaptureError("the graph reads no parameters: nothing to train")
    root = eval(roots[0], {"L": tx.f_locals, "G": tx.f_globals})  # noqa: S307 - Dynamo's own source text
    state: dict[int, str] = {}
    for name, t in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        state.setdefault(id(t), name)  # a tied weight by its first name, as the trace does
    inputs = [src for src, ex in zip(sources, example_inputs) if isinstance(ex, torch.Tensor) and id(ex) not in state
              and src.startswith("L[") and "._" not in src and "." not in src.split("]", 1)[1]]
    slots, batch = [], []
    for ex, src in zip(example_inputs, sources):
        size = _SIZE.match(src)
        if isinstance(ex, torch.Tensor) and id(ex) in state:
            slots.append(("state", state[id(ex)]))
        elif src in inputs:
            slots.append(("input", inputs.index(src)))
            batch.append(len(slots) - 1)
        elif src.startswith(roots[0]) and not _is_state(src):
            slots.append(("const", ex))  # a module attribute Dynamo lifted (dynamic=True lifts floats)
        elif size and size.group(1) in inputs:  # a dynamic size: the micro-batch's, at the replay
            dim = None if size.group(3) is None else int(size.group(3))
            slots.append(("size", (inputs.index(size.group(1)), size.group(2)[:-2], dim)))
        else:
            raise CaptureError(f"graph input {src} ({type(ex).__name__}) is neither a parameter or buffer of the "
                               f"model, nor an argument of the compiled callable or one of its sizes; make it a "
                               f"buffer of the model")
    dynamic = _dynamic_batches([n.meta.get("example_value") for n, (kind, _) in zip(placeholders, slots)
                                if kind == "input"])
    return Replay(gm, root, roots[0], slots, dynamic), batch


class MiCSBackend:
    """A ``torch.compile`` backend that turns the captured loss into one MiCS training step per call.

    After the first call, ``.step`` is the ``TrainStep`` (its Program, ``state_dict()``,
    ``full_state_dict()``, ``comm_stats()``, ``codegen`` ...)."""

    def __init__(self, plan: Plan, optimizer: Callable, **compile_kwargs) -> None:
        _refuse_suppressed_errors()
        if not isinstance(plan, Plan):
            raise InputTypeError(f"plan must be a micscompile.Plan, got {type(plan).__name__}")
        if plan.pipeline_stages > 1:
            raise CaptureError("mc.backend compiles pipeline_stages=1 plans for now: Dynamo's graph holds the loss, "
                               "which the pipeline split must pin to the last stage; use mc.compile for MiCS-Pipe")
        self.plan = plan
        self.optimizer = optimizer
        self.compile_kwargs = compile_kwargs
        self.graphs: list[torch.fx.GraphModule] = []
        """The graphs Dynamo handed over (one, once it compiled)."""
        self.step = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list):
        _refuse_suppressed_errors()  # again: it may have been set after the backend was made
        tx = _current_tx()
        check_no_graph_break(tx)
        if self.graphs:
            raise CaptureError(
                f"Dynamo compiled this callable a second time ({tx.f_code.co_name}; other batch shapes or a changed "
                f"guard): micscompile trains one graph per backend, and a new one would start from the model's "
                f"original weights. Keep the batch shapes fixed (e.g. drop_last=True), or create one "
                f"mc.backend per shape")
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        vals = [o.meta.get("example_value") for o in outputs] if isinstance(outputs, tuple | list) else []
        if len(vals) != 1 or not isinstance(vals[0], torch.Tensor) or vals[0].numel() != 1:
            raise CaptureError(f"the compiled callable must return the scalar loss of the batch; its graph "
                               f"({tx.f_code.co_name} at {tx.f_code.co_filename}) returns "
                               f"{[tuple(v.shape) if isinstance(v, torch.Tensor) else v for v in vals]}")
        replay, batch = _capture(gm, example_inputs, tx)
        self.graphs.append(gm)
        return self._runner(replay, batch)

    def _runner(self, replay: Replay, batch: list[int]):
        from micscompile.runtime.compile import compile as mc_compile

        consts = [(i, ref) for i, (kind, ref) in enumerate(replay.slots) if kind == "const"]

        def run(*args):
            inputs = [args[i] for i in batch]
            for i, captured in consts:  # Dynamo passes them in without guarding on their value
                if not torch.equal(torch.as_tensor(args[i]), torch.as_tensor(captured)):
                    raise CaptureError(f"a module attribute Dynamo passed into the graph changed from {captured} to "
                                       f"{args[i]}: the compiled step uses the value it was compiled with")
            if self.step is None and self.plan.micro_batches > 1 and not all(replay.dynamic_batch):
                raise CaptureError(
                    f"Plan.micro_batches={self.plan.micro_batches} splits each call's batch of "
                    f"{inputs[0].shape[0] if inputs[0].dim() else 1} into micro-batches, but Dynamo specialized its "
                    f"graph to the whole batch (or gave the batch size's symbol to another dimension too): compile "
                    f"with torch.compile(..., dynamic=True) so that micscompile can replay it at the micro-batch "
                    f"size (if another dimension equals the batch, mark only the batch dynamic: "
                    f"torch._dynamo.mark_dynamic(x, 0) for every input)")
            if self.step is None:
                self.step = mc_compile(replay, self.plan, loss_fn=_identity, optimizer=self.optimizer,
                                       example_inputs=inputs, num_model_inputs=len(inputs), **self.compile_kwargs)
            return (self.step(*inputs),)

        return run


def _identity(loss: torch.Tensor) -> torch.Tensor:
    return loss


def backend(plan: Plan, *, optimizer: Callable, **compile_kwargs) -> MiCSBackend:
    """A ``torch.compile`` backend: ``torch.compile(loss, backend=mc.backend(plan, optimizer=...))``.

    ``loss`` (a function, or a module whose forward returns the loss) computes the scalar mean loss
    of a batch; each call of the compiled callable trains one step on this rank's local batch and
    returns the global mean loss. ``compile_kwargs`` go to ``mc.compile`` (``cluster``,
    ``prefetch``, ``timeout``, ...). See ``micscompile.dynamo`` for what is refused."""
    return MiCSBackend(plan, optimizer, **compile_kwargs)
