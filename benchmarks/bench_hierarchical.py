"""Hierarchical vs flat all-gather across nodes, as the cost model predicts it (thesis 3.3.3).

    .venv/bin/python benchmarks/bench_hierarchical.py

The thesis's micro-benchmark: all-gathers over 2 p3dn.24xlarge nodes (16 V100, 100 Gbps);
it measured a 128 MB hierarchical all-gather at ~72% of the flat one's time. Also shown:
the inter-node bytes a node sends per gather ((p-1)M/p flat, (p-k)M/p hierarchical) and
which one ``Plan(hierarchical="auto")`` picks per size. No GPU needed.
"""

from __future__ import annotations

import argparse

import micscompile as mc
from micscompile.core.collectives import fmt_bytes
from micscompile.cost_model.collective_time import ALL_GATHER, collective_time_s, hierarchical_time_s, inter_node_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="p3dn.24xlarge")
    ap.add_argument("--nodes", type=int, default=2)
    args = ap.parse_args()
    cluster = mc.Cluster.preset(args.cluster, nodes=args.nodes)
    ranks = range(cluster.world_size)
    p, k = cluster.world_size, cluster.gpus_per_node
    print(f"all-gather over {p} ranks = {args.nodes} x {args.cluster} (k={k})")
    head = f"{'message':>10}{'flat':>12}{'hierarchical':>14}{'hier/flat':>11}{'inter-node flat':>17}{'hier':>12}  auto"
    print(head)
    print("-" * len(head))
    for mib in (1, 8, 32, 128, 512):
        n = mib * 2**20
        flat = collective_time_s(ALL_GATHER, n, ranks, cluster)
        hier = hierarchical_time_s(ALL_GATHER, n, ranks, cluster)
        print(f"{fmt_bytes(n):>10}{flat * 1e3:>9.2f} ms{hier * 1e3:>11.2f} ms{hier / flat:>10.2f}x"
              f"{fmt_bytes(inter_node_bytes(ALL_GATHER, n, p, k, False)):>17}"
              f"{fmt_bytes(inter_node_bytes(ALL_GATHER, n, p, k, True)):>12}  {'hierarchical' if hier < flat else 'flat'}")


if __name__ == "__main__":
    main()
