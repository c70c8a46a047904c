"""Cost models: FLOPs, bytes and (later) time of graph nodes and collectives."""

from .flops import node_flops

__all__ = ["node_flops"]
