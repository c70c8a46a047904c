"""The training step on torch.distributed: one step class for flat and pipeline plans, codegen,
materialization, state dicts.

Layer 7 (runtime) of docs/design.md#layering.
"""
