"""Example models (the demo's, and Hugging Face configs): they import nothing from micscompile.

Layer 0 (zoo) of docs/design.md#layering.
"""
