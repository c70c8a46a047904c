"""Search and measurement: autotune, its search space and repricing, per-node profiling on a device.

Layer 8 (tune) of docs/design.md#layering.
"""
