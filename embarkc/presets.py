"""Named hardware presets: `hardware { preset dgx_h100 }`, any field overridable.

Values are in the IR's units (bytes, bytes per second per GPU per direction). A preset
describes one node; `nodes` defaults to 1 and is almost always overridden.

Sources:
* H100 SXM5 80 GB: 80 GiB HBM3 at 3.35 TB/s; NVLink 4 at 900 GB/s bidirectional, i.e.
  450 GB/s per direction per GPU; DGX H100 has one ConnectX-7 NDR 400 Gb/s NIC per GPU.
  (NVIDIA H100 datasheet; DGX H100 user guide.)
* H200 SXM 141 GB: 141 GB HBM3e at 4.8 TB/s, same NVLink 4 and NDR networking as the
  DGX H100 (NVIDIA H200 datasheet; DGX H200 user guide).
* A100 SXM4 80 GB: 80 GiB HBM2e at 2.039 TB/s; NVLink 3 at 600 GB/s bidirectional,
  300 GB/s per direction; DGX A100 has one ConnectX-6 HDR 200 Gb/s NIC per GPU.
* Host memory (`host_memory`, per node): 2 TB of DDR5 in a DGX H100 / H200 and 2 TB of
  DDR4 in a DGX A100 640 GB (the three user guides), counted as 2 TiB. Host bandwidth
  (`host_bandwidth`, per GPU per direction): each GPU sits on its own PCIe x16 link,
  Gen5 on H100 / H200 (64 GB/s raw, ~55 GB/s measured), Gen4 on A100 (32 GB/s raw,
  ~27 GB/s measured). A Grace Hopper superchip reaches its LPDDR5X over NVLink-C2C at
  450 GB/s per direction (GH200 datasheet): write `host_bandwidth 450 GB/s`.
* Dense compute (`dense_flops`, fp32 without tensor cores, the trainer's precision):
  67 TFLOP/s for H100 SXM5 and H200 SXM (same GH100 die and clocks), 19.5 TFLOP/s for
  A100 SXM4 (the three datasheets).
"""

from __future__ import annotations

GiB = 1 << 30
TiB = 1 << 40
GB = 10**9

PRESETS: dict[str, dict[str, int | float | str]] = {
    "dgx_h100": {
        "nodes": 1,
        "gpus_per_node": 8,
        "hbm_bytes": 80 * GiB,
        "hbm_bandwidth": 3.35e12,
        "intra_node_bandwidth": 450e9,
        "inter_node_bandwidth": 400e9 / 8,
        "host_memory": 2 * TiB,
        "host_bandwidth": 55e9,
        "dense_flops": 67e12,
        "arch": "sm_90",
    },
    "dgx_h200": {
        "nodes": 1,
        "gpus_per_node": 8,
        "hbm_bytes": 141 * GB,
        "hbm_bandwidth": 4.8e12,
        "intra_node_bandwidth": 450e9,
        "inter_node_bandwidth": 400e9 / 8,
        "host_memory": 2 * TiB,
        "host_bandwidth": 55e9,
        "dense_flops": 67e12,
        "arch": "sm_90",
    },
    "dgx_a100_80gb": {
        "nodes": 1,
        "gpus_per_node": 8,
        "hbm_bytes": 80 * GiB,
        "hbm_bandwidth": 2.039e12,
        "intra_node_bandwidth": 300e9,
        "inter_node_bandwidth": 200e9 / 8,
        "host_memory": 2 * TiB,
        "host_bandwidth": 27e9,
        "dense_flops": 19.5e12,
        "arch": "sm_80",
    },
}
