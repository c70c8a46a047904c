"""Names the pinned torch 2.13 has and the lent GPU machines' torch 2.11 lacks (docs/gpu.md).

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one:
``PYTHONPATH=benchmarks/gpu:.`` gives every script, pytest and spawned rank these names.
``benchmarks/gpu/checks.sh`` sets it. On torch 2.13 it changes nothing."""

try:
    import torch.distributed as _dist
    import torch.fx.experimental.symbolic_shapes as _shapes

    if not hasattr(_shapes, "optimization_hint"):
        _shapes.optimization_hint = _shapes.hint_int
    if not hasattr(_dist, "all_gather_single"):
        _dist.all_gather_single = _dist.all_gather_into_tensor
    if not hasattr(_dist, "reduce_scatter_single"):
        _dist.reduce_scatter_single = _dist.reduce_scatter_tensor
except Exception as e:  # noqa: BLE001 - a start-up hook must never stop the interpreter
    print(f"benchmarks/gpu/sitecustomize.py: {e!r}")
