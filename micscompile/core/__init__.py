"""The data every layer passes around: the Plan, sharding layouts, the ops the rewritten graph calls
(collectives), the Program and the pipeline schedule IR, devices and process-group set-up.

Layer 1 (core) of docs/design.md#layering.
"""
