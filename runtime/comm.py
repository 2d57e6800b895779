"""Collectives of the runtime, with the byte accounting of docs/communication.md.

A `Comm` is one process group of W ranks (the plan's ranks 0..W-1 are the group's ranks)
with the topology's node and rail subgroups: rank r is on node r // gpus_per_node at
local index r % gpus_per_node; a node group holds the ranks of one node, a rail group
the ranks of all nodes with one local index. On one machine the topology alone decides
the nodes, so 4 CPU processes with gpus_per_node=2 are two "nodes" and the hierarchical
path runs for real.

Counting (docs/communication.md): a byte is counted once, at the sender, per message to
another rank, intra-node when both ranks share a node. `all_to_all` counts the payload it
actually sends (callers put exactly the documented items on the wire: int64 keys, int32
bag lengths, fp32 weights and vectors); exchanges of sizes and other bookkeeping pass
`traffic=None` and are not counted. The documented exchanges of gradients are
`hierarchical_all_reduce` (dense dp tables and the dense model: reduce-scatter in the
node, ring all-reduce of each chunk on its rail, all-gather in the node) and
`rail_all_gather` (sparse dp tables: across nodes on the rail, then in the node); both
count exactly the bytes docs/communication.md assigns to each message. The in-node
phases are all-to-alls, counted as sent; the rail all-reduce runs the backend's own
algorithm and is counted as the doc's ring. `all_reduce` (a flat all-reduce over the
world) is for uncounted bookkeeping; when asked to count, it counts a flat ring (every
rank sends 2 (W-1)/W S bytes to its successor).

Every collective can run asynchronously (`async_op=True` returns a `Pending`); on gloo
and NCCL the work of one group is matched across ranks by issue order, so callers issue
collectives in the same order on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

SCOPES = ("world", "node", "rail")


@dataclass
class Traffic:
    """Bytes sent by this rank in one step, per cluster: {"intra": n, "inter": n}."""

    bytes: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, cluster: str, intra: bool, nbytes: int) -> None:
        entry = self.bytes.setdefault(cluster, {"intra": 0, "inter": 0})
        entry["intra" if intra else "inter"] += int(nbytes)

    def merge(self, other: Traffic) -> None:
        for cluster, entry in other.bytes.items():
            self.add(cluster, True, entry["intra"])
            self.add(cluster, False, entry["inter"])

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in sorted(self.bytes.items())}


class Pending:
    """An issued collective; `wait()` returns its result (once)."""

    def __init__(self, works: Sequence[object], finish):
        self._works = works
        self._finish = finish
        self._result = None
        self._done = False

    def wait(self):
        if not self._done:
            for w in self._works:
                w.wait()  # type: ignore[attr-defined]
            self._result = self._finish()
            self._done = True
        return self._result


class CommError(RuntimeError):
    """The process layout does not match the plan, or a collective was misused."""


class Comm:
    """A group of `world` ranks with node and rail subgroups. Build it with `Comm.create`
    (collective over the default group) or `Comm.local()` (one process, no torch.distributed)."""

    def __init__(
        self,
        rank: int,
        world: int,
        gpus_per_node: int,
        device: torch.device,
        group: object | None = None,
        node_group: object | None = None,
        rail_group: object | None = None,
        distributed: bool = True,
    ):
        self.rank = rank
        self.world = world
        self.gpus_per_node = gpus_per_node
        self.device = device
        self.group = group
        self.node_group = node_group
        self.rail_group = rail_group
        self.distributed = distributed

    # ------------------------------------------------------------------ topology
    @property
    def nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def node_ranks(self, node: int) -> list[int]:
        g = self.gpus_per_node
        return list(range(node * g, min(self.world, (node + 1) * g)))

    def rail_ranks(self, local: int) -> list[int]:
        g = self.gpus_per_node
        return [n * g + local for n in range(self.nodes) if n * g + local < self.world]

    def peers(self, scope: str) -> list[int]:
        """The ranks of this rank's `scope` group, in group order."""
        if scope == "world":
            return list(range(self.world))
        if scope == "node":
            return self.node_ranks(self.node_of(self.rank))
        if scope == "rail":
            return self.rail_ranks(self.local_of(self.rank))
        raise CommError(f"unknown scope {scope!r}; expected one of {SCOPES}")

    def _group(self, scope: str) -> object | None:
        return {"world": self.group, "node": self.node_group, "rail": self.rail_group}[scope]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def local(device: str | torch.device = "cpu", gpus_per_node: int = 1) -> Comm:
        """A single-rank Comm that never touches torch.distributed."""
        return Comm(0, 1, gpus_per_node, torch.device(device), distributed=False)

    @staticmethod
    def create(
        gpus_per_node: int, ranks: Sequence[int] | None = None, device: str | torch.device = "cpu"
    ) -> Comm | None:
        """Build a Comm over global `ranks` (default: all) of the initialised default group.

        Collective: every process of the default group must call it with the same
        arguments (torch creates subgroups collectively); non-members get None.
        """
        if not dist.is_initialized():
            raise CommError("torch.distributed is not initialised (use init_distributed)")
        me = dist.get_rank()
        members = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        world = len(members)
        if gpus_per_node <= 0:
            raise CommError(f"gpus_per_node must be positive, got {gpus_per_node}")
        full = world == dist.get_world_size() and members == sorted(members)
        group = None if full else dist.new_group(members)
        nodes = -(-world // gpus_per_node)
        node_groups = []
        for n in range(nodes):
            idx = list(range(n * gpus_per_node, min(world, (n + 1) * gpus_per_node)))
            node_groups.append(dist.new_group([members[i] for i in idx]))
        rail_groups = []
        for local in range(gpus_per_node):
            idx = [
                n * gpus_per_node + local for n in range(nodes) if n * gpus_per_node + local < world
            ]
            rail_groups.append(dist.new_group([members[i] for i in idx]) if idx else None)
        if me not in members:
            return None
        rank = members.index(me)
        return Comm(
            rank,
            world,
            gpus_per_node,
            torch.device(device),
            group=group,
            node_group=node_groups[rank // gpus_per_node],
            rail_group=rail_groups[rank % gpus_per_node],
        )

    # ------------------------------------------------------------------ collectives
    def all_to_all(
        self,
        chunks: Sequence[Tensor],
        recv_counts: Sequence[int],
        *,
        scope: str = "world",
        traffic: Traffic | None = None,
        cluster: str = "",
        async_op: bool = False,
    ) -> Pending | list[Tensor]:
        """Send 1-D `chunks[i]` to the i-th rank of `scope`; receive `recv_counts[i]`
        elements from it. Returns the received chunks (or a Pending of them)."""
        peers = self.peers(scope)
        if len(chunks) != len(peers) or len(recv_counts) != len(peers):
            raise CommError(f"all_to_all over {scope} needs {len(peers)} chunks, got {len(chunks)}")
        dtype = chunks[0].dtype if chunks else torch.float32
        send_counts = [int(c.numel()) for c in chunks]
        if traffic is not None:
            size = torch.empty((), dtype=dtype).element_size()
            for peer, n in zip(peers, send_counts, strict=True):
                if peer != self.rank and n:
                    traffic.add(cluster, self.same_node(peer, self.rank), n * size)
        recv = [int(n) for n in recv_counts]
        if not self.distributed or len(peers) == 1:
            out = [c.reshape(-1).clone() for c in chunks]
            return Pending([], lambda: out) if async_op else out
        send = torch.cat([c.reshape(-1) for c in chunks]) if chunks else torch.empty(0)
        buf = torch.empty(sum(recv), dtype=dtype, device=send.device)
        work = dist.all_to_all_single(
            buf, send, recv, send_counts, group=self._group(scope), async_op=True
        )
        pending = Pending([work], lambda: list(torch.split(buf, recv)))
        return pending if async_op else pending.wait()

    def all_reduce(self, tensor: Tensor, *, async_op: bool = False) -> Pending | Tensor:
        """Sum `tensor` in place over the world, uncounted (control data and gathers;
        counted gradient traffic goes through `hierarchical_all_reduce`)."""
        if not self.distributed or self.world == 1:
            return Pending([], lambda: tensor) if async_op else tensor
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        pending = Pending([work], lambda: tensor)
        return pending if async_op else pending.wait()

    def hierarchical_all_reduce(
        self,
        tensor: Tensor,
        *,
        traffic: Traffic | None = None,
        cluster: str = "",
        segments: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Pending | Tensor:
        """Sum the contiguous `tensor` in place over the world by the hierarchical
        all-reduce of docs/communication.md (dp `dense`, and the dense model).

        `segments`: the element counts of the logical all-reduces packed one after the
        other in `tensor` (one per dp table; default: the whole tensor is one). Each
        segment of E elements is cut into G chunks (numpy's array_split) and each chunk
        into N parts, as the doc says; the rank with local index i gathers chunk i of every
        segment. Phases: (1) reduce-scatter in the node, an all-to-all of chunks summed in
        local-index order; (2) all-reduce of the rank's chunks with its rail peers (the
        backend's algorithm, counted as the doc's ring over the nodes); (3) all-gather in
        the node, an all-to-all sending the reduced chunks to every other rank of the node.
        Every rank ends with the same values. With `async_op`, phase 1 is issued now and
        phases 2 and 3 run in `wait()`: every rank must call `wait()` at the same point
        of its sequence of collectives.
        """
        if not tensor.is_contiguous():
            raise CommError("hierarchical_all_reduce needs a contiguous tensor (it works in place)")
        flat = tensor.view(-1)
        segs = [flat.numel()] if segments is None else [int(n) for n in segments]
        if sum(segs) != flat.numel() or any(n < 0 for n in segs):
            raise CommError(
                f"segments {segs} do not add up to the tensor's {flat.numel()} elements"
            )
        if self.world == 1:
            return Pending([], lambda: tensor) if async_op else tensor
        g = self.gpus_per_node
        if self.world % g:
            raise CommError(
                f"a hierarchical all-reduce needs whole nodes: {self.world} ranks, {g} per node"
            )
        nodes, me_i, me_n = self.world // g, self.local_of(self.rank), self.node_of(self.rank)
        starts = [sum(segs[:s]) for s in range(len(segs))]
        cuts = [chunk_bounds(n, g) for n in segs]
        # chunk i of the packed tensor: chunk i of every segment, segment after segment
        send = [
            _cat1(
                [flat[st + c[i] : st + c[i + 1]] for st, c in zip(starts, cuts, strict=True)],
                flat,
            )
            for i in range(g)
        ]
        sizes = [sum(c[i + 1] - c[i] for c in cuts) for i in range(g)]
        phase1 = self.all_to_all(
            send, [sizes[me_i]] * g, scope="node", traffic=traffic, cluster=cluster, async_op=True
        )
        assert isinstance(phase1, Pending)

        def finish() -> Tensor:
            got = phase1.wait()
            reduced = got[0].clone()
            for part in got[1:]:
                reduced += part
            if nodes > 1:
                if traffic is not None:
                    size = flat.element_size()
                    for c in cuts:
                        e = c[me_i + 1] - c[me_i]
                        parts = chunk_bounds(e, nodes)
                        kept = [parts[p + 1] - parts[p] for p in range(nodes)]
                        # the ring's reduce-scatter half sends every part but (n+1) % N,
                        # its all-gather half every part but (n+2) % N (N = 2: E_i in all)
                        skip = kept[(me_n + 1) % nodes] + kept[(me_n + 2) % nodes]
                        traffic.add(cluster, False, size * (2 * e - skip))
                if self.distributed and reduced.numel():
                    dist.all_reduce(reduced, group=self.rail_group)
            gathered = self.all_to_all(
                [reduced] * g, sizes, scope="node", traffic=traffic, cluster=cluster
            )
            assert isinstance(gathered, list)
            for i, piece in enumerate(gathered):
                pos = 0
                for st, c in zip(starts, cuts, strict=True):
                    n = c[i + 1] - c[i]
                    flat[st + c[i] : st + c[i + 1]] = piece[pos : pos + n]
                    pos += n
            return tensor

        pending = Pending([], finish)
        return pending if async_op else pending.wait()

    def rail_all_gather(
        self,
        tensor: Tensor,
        *,
        lengths: Sequence[int] | None = None,
        traffic: Traffic | None = None,
        cluster: str = "",
        async_op: bool = False,
    ) -> Pending | list[Tensor]:
        """Every rank's 1-D `tensor`, in rank order, by the rail all-gather of
        docs/communication.md (dp `sparse`): (1) the rank sends its tensor to each of its
        rail peers; (2) it sends the rail's tensors it then holds to every other rank of
        its node. `lengths`: every rank's element count when the caller knows them
        (otherwise exchanged here as uncounted bookkeeping). With `async_op`, phase 1 is
        issued now and phase 2 runs in `wait()` (same point on every rank)."""
        flat = tensor.reshape(-1)
        if self.world == 1:
            out = [flat.clone()]
            return Pending([], lambda: out) if async_op else out
        if lengths is None:
            counts = [v[0] for v in self.all_gather_ints([flat.numel()])]
        else:
            counts = [int(n) for n in lengths]
        if len(counts) != self.world or counts[self.rank] != flat.numel():
            raise CommError(
                f"rail_all_gather: lengths {counts} do not match {self.world} ranks with "
                f"{flat.numel()} elements on rank {self.rank}"
            )
        rail = self.peers("rail")
        node = self.peers("node")
        phase1 = self.all_to_all(
            [flat] * len(rail),
            [counts[p] for p in rail],
            scope="rail",
            traffic=traffic,
            cluster=cluster,
            async_op=True,
        )
        assert isinstance(phase1, Pending)

        def finish() -> list[Tensor]:
            held = _cat1(phase1.wait(), flat)
            sources = {q: self.rail_ranks(self.local_of(q)) for q in node}
            got = self.all_to_all(
                [held] * len(node),
                [sum(counts[r] for r in sources[q]) for q in node],
                scope="node",
                traffic=traffic,
                cluster=cluster,
            )
            assert isinstance(got, list)
            out: list[Tensor] = [flat] * self.world
            for q, buf in zip(node, got, strict=True):
                pos = 0
                for r in sources[q]:
                    out[r] = buf[pos : pos + counts[r]]
                    pos += counts[r]
            return out

        pending = Pending([], finish)
        return pending if async_op else pending.wait()

    def all_gather_ints(self, values: Sequence[int]) -> list[list[int]]:
        """Bookkeeping (not counted): every rank's list of ints (same length everywhere)."""
        t = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        if not self.distributed or self.world == 1:
            return [t.tolist()]
        bufs = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(bufs, t, group=self.group)
        return [b.tolist() for b in bufs]

    def barrier(self) -> None:
        if self.distributed and self.world > 1:
            dist.barrier(group=self.group)


def chunk_bounds(elements: int, parts: int) -> list[int]:
    """Boundaries of numpy's array_split of `elements` into `parts` consecutive chunks
    (the first `elements % parts` chunks one longer): chunk i is [b[i], b[i+1])."""
    q, r = divmod(elements, parts)
    return [i * q + min(i, r) for i in range(parts + 1)]


def _cat1(parts: Sequence[Tensor], like: Tensor) -> Tensor:
    if not parts:
        return like.new_empty(0)
    return torch.cat([p.reshape(-1) for p in parts])


def init_distributed(plan, device: str | None = None, timeout_s: float = 600.0) -> Comm:
    """Join the job started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
    on nccl for a CUDA `device` (or, with none given, when CUDA is available) and gloo
    otherwise, and build the plan's node and rail groups.

    Raises CommError when the job's world size is not the plan's
    (topology.nodes * topology.gpus_per_node).
    """
    if not dist.is_initialized():
        missing = [
            k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ
        ]
        if missing:
            raise CommError(
                f"environment variables {', '.join(missing)} are not set: start the trainer "
                f"with `torchrun --nproc-per-node N ...`"
            )
        # the device decides: NCCL only moves CUDA tensors, so a CPU run on a CUDA
        # machine (train.py --device cpu) needs gloo
        on_cuda = torch.device(device).type == "cuda" if device else torch.cuda.is_available()
        backend = "nccl" if on_cuda else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world != plan.world_size:
        raise CommError(
            f"the job has {world} processes but the plan is for {plan.world_size} ranks "
            f"({plan.topology.nodes} nodes x {plan.topology.gpus_per_node} GPUs); start "
            f"{plan.world_size} processes or re-plan for {world}"
        )
    if device is None:
        if dist.get_backend() == "nccl":
            local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
            torch.cuda.set_device(local)
            device = f"cuda:{local}"
        else:
            device = "cpu"
    comm = Comm.create(plan.topology.gpus_per_node, device=device)
    assert comm is not None
    return comm
