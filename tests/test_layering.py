"""The layering rule (docs/design.md#layering), read from the source: a module imports only
modules of its own layer or of layers below it. Every import counts, a lazy one inside a
function or under ``TYPE_CHECKING`` too: none may hide a back-edge."""

import ast
import builtins
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "micscompile"
DESIGN = PACKAGE.parent / "docs/design.md#layering".partition("#")[0]

LAYERS = (
    ("errors", ("micscompile.core.errors",)),
    ("zoo", ("micscompile.zoo",)),
    ("core", ("micscompile.core",)),
    ("cost_model", ("micscompile.cost_model",)),
    ("frontend", ("micscompile.trace",)),
    ("passes", ("micscompile.passes",)),
    ("memory", ("micscompile.memory",)),
    ("lowering", ("micscompile.lowering",)),
    ("runtime", ("micscompile.runtime",)),
    ("tune", ("micscompile.tune",)),
    ("api", ("micscompile", "micscompile.__main__", "micscompile.ir", "micscompile.dynamo", "micscompile.cli")),
)
"""Lowest first. ``micscompile`` alone is the package's ``__init__`` (the public API)."""


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer of the longest prefix naming ``module``."""
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact_only = p == "micscompile"
            if (module == p or (not exact_only and module.startswith(p + "."))) and len(p) > best:
                best, found = len(p), i
    if found is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS and docs/design.md#layering")
    return found


def imports_of(path: Path, root: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, module) for every micscompile module ``path`` imports, resolved to the deepest
    module that exists (``from micscompile.core import program`` -> ``micscompile.core.program``)."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                exists = (root.parent / (sub.replace(".", "/") + ".py")).exists() or \
                    (root.parent / sub.replace(".", "/")).is_dir()
                out.append((node.lineno, sub if exists else base))
    return [(line, m) for line, m in out if m == "micscompile" or m.startswith("micscompile.")]


def back_edges(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        mine = layer_of(module)
        for line, target in sorted(set(imports_of(path, root))):
            theirs = layer_of(target)
            if theirs > mine:
                found.append(f"{path.relative_to(root.parent)}:{line}: {module} ({LAYERS[mine][0]}) imports "
                             f"{target} ({LAYERS[theirs][0]}), a higher layer")
    return found


def test_no_module_imports_a_higher_layer():
    edges = back_edges()
    assert not edges, "layering (docs/design.md#layering) broken:\n" + "\n".join(edges)


def test_every_module_has_a_layer_and_the_rule_is_documented():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))
    design = DESIGN.read_text()
    order = " <- ".join(name for name, _ in LAYERS)
    assert order in design, f"docs/design.md#layering must state the order the test enforces: {order}"


@pytest.mark.parametrize("source", [
    "from micscompile.runtime.step import TrainStep\n",  # at module level
    "def f():\n    from micscompile.lowering import predict\n",  # lazily, inside a function
    "import typing\nif typing.TYPE_CHECKING:\n    import micscompile.tune.autotune\n",
])
def test_a_back_edge_is_caught(tmp_path, source):
    """The check itself: a core module importing the runtime, the lowering or tune is reported."""
    fake = tmp_path / "micscompile"
    for module in ("core/bad.py", "runtime/step.py", "lowering/predict.py", "tune/autotune.py"):
        (fake / module).parent.mkdir(parents=True, exist_ok=True)
        (fake / module).write_text(source if module == "core/bad.py" else "")
    edges = back_edges(fake)
    assert len(edges) == 1 and "micscompile.core.bad (core) imports" in edges[0], edges


def import_cycles(root: Path = PACKAGE) -> list[list[str]]:
    """Every cycle of imports among the package's modules (lazy ones included), within a layer or across."""
    import networkx as nx

    graph = nx.DiGraph()
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        graph.add_node(module)
        for _, target in imports_of(path, root):
            if target != module and target != "micscompile":  # (the package's __init__ is the API, not a layer)
                graph.add_edge(module, target)
    return [sorted(c) for c in nx.simple_cycles(graph)]


def test_no_modules_import_each_other():
    cycles = import_cycles()
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_an_import_cycle_inside_a_layer_is_caught(tmp_path):
    fake = tmp_path / "micscompile"
    (fake / "core").mkdir(parents=True)
    (fake / "core/plan.py").write_text("def f():\n    from micscompile.core.pipeline_schedule import check\n")
    (fake / "core/pipeline_schedule.py").write_text("from micscompile.core.plan import PlanError\n")
    assert import_cycles(fake) == [["micscompile.core.pipeline_schedule", "micscompile.core.plan"]]


def test_every_error_the_project_defines_is_a_micscompile_error():
    """``except micscompile.Error`` catches every refusal and failure the project raises: each exception class
    of every module (private control flow, named with an underscore, aside) derives from it, and raising one
    is caught so."""
    import importlib
    import inspect

    import micscompile as mc

    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for cls_name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == name \
                    and not cls_name.startswith("_"):
                found.append(cls)
    assert len(found) >= 15
    assert [c.__qualname__ for c in found if not issubclass(c, mc.Error)] == []
    for cls in found:
        with pytest.raises(mc.Error):
            try:
                exc = cls("a probe")
            except TypeError:  # (a constructor that takes more: the instance without it)
                exc = cls.__new__(cls)
            raise exc
    assert issubclass(mc.PlanError, ValueError) and issubclass(mc.TraceError, RuntimeError)


BUILTIN_ERRORS = frozenset(name for name, value in vars(builtins).items()
                           if isinstance(value, type) and issubclass(value, Exception)) - {"NotImplementedError"}
"""Raising one of these directly escapes ``except micscompile.Error`` (NotImplementedError marks an abstract
method)."""


def builtin_raises(paths: list[Path], root: Path) -> list[str]:
    """Each ``raise`` of a builtin exception class in ``paths``, outside the protocol methods whose contract
    names one (``__getitem__``, ``__getattr__``, ...)."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text())
        protocol = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                    and f.name.startswith("__") and f.name.endswith("__") for n in ast.walk(f)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Raise) or node.exc is None or id(node) in protocol:
                continue
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTIN_ERRORS:
                found.append(f"{path.relative_to(root)}:{node.lineno}: raise {exc.id}")
    return found


def test_every_error_the_project_raises_is_a_micscompile_error():
    """No ``raise ValueError(...)`` or the like in the package: each raise names a class of ``core.errors`` (or
    another ``Error`` subclass, the test above), so ``except micscompile.Error`` catches every one."""
    assert builtin_raises(sorted(PACKAGE.rglob("*.py")), PACKAGE) == []


def test_a_builtin_raise_is_caught(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("class M:\n    def __getitem__(self, k):\n        raise KeyError(k)\n\n\n"
                   "def f(x):\n    if x:\n        raise ValueError('no')\n    raise mc.PlanError('fine')\n")
    assert builtin_raises([bad], tmp_path) == ["bad.py:8: raise ValueError"]
