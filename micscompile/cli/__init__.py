"""The micscompile command, its pictures, the named model specs, the demo and the eager parity
reference.

Layer 9 (api) of docs/design.md#layering.
"""
