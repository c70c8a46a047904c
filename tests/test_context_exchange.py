"""Context parallelism's attention exchanges, priced (``cost_model.context_exchange``): the bytes one rank sends
equal a count of the exchange's messages, the refusals name what would work, and the ring's hops hide behind its
blocks exactly where a block computes longer than a hop crosses the link."""

from __future__ import annotations

import dataclasses

import pytest

import micscompile as mc
from micscompile.cost_model.collective_time import ALL_TO_ALL, collective_time_s
from micscompile.cost_model.context_exchange import (
    ACCUMULATOR_BYTES,
    AttentionShape,
    check_exchange,
    exchange_bytes,
    exchange_time_s,
)

SHAPE = AttentionShape(batch=2, sequence=64, heads=8, kv_heads=4, head_dim=16, element_bytes=2)


def _messages(kind: str, shape: AttentionShape, c: int) -> tuple[list[int], list[int]]:
    """Every message rank 0 sends, forward and backward, in bytes, as the exchange runs them: the ring's hops, the
    ring all-gather's forwarded chunks and reduce-scatter's partial chunks, an all-to-all's pieces to each peer."""
    t, e, w = shape.batch * shape.sequence // c, shape.head_dim, shape.element_bytes
    k = v = t * shape.kv_heads * e  # elements of this rank's K, and of its V
    q = out = t * shape.heads * e
    if kind == "ring":
        forward = [(k + v) * w for _ in range(c - 1)]  # K, V on to the next rank, c - 1 times
        backward = [(k + v) * w for _ in range(c - 1)] + [(k + v) * ACCUMULATOR_BYTES for _ in range(c)]
        return forward, backward
    if kind == "all-gather":
        gather = [(k + v) * w for _ in range(c - 1)]  # a ring all-gather forwards c - 1 chunks
        return gather, gather + [(k + v) * w for _ in range(c - 1)]  # backward: gathered again, dK|dV scattered
    pieces = [x * w // c for x in (q, k, v, out) for _ in range(c - 1)]  # ulysses: 1/c of each to each peer
    return pieces, list(pieces)


@pytest.mark.parametrize("c", [2, 4])
@pytest.mark.parametrize("kind", ["ring", "all-gather", "ulysses"])
def test_the_bytes_equal_a_count_of_the_messages(kind, c):
    forward, backward = _messages(kind, SHAPE, c)
    assert exchange_bytes(kind, SHAPE, c) == (pytest.approx(sum(forward)), pytest.approx(sum(backward)))
    assert exchange_bytes(kind, SHAPE, 1) == (0.0, 0.0)


def test_ulysses_moves_less_than_the_ring_where_the_kv_heads_are_few_and_c_is_large():
    """Ulysses sends (c-1)/c of 2(h + g) t e; the ring (c-1) 2 g t e: at h = 4g Ulysses is cheaper from c = 5 on."""
    shape = AttentionShape(batch=1, sequence=4096, heads=32, kv_heads=8, head_dim=128)
    cheaper = [c for c in (2, 4, 8) if exchange_bytes("ulysses", shape, c)[0] < exchange_bytes("ring", shape, c)[0]]
    assert cheaper == [8]


@pytest.mark.parametrize("kind, shape, c, message", [
    ("ring", dataclasses.replace(SHAPE, sequence=60), 4, "does not cut into 2c = 8 balanced chunks: use a sequence "
                                                         "length that is a multiple of 8"),
    ("ulysses", dataclasses.replace(SHAPE, kv_heads=2), 4, r"c must divide both \(valid c: 2\), or use exchange "
                                                           "'ring'"),
    ("zigzag", SHAPE, 2, "unknown context exchange 'zigzag': valid are ring, all-gather, ulysses"),
])
def test_an_exchange_that_cannot_be_is_refused_naming_what_would(kind, shape, c, message):
    with pytest.raises(mc.Error, match=message):
        check_exchange(kind, shape, c)


def test_a_non_causal_sequence_needs_only_c_pieces():
    check_exchange("ring", dataclasses.replace(SHAPE, sequence=12, causal=False), 4)
    with pytest.raises(mc.Error, match="does not cut into c = 4 pieces"):
        check_exchange("ring", dataclasses.replace(SHAPE, sequence=10, causal=False), 4)


def test_the_rings_hops_hide_exactly_where_a_block_outlasts_a_hop():
    """Forward, the ring's exposed time is (c-1) max(0, hop - block): zero at a long sequence (blocks grow as s^2,
    hops as s), the whole hop less the block at a short one; the collectives' exchanges are exposed whole."""
    cluster = mc.Cluster.preset("p5.48xlarge@2025", nodes=1)
    ranks = tuple(range(4))
    long = AttentionShape(batch=1, sequence=65536, heads=32, kv_heads=8, head_dim=128)
    short = dataclasses.replace(long, sequence=512)
    for shape in (long, short):
        ring = exchange_time_s("ring", shape, ranks, cluster)
        block = ring.attention_forward_s / 4
        hop = ring.forward_s / 3
        assert ring.exposed_forward_s == pytest.approx(3 * max(0.0, hop - block))
        for kind in ("all-gather", "ulysses"):
            other = exchange_time_s(kind, shape, ranks, cluster)
            assert other.exposed_forward_s == other.forward_s > 0
    assert exchange_time_s("ring", long, ranks, cluster).exposed_forward_s == 0.0
    assert exchange_time_s("ring", short, ranks, cluster).exposed_forward_s > 0.0


def test_an_all_to_all_sends_what_leaves_each_rank_over_the_link_it_crosses():
    """Inside a node (g - 1)/g of the buffer at the device link; across nodes (g - q)/g at the NIC's share."""
    one = mc.Cluster.preset("p5.48xlarge@2025", nodes=1)
    nbytes = 1 << 30
    inside = collective_time_s(ALL_TO_ALL, nbytes, list(range(4)), one)
    assert inside == pytest.approx(one.intra.latency_s + 3 / 4 * nbytes / one.intra.bandwidth_bps)
    two = mc.Cluster.preset("p5.48xlarge@2025", nodes=2)
    across = collective_time_s(ALL_TO_ALL, nbytes, [0, 1, 8, 9], two)
    assert across > inside  # half of the buffer leaves the node, at the NIC's rate
