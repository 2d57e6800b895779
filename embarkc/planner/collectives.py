"""Bytes and seconds of the collectives a plan runs, per rank, on a DGX-like topology.

Pure functions of the payload, the topology (`G` GPUs per node, `N` nodes) and the
effective bandwidths (peak times efficiency, bytes/s, see `constants.py`). The bytes are
those docs/communication.md defines (who sends what to whom); the seconds are what one
rank spends on its links. Every GPU has its own NVLink port and its own NIC (a "rail"):
DGX H100 has 8 ConnectX-7 400 Gb/s NICs, one per GPU, and NCCL uses all of them.

* `allreduce`: hierarchical, the shape NCCL's multi-channel rings and trees take on such
  nodes (NCCL_ALGO Ring or Tree, several channels):
  reduce-scatter inside the node over NVLink, all-reduce of the node's 1/G share across
  nodes on each GPU's own rail, all-gather inside the node. Three sequential phases.
  (NCCL's topology search builds its rings and trees inside a node over NVLink and
  leaves the node through the NIC closest to the GPU, one channel per NIC; a flat ring
  over W ranks sends `2(W-1)/W * S / G` per NIC, within 1/N of the hierarchical form.)
* `allgather`: NCCL runs all-gather as rings, one channel per NIC; a node-ordered ring
  sends `(W-1)/G` messages per NIC and `(G-1)(W-1)/G` over NVLink per rank. The rail
  all-gather below (exchange with the rail peers of other nodes, then share everything
  inside the node) moves the same bytes within one message per link and has a simple
  who-sends-what, so it defines the bytes. Two sequential phases.
* `alltoall_seconds`: every rank talks to every rank at once over full-duplex links, so
  the busier direction of each link decides; intra- and inter-node parts add (the
  cost model's all-to-all, unchanged).
Fixed latencies are not included: the cost model adds one per collective call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Traffic:
    """What one rank does in one collective."""

    intra: float
    """Bytes the rank sends over NVLink (to ranks of its node)."""
    inter: float
    """Bytes the rank sends over its own NIC (to ranks of other nodes)."""
    seconds: float
    """Time of the collective on the rank's links (without fixed latencies)."""


def allreduce(size: float, G: int, N: int, bw_intra: float, bw_inter: float) -> Traffic:
    """Hierarchical all-reduce of `size` bytes on N nodes of G GPUs.

    Per rank: reduce-scatter inside the node sends `(G-1)/G * size` over NVLink; the ring
    all-reduce of the rank's `size/G` chunk among its N rail peers sends
    `2(N-1)/N * size/G` over the NIC; the all-gather inside the node sends
    `(G-1)/G * size` over NVLink again. The phases run one after the other, so their
    times add. On one node this is NVLink's ring all-reduce, `2(G-1)/G * size`; with one
    GPU per node, the flat ring over the NICs, `2(N-1)/N * size`.
    """
    if G * N <= 1 or size <= 0:
        return Traffic(0.0, 0.0, 0.0)
    intra = 2.0 * (G - 1) / G * size
    inter = 2.0 * (N - 1) / N * size / G
    return Traffic(intra, inter, intra / bw_intra + inter / bw_inter)


def allgather(message: float, G: int, N: int, bw_intra: float, bw_inter: float) -> Traffic:
    """Rail all-gather of `message` bytes from every rank to every rank.

    Per rank: phase 1 sends its message to its N-1 rail peers (the ranks with the same
    local index on the other nodes), `(N-1) * message` over the NIC; phase 2 sends the N
    messages it then holds (its own and its rail peers') to each of the G-1 other ranks
    of its node, `(G-1) * N * message` over NVLink. Times of the two phases add.
    """
    if G * N <= 1 or message <= 0:
        return Traffic(0.0, 0.0, 0.0)
    inter = (N - 1) * message
    intra = (G - 1) * N * message
    return Traffic(intra, inter, intra / bw_intra + inter / bw_inter)


def alltoall_seconds(
    sent_intra: np.ndarray | float,
    received_intra: np.ndarray | float,
    sent_inter: np.ndarray | float,
    received_inter: np.ndarray | float,
    bw_intra: float,
    bw_inter: float,
) -> np.ndarray:
    """Seconds of one all-to-all phase per rank, from its bytes sent and received.

    Links are full duplex: each link's time is its busier direction over its bandwidth;
    NVLink's and the NIC's times add (conservative: overlap of the two is not counted).
    """
    return np.asarray(
        np.maximum(sent_intra, received_intra) / bw_intra
        + np.maximum(sent_inter, received_inter) / bw_inter,
        dtype=np.float64,
    )
