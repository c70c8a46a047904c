"""Time of a collective over a concrete set of ranks: alpha-beta models.

Assumptions (docs/design.md "Ring collectives", thesis 3.2.3 and its footnote on [110]):

* Ring all-gather / reduce-scatter of a full buffer of N bytes over g ranks on m nodes:
  ``L + (g-1)/g * N / B``; ring all-reduce twice that. The latency L is NCCL's own
  (``src/graph/tuning.cc``: nInterSteps of nsteps): a ring crosses the network on m - 1 of
  its g - 1 steps, ``L = (m-1) * alpha_net + (g-m) * alpha_intra`` (inside one node
  ``(g-1) * alpha_intra``). Tree all-reduce: ``2 floor(log2 m) alpha_net + 2 (g/m - 1)
  alpha_intra + 2 N / B``; "auto" takes the faster. Broadcast (pipelined ring): ``L + N / B``;
  P2P: ``alpha + N / B``. All-to-all (NCCL's grouped sends, all peers at once): ``alpha + (g-1)/g * N / B``
  inside a node, ``alpha + (g-q)/g * N / B`` across m nodes of q of its ranks each (the bytes that leave the
  node, at each rank's share of its NICs); from the links alone, not fitted.
* Per protocol, as NCCL's tuner picks the faster: the above is Simple; LL (small messages) pays the
  network's latency once per network step where Simple pays it twice, plus NCCL's smaller hwLat, at a
  quarter of the bandwidth (``ll_ring_latency_s``, ``LL_BANDWIDTH``).
* Which links a group crosses decides B: a group inside one node uses the per-device
  intra-node link; a group spanning nodes is bottlenecked by each node's NICs, which
  collectives use in parallel (NCCL channels): B = nics * NIC bandwidth. alpha_net is a
  network step's whole cost as NCCL over the NIC pays it (EFA: fitted, specs.EFA_STEP_LATENCY_S).
* Scale costs bandwidth twice (docs/cost-model.md "The collective model"):
  - sibling groups share a node's NICs: MiCS's groups partition the world and run the same
    collective at once, so a group with r of a node's k ranks shares the node with k / r
    rings (a replication group with one rank per node: k rings);
  - a ring over more nodes than one non-blocking switch domain (``Cluster.fabric_nodes``)
    sends a share 1 - fabric_nodes / m of its hops through the oversubscribed layer above,
    and runs at the bandwidth that layer leaves each of them;
  - a ring moves at the pace of its slowest network hop, and has one per node it spans: over m > 2
    nodes it gets ``(m / 2) ** -Cluster.nic_node_exponent`` of its 2-node rate (p4d: fitted on
    nccl-tests' 3- and 4-node bus bandwidth).
* Effective bandwidth N / T therefore falls as the group grows for a fixed message
  (the latency term grows with the nodes it spans, the group leaves the node, then the switch domain),
  as measured in the thesis (Fig 3-2, §3.3.2).
* Hierarchical all-gather / reduce-scatter over m nodes of q ranks (thesis 3.3.3):
  k = q parallel inter-node rings of m ranks each move (m-1)/p * N per rank, sharing
  the node's NICs, then an intra-node collective of q ranks over the whole buffer.
* A calibrated cluster (``Cluster.collective_fits``) overrides the analytic model
  with the measured alpha/beta for that collective kind and group size.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from micscompile.core.errors import InputError
from micscompile.cost_model.specs import Cluster

ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
BROADCAST = "broadcast"
P2P = "p2p"
ALL_TO_ALL = "all_to_all"


def nodes_spanned(ranks: Sequence[int], gpus_per_node: int) -> int:
    if isinstance(ranks, tuple):  # a process group's ranks: asked once per collective priced
        return _nodes_spanned(ranks, gpus_per_node)
    return len({r // gpus_per_node for r in ranks})


@functools.lru_cache(maxsize=4096)
def _nodes_spanned(ranks: tuple[int, ...], gpus_per_node: int) -> int:
    return len({r // gpus_per_node for r in ranks})


def fit_key(kind: str, group_size: int) -> str:
    return f"{kind}:{group_size}"


def fabric_factor(cluster: Cluster, nodes: int) -> float:
    """How much slower a ring over ``nodes`` nodes runs than one over 2 inside a switch domain: the share
    1 - fabric_nodes / nodes of its hops that leave a domain, times the oversubscription above; and
    ``(nodes / 2) ** nic_node_exponent``, its slowest of ``nodes`` network hops setting its pace."""
    spread = (nodes / 2) ** cluster.nic_node_exponent if nodes > 2 and cluster.nic_node_exponent else 1.0
    r = cluster.fabric_nodes
    if r <= 0 or nodes <= r:
        return spread
    return spread * max(1.0, cluster.fabric_oversubscription * (1 - r / nodes))


def rings_per_node(ranks: Sequence[int], gpus_per_node: int) -> int:
    """Rings through one node's NICs when every group like this one runs at once: a group with r of
    the node's k ranks has k / r siblings there (each group is one of a partition of the world)."""
    m = nodes_spanned(ranks, gpus_per_node)
    return max(1, gpus_per_node * m // len(ranks))


def inter_node_bandwidth_bps(cluster: Cluster, ranks: Sequence[int], rings: int | None = None) -> float:
    """The bandwidth one ring over ``ranks`` gets from each node's NICs (``rings`` sharing them;
    default the group's siblings)."""
    m = nodes_spanned(ranks, cluster.gpus_per_node)
    rings = rings_per_node(ranks, cluster.gpus_per_node) if rings is None else rings
    return cluster.node_bandwidth_bps / (rings * fabric_factor(cluster, m))


def _link(cluster: Cluster, ranks: Sequence[int], kind: str) -> tuple[float, float]:
    """(alpha_s, bandwidth_bps) of the slowest link class the group crosses."""
    if nodes_spanned(ranks, cluster.gpus_per_node) > 1:
        # a pipeline's P2P sends say themselves how many go at once (simulate_pipeline's chains)
        return cluster.inter.latency_s, inter_node_bandwidth_bps(cluster, ranks, 1 if kind == P2P else None)
    return cluster.intra.latency_s, cluster.intra.bandwidth_bps


def ring_latency_s(g: int, m: int, cluster: Cluster) -> float:
    """NCCL's ring latency (``src/graph/tuning.cc``, 2.9-2.12: nInterSteps of nsteps) for one pass of a
    ring over ``g`` ranks on ``m`` nodes: it crosses the network on m - 1 of its g - 1 steps, the others
    are intra-node hops (one node: all g - 1)."""
    return (m - 1) * cluster.inter.latency_s + (g - m) * cluster.intra.latency_s


NCCL_NET_HW_LATENCY_S = {"ring_ll": 2.7e-6, "ring_simple": 14e-6, "tree_ll": 5.0e-6}
"""NCCL's own latency per network step, before the network's (``src/graph/tuning.cc``, master: hwLatencies
[NET]): Ring LL 2.7 us, Ring Simple 14 us, Tree LL 5 us."""
LL_NVLINK_RATIO = 0.6 / 3.4
"""An NVLink ring step with LL against Simple (the same table: 0.6 against 3.4 us)."""
LL_BANDWIDTH = {"ring": 1 / 4, "ring_one_node": 1 / 3, "tree": 1 / 3.8}
"""LL's bandwidth against Simple's: 4 bytes of data per 8-byte flagged word; NCCL prices a ring at busBw / 4
across nodes (and for all-reduce), / 3 inside one node, a tree at / 3.8 (tuning.cc)."""


def ll_network_step_s(cluster: Cluster) -> float:
    """One network step of an LL ring. NCCL adds the network's own latency L to hwLat once for LL and
    twice for Simple ("the flush extra latency"): Simple = 14 us + 2 L, LL = 2.7 us + L, so L comes
    from the fitted Simple step (``Cluster.inter.latency_s``; EFA: ``specs.EFA_STEP_LATENCY_S``), unless
    the preset measured the LL step apart (``Link.ll_latency_s``: today's small messages)."""
    if cluster.inter.ll_latency_s:
        return cluster.inter.ll_latency_s
    net = max(cluster.inter.latency_s - NCCL_NET_HW_LATENCY_S["ring_simple"], 0.0) / 2
    return NCCL_NET_HW_LATENCY_S["ring_ll"] + net


def ll_ring_latency_s(g: int, m: int, cluster: Cluster) -> float:
    """``ring_latency_s`` with NCCL's LL protocol, which it picks for small messages."""
    return (m - 1) * ll_network_step_s(cluster) + (g - m) * cluster.intra.latency_s * LL_NVLINK_RATIO


def tree_latency_s(g: int, m: int, cluster: Cluster) -> float:
    """NCCL's tree all-reduce latency (``tuning.cc``): up and down a chain of the g / m ranks of a node
    and a tree of floor(log2 m) network levels."""
    return 2 * (int(math.log2(m)) * cluster.inter.latency_s + (g // m - 1) * cluster.intra.latency_s)


def ll_tree_latency_s(g: int, m: int, cluster: Cluster) -> float:
    """``tree_latency_s`` with NCCL's LL protocol: a network level costs the LL step's network latency
    with the tree's hwLat."""
    level = ll_network_step_s(cluster) - NCCL_NET_HW_LATENCY_S["ring_ll"] + NCCL_NET_HW_LATENCY_S["tree_ll"]
    return 2 * (int(math.log2(m)) * level + (g // m - 1) * cluster.intra.latency_s * LL_NVLINK_RATIO)


def ring_s(g: int, m: int, moved_bytes: float, bw: float, cluster: Cluster, passes: int = 1,
           ll_share: float | None = None) -> float:
    """``passes`` passes of a ring over ``g`` ranks on ``m`` nodes that move ``moved_bytes`` per rank
    at ``bw`` (Simple's): the faster of NCCL's Simple and LL protocols, as its tuner picks. LL runs at
    ``ll_share`` of the bandwidth (default: a ring's across nodes, or inside one node)."""
    share = ll_share if ll_share is not None else LL_BANDWIDTH["ring" if m > 1 else "ring_one_node"]
    return min(passes * ring_latency_s(g, m, cluster) + moved_bytes / bw,
               passes * ll_ring_latency_s(g, m, cluster) + moved_bytes / (bw * share))


def collective_time_s(
    kind: str, nbytes: float, ranks: Sequence[int], cluster: Cluster, algorithm: str = "auto",
) -> float:
    """Seconds for one collective over ``ranks`` on ``cluster``; ``nbytes`` is the full buffer
    (all-gather output, reduce-scatter input, all-reduce / broadcast / P2P tensor)."""
    g = len(ranks)
    if g <= 1 or nbytes <= 0:
        return 0.0
    fit = cluster.collective_fits.get(fit_key(kind, g))
    if fit is not None:
        return fit["alpha_s"] + fit["beta_s_per_byte"] * nbytes
    alpha, bw = _link(cluster, ranks, kind)
    m = nodes_spanned(ranks, cluster.gpus_per_node)
    if kind in (ALL_GATHER, REDUCE_SCATTER):
        return ring_s(g, m, (g - 1) / g * nbytes, bw, cluster)
    if kind == ALL_REDUCE:
        ring = ring_s(g, m, 2 * (g - 1) / g * nbytes, bw, cluster, passes=2, ll_share=LL_BANDWIDTH["ring"])
        tree = min(tree_latency_s(g, m, cluster) + 2 * nbytes / bw,
                   ll_tree_latency_s(g, m, cluster) + 2 * nbytes / (bw * LL_BANDWIDTH["tree"]))
        return {"ring": ring, "tree": tree}.get(algorithm, min(ring, tree))
    if kind == BROADCAST:  # (a pipelined ring: its latency as the ring's)
        return ring_s(g, m, nbytes, bw, cluster)
    if kind == P2P:
        return alpha + nbytes / bw
    if kind == ALL_TO_ALL:  # (``nbytes``: one rank's whole buffer, in = out)
        leaves = g - g // m if m > 1 else g - 1
        return alpha + leaves / g * nbytes / bw
    raise InputError(f"unknown collective kind {kind!r}")


def hierarchical_time_s(kind: str, nbytes: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """Three-stage (inter-node, reorder, intra-node) all-gather or reduce-scatter time."""
    return sum(hierarchical_stages_s(kind, nbytes, ranks, cluster))


def hierarchical_stages_s(kind: str, nbytes: float, ranks: Sequence[int], cluster: Cluster) -> tuple[float, float, float]:
    """(inter-node, reorder, intra-node) seconds of a hierarchical all-gather or reduce-scatter."""
    if kind not in (ALL_GATHER, REDUCE_SCATTER):
        raise InputError(f"no hierarchical variant of {kind!r}")
    k = cluster.gpus_per_node
    m = nodes_spanned(ranks, k)
    g = len(ranks)
    if m <= 1:
        return 0.0, 0.0, collective_time_s(kind, nbytes, ranks, cluster)
    q = g // m
    # stage 1: q parallel rings of m ranks across nodes, each over 1/q of the buffer, sharing NICs
    # with each other and the sibling groups' rings
    ring_bw = inter_node_bandwidth_bps(cluster, ranks, q * rings_per_node(ranks, k))
    inter = ring_s(m, m, (m - 1) / m * (nbytes / q), ring_bw, cluster)
    # stage 2: reorder chunks in device memory (read + write the buffer)
    reorder = 2 * nbytes / (cluster.gpu.memory_bandwidth_bps * cluster.gpu.memory_efficiency)
    # stage 3: intra-node collective of q ranks over the whole buffer
    intra = ring_s(q, 1, (q - 1) / q * nbytes, cluster.intra.bandwidth_bps, cluster)
    return inter, reorder, intra


def inter_node_bytes(kind: str, nbytes: float, group_size: int, gpus_per_node: int, hierarchical: bool) -> float:
    """Bytes a node sends over its NICs for one all-gather / reduce-scatter (thesis 3.3.3):
    flat (p-1)/p * N, hierarchical (p-k)/p * N."""
    p, k = group_size, min(gpus_per_node, group_size)
    return (p - k) / p * nbytes if hierarchical else (p - 1) / p * nbytes


def effective_bandwidth_bps(kind: str, nbytes: float, ranks: Sequence[int], cluster: Cluster) -> float:
    """Algorithm bandwidth N / T (what Fig 3-2 of the thesis plots)."""
    t = collective_time_s(kind, nbytes, ranks, cluster)
    return nbytes / t if t else float("inf")


def fused_time_s(kind: str, sizes: Sequence[float], ranks: Sequence[int], cluster: Cluster) -> float:
    """Several buffers fused into one collective: one latency term for all of them."""
    return collective_time_s(kind, sum(sizes), ranks, cluster)
