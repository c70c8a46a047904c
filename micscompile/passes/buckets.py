"""Analyses that decide the gather units (buckets) and the region of every node.

A block is a direct child of the model, or of a module reached from the model through
containers (ModuleList, ModuleDict, Sequential) and wrappers only: the transformer
layers of ``model.layers[i]`` are blocks, ``model.layers`` is not. A wrapper is a
module that holds a layer stack somewhere below it, as Hugging Face models hold theirs
(``GPT2LMHeadModel.transformer.h[i]``, ``LlamaForCausalLM.model.layers[i]``): its
children are blocks, not it. A layer stack is a container with two or more children of
one class that have children of their own (an MLP's ``Sequential(Linear, GELU, Linear)``
is not one). Parameters held directly by the model (or a container or wrapper) belong
to the root block "". A node's region is the block of the module that produced it; the
loss function is its own region.

Pure functions: no graph is modified here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.fx

ROOT_BLOCK = ""


def block_of(fqn: str, blocks: Sequence[str]) -> str:
    """The block that contains module (or parameter) ``fqn``; ROOT_BLOCK if none does."""
    return _block_of(fqn, tuple(blocks))


@functools.lru_cache(maxsize=1 << 16)
def _block_of(fqn: str, blocks: tuple[str, ...]) -> str:
    best = ROOT_BLOCK  # (cached: the pipeline split asks for every node of a graph, often)
    for b in blocks:
        if (fqn == b or fqn.startswith(b + ".")) and len(b) > len(best):
            best = b
    return best


def assign_buckets(
    param_names: list[str],
    param_bytes: dict[str, int],
    blocks: list[str],
    first_use: dict[str, int],
    bucket_bytes: int | None,
) -> tuple[list[tuple[str, list[str]]], dict[str, int]]:
    """Group parameters into buckets.

    One bucket per block that owns parameters, ordered by the block's first use in the
    graph (``first_use``: param -> node index; unused parameters sort last). With
    ``bucket_bytes``, consecutive blocks merge while the bucket stays within it. A block
    named as a parameter (a pipeline's tied parameter: ``lowering.pipeline_split``) holds
    that parameter alone and never merges, so it is sharded alike in every chunk.
    Returns ([(bucket name, [param names])], {block: bucket index}).
    """
    by_block: dict[str, list[str]] = {}
    alone = set(param_names).intersection(blocks)
    for name in param_names:
        by_block.setdefault(name if name in alone else block_of(name.rpartition(".")[0], blocks), []).append(name)
    never = len(first_use) + 10**9
    order = sorted(by_block, key=lambda b: min(first_use.get(n, never) for n in by_block[b]))
    buckets: list[tuple[list[str], list[str]]] = []  # (blocks, params)
    size = 0
    for block in order:
        nbytes = sum(param_bytes[n] for n in by_block[block])
        merge = not ({block, *buckets[-1][0]} & alone) if buckets else False
        if merge and bucket_bytes is not None and size + nbytes <= bucket_bytes:
            buckets[-1][0].append(block)
            buckets[-1][1].extend(by_block[block])
            size += nbytes
        else:
            buckets.append(([block], list(by_block[block])))
            size = nbytes
    named = [("+".join(b or "<root>" for b in blks), params) for blks, params in buckets]
    block_bucket = {b: i for i, (blks, _) in enumerate(buckets) for b in blks}
    return named, block_bucket


def param_derived(graph: torch.fx.Graph, params: dict[torch.fx.Node, str]) -> dict[torch.fx.Node, frozenset[str]]:
    """Nodes computed from parameters alone (views, casts, ...) -> the parameters they read.

    The rewrite re-derives these inside every use interval, so random ops (dropconnect,
    weight noise) are excluded: drawing again would change the numbers between uses.
    """
    derived: dict[torch.fx.Node, frozenset[str]] = {n: frozenset([name]) for n, name in params.items()}
    for node in graph.nodes:
        if node.op != "call_function" or node in derived:
            continue
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            continue
        inputs = node.all_input_nodes
        if inputs and all(i in derived for i in inputs):
            derived[node] = frozenset().union(*(derived[i] for i in inputs))
    return derived
