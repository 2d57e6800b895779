"""Every constant of the cost model, with its unit and where it comes from.

Hardware numbers (HBM size and bandwidth, NVLink and network bandwidth) come from the
spec's topology; these constants say how much of a peak a real kernel or collective
reaches, and fixed latencies. The ones that depend on the machine (`TUNABLE`) are
defaults: the spec's `hardware` block may set each (`embarkc calibrate` writes a block of
measured ones), and `of(topology)` gives the values a cost is computed with. The
simulator (`embarkc simulate`) uses the same values, from the plan's topology.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

HBM_EFFICIENCY = 0.80
"""Fraction of peak HBM bandwidth that a gather/scatter embedding kernel sustains.
Source: HugeCTR and FBGEMM TBE forward kernels reach 75-85 % of peak on A100/H100 at
dim >= 64 (EMBark paper, section 5; FBGEMM TBE benchmarks). Measured here: embarkc's own
pooled forward at dim 128 (65,536 bags of 8 over a 2 GB table) moved 3.96 TB/s on an
H200, 82 % of its 4.8 TB/s peak (bench/results_gpu.md, 2026-12-04)."""

SMALL_VECTOR_BYTES = 64
"""Below this many bytes per row access (16 fp32), a row read still costs one 64-byte
sector pair of DRAM traffic: gathers are served in 32-byte sectors, two per access."""

NVLINK_EFFICIENCY = 0.75
"""Fraction of per-direction NVLink bandwidth that NCCL all-to-all reaches inside a
DGX node at message sizes of 1 MiB and up (nccl-tests alltoall_perf on DGX H100)."""

NETWORK_EFFICIENCY = 0.80
"""Fraction of per-GPU NIC bandwidth (InfiniBand NDR 400 Gb/s per GPU on DGX H100) that
NCCL all-to-all reaches across nodes for large messages (nccl-tests, 2-16 nodes)."""

KERNEL_LAUNCH_SECONDS = 5e-6
"""Fixed cost of one kernel launch on the GPU (CUDA launch latency, a few microseconds)."""

COLLECTIVE_LATENCY_SECONDS = 20e-6
"""Fixed cost of one NCCL collective call (ring/all-to-all setup), intra node."""

INTER_NODE_LATENCY_SECONDS = 10e-6
"""Extra fixed cost per collective step that crosses the network (IB hop latency)."""

OPTIMIZER_PASSES = {"sgd": 1, "adagrad": 2, "rowwise_adagrad": 1, "adam": 3}
"""Tensors of a row's width read and written by the update: weights plus full-width
state (adagrad's accumulator, adam's two moments)."""

KEY_BYTES = 8
LENGTH_BYTES = 4
WEIGHT_BYTES = 4
WIRE_ELEMENT_BYTES = 4
"""Wire sizes, as in docs/communication.md."""

DENSE_EFFICIENCY = 0.70
"""Fraction of the GPU's peak fp32 FLOP/s (`hardware.dense_flops`) that the dense part's
GEMMs sustain. The trainer computes in fp32 without TF32 (torch's default matmul
precision), where cuBLAS SGEMM reaches 70-80 % of peak on large square-ish problems
(cuBLAS performance notes); the DLRM layers are 64K x 1K x 1K-class GEMMs. Taken at the
low end: it only sets how much key traffic the model lets hide (dense.prefetch_window)."""

HOST_BANDWIDTH = 55e9
"""Host <-> GPU copy rate per GPU per direction (bytes/s) when the hardware gives
`host_memory` but no `host_bandwidth`: pinned-memory copies over PCIe Gen5 x16 reach
about 55 GB/s of its 64 GB/s (embarkc.presets, the DGX H100 and H200 presets' value)."""

BACKWARD_FLOPS_FACTOR = 2.0
"""Backward FLOPs per forward FLOP of a linear layer: one GEMM for the input gradient and
one for the weight gradient, each the forward's size."""


# --------------------------------------------------------------------------- settable

TUNABLE: dict[str, tuple[str, str, float]] = {
    "hbm_efficiency": ("hbm_efficiency", "count", HBM_EFFICIENCY),
    "nvlink_efficiency": ("nvlink_efficiency", "count", NVLINK_EFFICIENCY),
    "network_efficiency": ("network_efficiency", "count", NETWORK_EFFICIENCY),
    "dense_efficiency": ("dense_efficiency", "count", DENSE_EFFICIENCY),
    "kernel_launch": ("kernel_launch_seconds", "time", KERNEL_LAUNCH_SECONDS),
    "collective_latency": ("collective_latency_seconds", "time", COLLECTIVE_LATENCY_SECONDS),
    "network_latency": ("inter_node_latency_seconds", "time", INTER_NODE_LATENCY_SECONDS),
    "min_read": ("small_vector_bytes", "bytes", SMALL_VECTOR_BYTES),
}
"""The constants above that a spec's `hardware` block may set (a calibrated hardware file
from `embarkc calibrate` does): spec keyword -> (field of `Constants` and of a plan's
`topology.constants`, the unit kind the spec writes it in, the default). Efficiencies
are fractions in (0, 1]; the three times are seconds; `min_read` is bytes."""


@dataclass(frozen=True)
class Constants:
    """The cost model's hardware-dependent constants for one topology: the defaults above,
    each replaced by the value the spec's `hardware` block gives."""

    hbm_efficiency: float = HBM_EFFICIENCY
    nvlink_efficiency: float = NVLINK_EFFICIENCY
    network_efficiency: float = NETWORK_EFFICIENCY
    dense_efficiency: float = DENSE_EFFICIENCY
    kernel_launch_seconds: float = KERNEL_LAUNCH_SECONDS
    collective_latency_seconds: float = COLLECTIVE_LATENCY_SECONDS
    inter_node_latency_seconds: float = INTER_NODE_LATENCY_SECONDS
    small_vector_bytes: float = SMALL_VECTOR_BYTES


DEFAULTS = Constants()


def of(topology: Any) -> Constants:
    """The constants of a topology (an `ir.Topology` or a plan file's topology): its
    `constants` overrides, {field: value}, over the defaults. A topology without any
    (every plan written before they existed) costs with the defaults."""
    given = getattr(topology, "constants", None) or {}
    return replace(DEFAULTS, **dict(given)) if given else DEFAULTS
