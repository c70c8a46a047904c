"""Hardware and topology specs: what one device computes and what the links carry.

Units: FLOP/s, bytes, bytes/s, seconds (``_flops``, ``_bytes``, ``_bps`` = bytes per
second, ``_s``). Link bandwidths are one direction.

Sources of the preset constants (docs/design.md "Hardware facts", vendor pages):
V100-32GB: 125 TFLOP/s fp16 tensor core, 900 GB/s HBM2; p3dn.24xlarge: 8 GPUs,
NVLink ~150 GB/s per GPU one way, 100 Gbps EFA per node. A100: 312 TFLOP/s bf16,
1555 GB/s (40GB) / 2039 GB/s (80GB) HBM2e; p4d/p4de.24xlarge: 8 GPUs, NVSwitch
600 GB/s per GPU (300 GB/s one way), 4x100 Gbps EFA per node. DGX A100: 8x200 Gbps
InfiniBand. H100 SXM: 989 TFLOP/s bf16, 3.35 TB/s HBM3, NVLink 900 GB/s
(450 GB/s one way), DGX H100 8x400 Gbps InfiniBand. TF32 (dense): A100 156, H100 494
TFLOP/s. H200: H100's compute, 4.8 TB/s HBM3e; p5en.48xlarge 16x200 Gbps EFAv3.
Latencies (alpha) are typical NCCL figures: ~5 us per intra-node hop, ~15-25 us per
inter-node hop on EFA/IB. Achieved efficiencies default to docs/design.md's "40-55% of peak": calibrate for real.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from micscompile.core.errors import Error

GBPS_TO_BPS = 1e9 / 8
"""Gigabits per second -> bytes per second."""


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    """One accelerator (or, for the local CPU machine, one rank's share of it)."""

    name: str
    peak_flops: dict[str, float]
    """Peak FLOP/s per dtype name ("float32", "bfloat16", "float16"; "tfloat32": float32 matmuls on the tensor cores,
    where ``torch.backends.cuda.matmul.allow_tf32`` lets them, dense; a GPU without it prices them at "float32")."""
    memory_bandwidth_bps: float
    """Device memory bandwidth."""
    memory_bytes: int
    """Device memory capacity."""
    matmul_efficiency: float = 0.5
    """Achieved fraction of peak FLOP/s for matmul-like ops."""
    memory_efficiency: float = 0.7
    """Achieved fraction of memory bandwidth for memory-bound ops."""
    op_overhead_s: float = 5e-6
    """Fixed cost per op (kernel launch / dispatch)."""
    graph_op_overhead_s: float | None = None
    """Fixed cost per kernel replayed in a CUDA graph (no host dispatch: the device's launch gap), as ``calibrate``
    measures it on a GPU; None: ``op_overhead_s`` (the presets: their per-op price, fitted on device-bound rows,
    stands for it; docs/gpu.md bounds a replayed kernel at 3.4-4.5 us on an H200)."""
    device_type: str = "cuda"
    """What runs the plan ("cuda", or "cpu" for a calibrated CPU machine): ``mc.trace(device=...)``
    records the attention kernel that device runs."""
    optimizer_param_s: float | None = None
    """Measured optimizer-step cost per parameter tensor (None: 10 ops of op_overhead_s)."""
    optimizer_element_s: float | None = None
    """Measured optimizer-step cost per shard element (None: 28 bytes at memory bandwidth)."""

    def flops(self, dtype: str) -> float:
        return self.peak_flops.get(dtype) or self.peak_flops["float32"]

    def with_tf32(self) -> GpuSpec:
        """This GPU with float32 matmuls on its tensor cores in TF32 (``torch.backends.cuda.matmul.allow_tf32``):
        "float32" priced at the "tfloat32" peak; itself where it has none (a calibrated GPU measured its matmuls as
        they ran)."""
        tf32 = self.peak_flops.get("tfloat32")
        return self if tf32 is None else dataclasses.replace(self, peak_flops={**self.peak_flops, "float32": tf32})

    def replayed(self) -> GpuSpec:
        """This GPU as a step replayed in a CUDA graph sees it: each op costs ``graph_op_overhead_s``."""
        if self.graph_op_overhead_s is None:
            return self
        return dataclasses.replace(self, op_overhead_s=self.graph_op_overhead_s)


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link class: alpha-beta parameters."""

    bandwidth_bps: float
    latency_s: float
    """One step of a ring with NCCL's Simple protocol (the bandwidth protocol): for a NIC, a network step."""
    ll_latency_s: float = 0.0
    """One network step with NCCL's LL protocol, where it was measured apart (small messages: today's
    presets); 0: NCCL's own relation to the Simple step (``collective_time.ll_network_step_s``)."""


class ClusterError(Error, ValueError):
    """A cluster that cannot be: an unknown preset, an unreadable file, no nodes; the message says what would."""


class ClusterFileError(Error, FileNotFoundError):
    """A cluster file (``Cluster.load``, ``Cluster.preset("local")``) that is not there."""


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Nodes of identical devices; intra-node links per device, inter-node NICs per node."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GpuSpec
    intra: Link
    """Per-device link inside a node (NVLink / NVSwitch; shared memory for the local CPU)."""
    inter: Link
    """One NIC; ``nics_per_node`` of them per node, used in parallel by collectives."""
    nics_per_node: int = 1
    fabric_nodes: int = 0
    """Nodes whose NICs reach each other at full bandwidth (one non-blocking switch domain); 0: the
    whole cluster. A ring over m > fabric_nodes nodes crosses the layer above, where its bandwidth
    per node divides by ``max(1, fabric_oversubscription * (1 - fabric_nodes / m))`` (the share of
    its hops that leave a domain, docs/cost-model.md "The collective model")."""
    fabric_oversubscription: float = 1.0
    """What a domain's nodes can send over what the layer above it carries (1: non-blocking)."""
    nic_node_exponent: float = 0.0
    """A ring over m > 2 nodes gets ``(m / 2) ** -nic_node_exponent`` of the NIC rate it gets over 2 (0:
    the same at every size). A ring moves at the pace of its slowest network hop, and it has m of them,
    so its rate falls as it spans more nodes, even on a non-blocking fabric (docs/cost-model.md "The
    collective model")."""
    prediction_error: float = 0.0
    """Typical relative error of a step-time prediction on this cluster: the median |error| in
    throughput of the held-out rows measured on it, rows of a discrete setting left out
    (``benchmarks/reproduce_thesis.py``'s ``throughput_error``; 0: no held-out evidence). Predictions
    carry it as their interval."""
    overlap: float = 1.0
    """Fraction of a collective that can hide behind compute (1 = separate engines, as on GPUs;
    lower where communication and compute share cores, as gloo on a small CPU machine)."""
    collective_overhead_s: float = 0.0
    """Compute-stream time each collective costs beyond its overlap share (scheduling the
    communication thread on cores that compute keeps busy); 0 on GPUs."""
    collective_interference: dict[str, dict[str, float]] = field(default_factory=dict)
    """Measured cost to the compute stream of a collective in flight, per group size ("2", "4", ...):
    {"exposed_fraction": of its duration, paid at issue; "slowdown": fraction by which compute
    alongside it (until it ends) runs slower, at most "max_slowdown_s"; "queued_fraction": of its
    duration a collective adds when issued while another of its group is in flight (1: they
    run one after the other, as on one NCCL stream); on CPU ranks "arrival_wait_s" and
    "arrival_exponent": a collective starts once the group's last rank issues it, k * (c / 1 ms) ** e
    after this one, c the compute since the group's previous collective ended} (calibration). Where
    present it replaces ``(1 - overlap) * duration + collective_overhead_s``."""
    collective_fits: dict[str, dict[str, float]] = field(default_factory=dict)
    """Measured alpha/beta per collective kind from calibration: {kind: {"alpha_s", "beta_s_per_byte"}}."""
    era: str = ""
    """Which software the constants stand for (the presets': what they were fitted on; "" for a calibration of
    this machine, which stands for its own). A prediction on a preset is one for that era's stack."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ClusterError(f"a cluster needs a positive number of {name.replace('_', ' ')}, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def node_bandwidth_bps(self) -> float:
        return self.inter.bandwidth_bps * self.nics_per_node

    def with_nodes(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes)

    def with_tf32(self) -> Cluster:
        """This cluster with its GPUs' float32 matmuls in TF32 (``GpuSpec.with_tf32``), named so; itself where the
        GPU has no TF32 peak."""
        gpu = self.gpu.with_tf32()
        return self if gpu is self.gpu else dataclasses.replace(self, name=f"{self.name} (TF32 matmuls)", gpu=gpu)

    # ---- presets and files ---------------------------------------------------------

    @staticmethod
    def preset(name: str, nodes: int = 1) -> Cluster:
        """A named cluster (see ``PRESETS``) with ``nodes`` nodes; "local" reads local_cluster.json."""
        if name == "local":
            return Cluster.load(Path("local_cluster.json")).with_nodes(nodes)
        if name not in PRESETS:
            raise ClusterError(f"unknown cluster preset {name!r}; known: {', '.join(sorted(PRESETS))}, local, "
                               "or a calibrated cluster .json")
        return PRESETS[name].with_nodes(nodes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @staticmethod
    def load(path: str | Path) -> Cluster:
        path = Path(path)
        if not path.exists():
            raise ClusterFileError(f"{path} not found: run `python -m micscompile calibrate` first")
        try:
            raw = json.loads(path.read_text())
            gpu = raw["gpu"]  # calibrated before device_type was recorded: a CPU machine names itself "cpu rank ..."
            gpu.setdefault("device_type", "cpu" if gpu["name"].startswith("cpu") else "cuda")
            return Cluster(
                **{k: v for k, v in raw.items() if k not in ("gpu", "intra", "inter")},
                gpu=GpuSpec(**gpu), intra=Link(**raw["intra"]), inter=Link(**raw["inter"]),
            )
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ClusterError(f"{path} is not a cluster file ({type(exc).__name__}: {exc}); "
                               "`micscompile calibrate` writes one") from exc


GIB = 1 << 30
V100_MATMUL_EFFICIENCY, A100_MATMUL_EFFICIENCY = 0.446, 0.561
"""The fraction of peak the matmuls of BERT-style training reach on each GPU (fitted in 16 bits; the
presets apply it to every dtype's peak), fitted on the one end-to-end row per GPU type the
calibration protocol allows (``benchmarks/reproduce_thesis.py --fit-compute``): MiCS's absolute
throughput in the thesis at its smallest partition group, BERT 10B on 128 V100 at "about 42% of the
theoretical peak" (§3.5.1.1), and the 52B model on 128 A100 at 179 TFLOP/s (§3.5.1.5). Each is fitted
with the collective model's constants already fixed; every other row of the table is held out. GPUs
without such a row keep ``GpuSpec``'s default 0.5."""
V100_32GB = GpuSpec(name="V100-32GB", peak_flops={"float16": 125e12, "float32": 15.7e12},
                    memory_bandwidth_bps=900e9, memory_bytes=32 * GIB, matmul_efficiency=V100_MATMUL_EFFICIENCY)
A100_40GB = GpuSpec(name="A100-40GB", peak_flops={"bfloat16": 312e12, "float16": 312e12, "tfloat32": 156e12,
                                                   "float32": 19.5e12},
                    memory_bandwidth_bps=1555e9, memory_bytes=40 * GIB, matmul_efficiency=A100_MATMUL_EFFICIENCY)
A100_80GB = dataclasses.replace(A100_40GB, name="A100-80GB", memory_bandwidth_bps=2039e9, memory_bytes=80 * GIB)
H100 = GpuSpec(name="H100-80GB", peak_flops={"bfloat16": 989e12, "float16": 989e12, "tfloat32": 494e12,
                                             "float32": 67e12},
               memory_bandwidth_bps=3350e9, memory_bytes=80 * GIB)

def _eight_gpu_nodes(name: str, gpu: GpuSpec, nvlink_bps: float, nic_gbps: float, nics: int, nic_latency_s: float,
                     *, nic_ll_latency_s: float = 0.0, nvlink_efficiency: float = 1.0, nic_efficiency: float = 1.0,
                     fabric_nodes: int = 0,
                     fabric_oversubscription: float = 1.0, nic_node_exponent: float = 0.0,
                     prediction_error: float = 0.0, era: str = "") -> Cluster:
    """A cluster of 8-GPU nodes: per-GPU NVLink/NVSwitch inside, ``nics`` NICs per node across, each
    link at the fraction of its line rate a ring achieves."""
    return Cluster(name=name, nodes=1, gpus_per_node=8, gpu=gpu,
                   intra=Link(bandwidth_bps=nvlink_bps * nvlink_efficiency, latency_s=5e-6),
                   inter=Link(bandwidth_bps=nic_gbps * GBPS_TO_BPS * nic_efficiency, latency_s=nic_latency_s,
                              ll_latency_s=nic_ll_latency_s),
                   nics_per_node=nics, fabric_nodes=fabric_nodes, fabric_oversubscription=fabric_oversubscription,
                   nic_node_exponent=nic_node_exponent,
                   prediction_error=prediction_error, era=era)


EFA_STEP_LATENCY_S = 220e-6
"""Per network step of a ring over EFA (SRD, NCCL via aws-ofi-nccl, 2020-21; NCCL's latency model
charges it on m - 1 of a ring's steps over m nodes), fitted with the p3dn preset's other constants on
the collective measurements only (``benchmarks/reproduce_thesis.py --fit``): the thesis's five and
nccl-tests' small all-reduces on 2 p3dn nodes (aws/aws-ofi-nccl#33). p4d's EFA is the same transport."""

P3DN_HELD_OUT_ERROR = 0.12
"""Median |error| in throughput of reproduce_thesis.py's held-out p3dn rows (19, 9, 18, 19, 2, 12%: the
ratios, and the gains as throughput ratios; and the Megatron-LM-3D rows of §3.5.1.3, 2, 4,
16%: nine rows; docs/cost-model.md's table; the script prints it)."""
P4D_HELD_OUT_ERROR = 0.08
"""The same of its held-out p4d rows (chapter 3: 12, 3, 39, 2, 3, 43%; chapter 4: 0, 28, 28, 3%; the rows
of a discrete setting, a micro-batch or a global batch, left out): a median, so half of them are
further off (docs/cost-model.md#uncertainty)."""

DGX_A100_HELD_OUT_ERROR = 0.15
"""The same of its held-out rows, the Megatron-LM paper's on Selene (Table 2's PTD-P at 175B 10, 9, 6% and
530B 16, 15, 12%; ZeRO-3 as DeepSpeed ran in 2021 at 175B 6, 15, 0% and 530B 18, 28, 39%; the 384 -> 1536 drop 5%,
PTD-P / ZeRO-3 at 768 GPUs 21%, Fig. 12's interleaving 37%): the preset's constants are spec sheets and A100's
compute fit, none fitted on a Selene row."""

P4D_NIC_EFFICIENCY, P4D_NIC_NODE_EXPONENT = 0.71, 0.23
"""p4d's EFA NICs: 0.71 of line rate for a ring over 2 nodes, falling as ``(m / 2) ** -0.23`` over m
nodes (``Cluster.nic_node_exponent``). Fitted on one software version's node sweep only: nccl-tests
all-reduce bus bandwidth at 1 GiB on 3 and 4 p4d nodes, 31.8 and 29.6 GB/s (NVIDIA/nccl#527, NCCL
2.9.9; ``reproduce_thesis.py --fit-p4d``). Checked, not fitted: the 2-node all-reduces of 32-42 MiB
with NCCL 2.7.8 (aws/aws-ofi-nccl#65) come within 18-20%, and the exponent is the one p3dn's 2019
sweep shows (aws/aws-ofi-nccl#19: 70% of InfiniBand's rate on 8 nodes, 60% on 16, 0.22)."""

ERA_2021 = ("2021-22 software: NCCL 2.7-2.9, PyTorch 1.x without fused attention kernels, DeepSpeed v0.5 (fitted on "
            "the MiCS thesis's collective and end-to-end rows)")
ERA_SPEC = ("spec-sheet links at line rate with A100's 2021-22 compute fit (judged on the Megatron-LM paper's 2021 "
            "rows: NCCL 2.8, PyTorch 1.8)")
ERA_NONE = "spec sheets only: links at line rate, compute at half of peak (no row fitted or judged)"
ERA_2023 = ("2023-25 software: NCCL 2.18-2.27, PyTorch 2.x with flash attention, FSDP (fitted on llm-foundry's MPT-7B "
            "rows and nccl-tests runs of NCCL 2.20-2.27; benchmarks/reproduce_current.py)")

A100_NVLINK_EFFICIENCY, H100_NVLINK_EFFICIENCY = 0.77, 370 / 450
"""A ring's share of NVSwitch's line rate inside one node: A100 230.8 of 300 GB/s (nccl-tests on one p4d,
NVIDIA/nccl#527, NCCL 2.9.9: the p4d and p4de presets; no later one-node A100 figure is public, so today's presets
keep it), H100 about 370 of 450 GB/s (NVIDIA/nccl-tests#212)."""

# ---- today's software: the same machines, fitted by the same protocol on current public evidence ----

A100_MATMUL_EFFICIENCY_2023, H100_MATMUL_EFFICIENCY_2023 = 0.696, 0.543
"""The fraction of 16-bit peak the matmuls (and fused attention) of today's stack reach, fitted on the one
end-to-end row per GPU type the protocol allows (``benchmarks/reproduce_current.py --fit``): llm-foundry's MPT-7B
on one 8-GPU node (seq 2048, micro-batch 6, FSDP FULL_SHARD, bf16, no checkpointing; mosaicml/llm-foundry
``scripts/train/benchmarking/README.md``, 2023): 64.23% MFU on A100-80GB, 46.44% on H100, with the links fixed."""
A100_80GB_2023 = dataclasses.replace(A100_80GB, matmul_efficiency=A100_MATMUL_EFFICIENCY_2023)
A100_40GB_2023 = dataclasses.replace(A100_40GB, matmul_efficiency=A100_MATMUL_EFFICIENCY_2023)
H100_2023 = dataclasses.replace(H100, matmul_efficiency=H100_MATMUL_EFFICIENCY_2023)
H200_2023 = dataclasses.replace(H100_2023, name="H200-141GB", memory_bandwidth_bps=4.8e12, memory_bytes=143771 << 20)
"""H200 SXM: H100's compute (989 TFLOP/s bf16 on the same die and clocks) with 4.8 TB/s of HBM3e, 141 GB on the
sheet (143771 MiB as torch reports it on the H200 of docs/gpu.md). No end-to-end H200 row is public to fit on: it
takes H100's compute fit, as today's presets of A100-40GB take A100-80GB's."""

DGX_A100_NIC_EFFICIENCY_2023, DGX_A100_LL_STEP_S_2023 = 0.98, 38.0e-6
"""DGX A100's 8 x 200 Gb/s InfiniBand with today's NCCL: "192 GB/s AllReduce BusBW" (an NVIDIA maintainer,
NVIDIA/nccl#812) and 93 us for an 8-byte all-reduce on 2 nodes, which sets the LL network step
(``reproduce_current.py --fit``); the Simple step is taken equal to it, as p5's sweep wants."""
P4DE_NIC_EFFICIENCY_2024, P4DE_LL_STEP_S_2024 = 0.827, 73.5e-6
"""2 x p4de with NCCL 2.20.3 over EFA (aws-samples/awsome-distributed-training, 2024-04): 41.0 GB/s of
all-reduce algorithm bandwidth at 1 GiB (a tree on 2 nodes) sets the NICs' rate, 164 us for 8 bytes the LL network
step. p4d has the same NICs: its current preset takes them with the 40 GB GPU."""

CURRENT_HELD_OUT_ERROR = 0.05
"""Median |error| in MFU of the held-out llm-foundry rows (``benchmarks/reproduce_current.py``): 5% on dgx-a100@2023
(17 rows, one to 128 nodes' worth of A100s; 16 within 10%, a 70B on 64 A100-40GB at +38%) and 5% on p5.48xlarge@2025
(four one-node H100 rows). p4d and p4de's current presets have no end-to-end row of their own: none."""
P5_NIC_EFFICIENCY_2025, P5_LL_STEP_S_2025 = 0.78, 26.5e-6
"""p5's 32 x 100 Gb/s EFA with NCCL 2.27.7: the all-gather bus bandwidth at 1 GiB over 2-32 nodes
(crazyguitar/aws-gpu-communication-benchmark: 322, 289, 224, 262, 222 GB/s) sets the NICs' rate and the Simple
step (no fall with the node count: the fit's exponent is 0), 2 x p5's 8-byte all-reduce (65-75 us, NCCL 2.20.3,
awsome-distributed-training) the LL step; the fit leaves the Simple step at its floor, the LL step."""

P5EN_NICS = 16
"""p5en.48xlarge: 8 x H200 and 16 x 200 Gb/s of EFAv3, the 3200 Gb/s of p5's 32 x 100 Gb/s in half the NICs. No
nccl-tests run on p5en is public to fit on: its links take p5's fit (the same software, the same line rate per
node), so the preset judges nothing (``prediction_error`` 0); it is what ``mc.compile`` prices a schedule on
when it runs on an H200 (``GPU_PRESETS``)."""

PRESETS: dict[str, Cluster] = {
    # fitted on collective measurements only (thesis §3.3.2, Fig. 3-2, §3.5.2.2; nccl-tests on 2 nodes,
    # aws-ofi-nccl#33; reproduce_thesis.py --fit): B_part -> NVLink ring efficiency, B_all -> NIC
    # efficiency, the 32-node cost ratio -> the switch domain and its oversubscription ("128MB ...
    # poor bandwidth utilization on 16 and 32 nodes"), it and the small all-reduces -> the latency
    "p3dn.24xlarge": _eight_gpu_nodes("p3dn.24xlarge", V100_32GB, 150e9, 100, 1, EFA_STEP_LATENCY_S,
                                      nvlink_efficiency=0.75, nic_efficiency=1.0, fabric_nodes=8,
                                      fabric_oversubscription=4.0, prediction_error=P3DN_HELD_OUT_ERROR, era=ERA_2021),
    # public measurements, none from the thesis: nccl-tests all-reduce bus bandwidth on one p4d node,
    # 230.8 GB/s of 300, and on 3 and 4 nodes, 31.8 and 29.6 GB/s of 50 (NVIDIA/nccl#527, NCCL 2.9.9:
    # P4D_NIC_EFFICIENCY and its fall with the node count), EC2 UltraClusters' non-blocking fabric,
    # EFA's per-network-step latency as on p3dn. (Not 0.85, from "effective 340 Gbps for all_reduce tests" in
    # stas00/ml-engineering, network/README.md: a figure without a log, and Fig. 4-1 rules it out.)
    "p4d.24xlarge": _eight_gpu_nodes("p4d.24xlarge", A100_40GB, 300e9, 100, 4, EFA_STEP_LATENCY_S,
                                     nvlink_efficiency=A100_NVLINK_EFFICIENCY, nic_efficiency=P4D_NIC_EFFICIENCY,
                                     nic_node_exponent=P4D_NIC_NODE_EXPONENT, prediction_error=P4D_HELD_OUT_ERROR,
                                     era=ERA_2021),
    "p4de.24xlarge": _eight_gpu_nodes("p4de.24xlarge", A100_80GB, 300e9, 100, 4, EFA_STEP_LATENCY_S,
                                      nvlink_efficiency=A100_NVLINK_EFFICIENCY, nic_efficiency=P4D_NIC_EFFICIENCY,
                                      nic_node_exponent=P4D_NIC_NODE_EXPONENT, prediction_error=P4D_HELD_OUT_ERROR,
                                     era=ERA_2021),
    # spec sheets (InfiniBand, NVSwitch), not calibrated
    "dgx-a100": _eight_gpu_nodes("dgx-a100", A100_80GB, 300e9, 200, 8, 10e-6, prediction_error=DGX_A100_HELD_OUT_ERROR,
                                 era=ERA_SPEC),
    "dgx-h100": _eight_gpu_nodes("dgx-h100", H100, 450e9, 400, 8, 10e-6, era=ERA_NONE),
    # today's software on the same machines (and p5, H100 on EFA): benchmarks/reproduce_current.py --fit
    "dgx-a100@2023": _eight_gpu_nodes("dgx-a100@2023", A100_80GB_2023, 300e9, 200, 8, DGX_A100_LL_STEP_S_2023,
                                      nic_ll_latency_s=DGX_A100_LL_STEP_S_2023, nvlink_efficiency=A100_NVLINK_EFFICIENCY,
                                      nic_efficiency=DGX_A100_NIC_EFFICIENCY_2023,
                                      prediction_error=CURRENT_HELD_OUT_ERROR, era=ERA_2023),
    "p4de.24xlarge@2024": _eight_gpu_nodes("p4de.24xlarge@2024", A100_80GB_2023, 300e9, 100, 4, P4DE_LL_STEP_S_2024,
                                           nic_ll_latency_s=P4DE_LL_STEP_S_2024, nvlink_efficiency=A100_NVLINK_EFFICIENCY,
                                           nic_efficiency=P4DE_NIC_EFFICIENCY_2024, era=ERA_2023),
    "p4d.24xlarge@2024": _eight_gpu_nodes("p4d.24xlarge@2024", A100_40GB_2023, 300e9, 100, 4, P4DE_LL_STEP_S_2024,
                                          nic_ll_latency_s=P4DE_LL_STEP_S_2024, nvlink_efficiency=A100_NVLINK_EFFICIENCY,
                                          nic_efficiency=P4DE_NIC_EFFICIENCY_2024, era=ERA_2023),
    "p5.48xlarge@2025": _eight_gpu_nodes("p5.48xlarge@2025", H100_2023, 450e9, 100, 32, P5_LL_STEP_S_2025,
                                         nic_ll_latency_s=P5_LL_STEP_S_2025, nvlink_efficiency=H100_NVLINK_EFFICIENCY,
                                         nic_efficiency=P5_NIC_EFFICIENCY_2025,
                                         prediction_error=CURRENT_HELD_OUT_ERROR, era=ERA_2023),
    "p5en.48xlarge@2025": _eight_gpu_nodes("p5en.48xlarge@2025", H200_2023, 450e9, 200, P5EN_NICS, P5_LL_STEP_S_2025,
                                           nic_ll_latency_s=P5_LL_STEP_S_2025, nvlink_efficiency=H100_NVLINK_EFFICIENCY,
                                           nic_efficiency=P5_NIC_EFFICIENCY_2025, era=ERA_2023),
}


# ---- the cluster a step is scheduled on when the user names none ------------------------------

CALIBRATION_CACHE = Path("~/.cache/micscompile/local_cluster.json")
"""Where ``micscompile calibrate`` also keeps this machine's calibration (``default_cluster`` reads it)."""

CPU_ESTIMATE = GpuSpec(
    name="cpu rank (built-in estimate)", device_type="cpu",
    peak_flops={"float32": 50e9, "bfloat16": 50e9, "float16": 1e9},
    memory_bandwidth_bps=24e9, memory_bytes=4 * GIB, matmul_efficiency=1.0, memory_efficiency=1.0,
    op_overhead_s=2e-6)
"""One gloo rank of a small CPU machine, rounded from a calibration of this project's 2-core CI
machine with 4 ranks (docs/cost-model.md); ``default_cluster`` uses it until ``micscompile calibrate``
has run here."""


def _cpu_estimate(world_size: int, gpus_per_node: int) -> Cluster:
    """Gloo on shared memory: ~1.5 GB/s per rank and ~1 ms per collective, and nothing hides behind
    compute (the ranks' compute keeps the cores the communication threads need busy)."""
    link = Link(bandwidth_bps=1.5e9, latency_s=1e-3)
    return Cluster(name="cpu (built-in estimate)", nodes=-(-world_size // gpus_per_node), gpus_per_node=gpus_per_node,
                   gpu=CPU_ESTIMATE, intra=link, inter=link, overlap=0.0)


GPU_PRESETS = (("H200", "p5en.48xlarge@2025"), ("H100", "p5.48xlarge@2025"), ("A100-SXM4-80GB", "p4de.24xlarge@2024"),
               ("A100 80GB", "p4de.24xlarge@2024"), ("A100", "p4d.24xlarge@2024"), ("V100", "p3dn.24xlarge"))
"""(a substring of ``torch.cuda.get_device_name()``, the preset of the machines that GPU comes in), first match: the
current software's preset where there is one (what ``mc.compile`` runs is today's stack), the thesis's for V100."""


def default_cluster(device_type: str, device_name: str, world_size: int, gpus_per_node: int) -> Cluster | None:
    """The cluster ``mc.compile`` prices its schedule on when given none: for a GPU, the preset of the
    machines it comes in (``GPU_PRESETS``; None for another GPU); on CPU, this machine's calibration
    (``$MICSCOMPILE_CLUSTER``, ./local_cluster.json, then ``CALIBRATION_CACHE``), else the built-in
    estimate. Shaped as the run: ``gpus_per_node`` ranks per node, as many nodes as the world needs."""
    nodes = -(-world_size // gpus_per_node)
    if device_type != "cpu":
        preset = next((name for part, name in GPU_PRESETS if part in device_name), None)
        return None if preset is None else dataclasses.replace(PRESETS[preset], nodes=nodes, gpus_per_node=gpus_per_node)
    for path in (os.environ.get("MICSCOMPILE_CLUSTER"), "local_cluster.json", CALIBRATION_CACHE.expanduser()):
        if path and Path(path).is_file():
            return dataclasses.replace(Cluster.load(path), nodes=nodes, gpus_per_node=gpus_per_node)
    return _cpu_estimate(world_size, gpus_per_node)
