"""From a trace and a resolved plan to what one rank runs: the Lowered interface (flat or pipeline),
the prefetch search, pipeline lowering and the predictions built on them.

Layer 6 (lowering) of docs/design.md#layering.
"""
