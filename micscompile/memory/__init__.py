"""The static memory plan: buffer lifetimes from a lowered graph, offsets (planner, search, skyline),
the arena that makes them real, and the statistics users read.

Layer 5 (memory) of docs/design.md#layering.
"""
