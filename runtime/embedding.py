"""ShardedEmbeddings: the embedding tables of a plan, sharded over the ranks of a Comm.

Usage (every rank, same order of calls):

    comm = init_distributed(plan)
    emb = ShardedEmbeddings(plan, comm.rank, comm.world, comm=comm, seed=0)
    out = emb(batch.sparse)            # {feature: [b, out_dim]} for this rank's samples
    emb.prefetch(next_batch.sparse)    # optional: next batch's key traffic starts now
    loss.backward()                    # gradient traffic + fused sparse update, in place
    ...                                # optional: all-reduce the dense gradients here
    emb.finish_backward()              # dp exchanges complete (in flight until now)
    emb.bytes_moved()                  # {cluster: {"intra": n, "inter": n}} of that step

The embedding weights are not torch Parameters: the backward applies each table's own
optimizer (plan.tables[].optimizer) sparsely to the rows the global batch touched, so
the dense optimizer of the trainer must not see them. Every rank must run the backward
of every forward it runs with gradients enabled (the backward is collective).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from embark_runtime.cache import CacheStats
from embark_runtime.clusters import CLUSTER_KINDS, Cluster, DpCluster
from embark_runtime.comm import Comm, Traffic
from embark_runtime.distributor import BatchError, FeatureInput, prepare_batch
from embark_runtime.kernels import Kernels, TorchKernels
from embark_runtime.optim import STATE_NAMES, state_shape
from embark_runtime.optimizers import columns_may_be_cut
from embark_runtime.reference import ReferenceEmbeddings
from embark_runtime.storage import global_rows, load_into

__all__ = ["ReferenceEmbeddings", "ShardedEmbeddings", "PlanNotRunnable"]


class PlanNotRunnable(ValueError):
    """A valid plan that this runtime cannot execute as given (the message says why)."""


@dataclass
class _Step:
    feats: dict[str, FeatureInput]
    bvec: list[int]
    traffic: Traffic
    dists: dict[str, object] = field(default_factory=dict)
    saved: dict[str, dict] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)


@dataclass
class _Prefetched:
    batch: object
    step: _Step
    staged: bool = False
    """the host-tier cells' lookups of this step were made ahead (`_stage_prefetched`)"""


class _Lookup(torch.autograd.Function):
    """All clusters' forward and backward as one node of the autograd graph."""

    @staticmethod
    def forward(ctx, anchor: Tensor, module: ShardedEmbeddings, step: _Step):  # type: ignore[override]
        ctx.module = module
        ctx.step = step
        return tuple(module._forward_step(step))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.module._backward_step(ctx.step, grads)
        return None, None, None


def check_runnable(plan, world: int) -> None:
    if plan.world_size != world:
        raise PlanNotRunnable(
            f"the plan is for {plan.world_size} ranks "
            f"({plan.topology.nodes} nodes x {plan.topology.gpus_per_node}), the job has {world}"
        )
    for s in plan.shards:
        t = plan.table(s.table)
        if not columns_may_be_cut(t.optimizer) and s.columns != (0, t.dim):
            raise PlanNotRunnable(
                f"table `{t.name}` uses {t.optimizer}, whose accumulator is the mean over the "
                f"whole row, but the plan splits its columns ({list(s.columns)}); re-plan "
                f"without column sharding for it"
            )


class ShardedEmbeddings(torch.nn.Module):
    """The plan's tables on this rank. See the module docstring for the protocol."""

    def __init__(
        self,
        plan,
        rank: int,
        world: int,
        *,
        seed: int = 0,
        kernels: Kernels | None = None,
        device: str | torch.device = "cpu",
        overlap: bool = True,
        comm: Comm | None = None,
    ):
        super().__init__()
        check_runnable(plan, world)
        if comm is None:
            if world == 1:
                comm = Comm.local(device, plan.topology.gpus_per_node)
            else:
                created = Comm.create(plan.topology.gpus_per_node, device=device)
                assert created is not None
                comm = created
        if (comm.rank, comm.world) != (rank, world):
            raise PlanNotRunnable(
                f"rank {rank} of {world} given, but the Comm is rank {comm.rank} of {comm.world}"
            )
        if comm.gpus_per_node != plan.topology.gpus_per_node:
            raise PlanNotRunnable(
                f"the Comm has {comm.gpus_per_node} ranks per node, the plan {plan.topology.gpus_per_node}"
            )
        self.plan = plan
        self.rank = rank
        self.world = world
        self.comm = comm
        self.device = torch.device(device)
        self.kernels: Kernels = kernels if kernels is not None else TorchKernels()
        self.overlap = overlap
        self.clusters: list[Cluster] = [
            CLUSTER_KINDS[c.kind](plan, c, comm, self.kernels, seed, self.device)
            for c in plan.clusters
        ]
        self._anchor = torch.nn.Parameter(torch.zeros(0, device=self.device))
        self._prefetched: _Prefetched | None = None
        self._in_flight = False
        """a forward with gradients ran whose backward has not completed: the host-tier
        caches may not read ahead for the next step yet (its updates are still to come)"""
        self._pending: list[tuple[Cluster, object]] = []
        self._last = Traffic()

    # ------------------------------------------------------------------ steps
    def _distribute(self, batch_sparse) -> _Step:
        self.finish_backward()
        error: BatchError | None = None
        try:
            feats = prepare_batch(self.plan, batch_sparse, self.device)
            b = next(iter(feats.values())).b if feats else 0
        except BatchError as e:
            error, b = e, -1
        # every rank learns of a bad batch anywhere, so that no rank is left waiting
        bvec = [v[0] for v in self.comm.all_gather_ints([b])]
        if error is not None:
            raise error
        if -1 in bvec:
            raise BatchError(f"rank {bvec.index(-1)}'s batch is invalid (see its error)")
        step = _Step(feats, bvec, Traffic())
        for c in self.clusters:
            step.dists[c.name] = c.distribute(feats, bvec, step.traffic)
        return step

    def prefetch(self, next_batch_sparse) -> None:
        """Start the next batch's key traffic (and ub dedup) now; the next `forward` of the
        same batch object uses it. No-op when overlap is off. Collective."""
        if not self.overlap:
            return
        self._drop_prefetched()
        self._prefetched = _Prefetched(next_batch_sparse, self._distribute(next_batch_sparse))

    def _drop_prefetched(self) -> None:
        for c in self.clusters:
            c.clear_staged()
        if self._prefetched is not None:
            for d in self._prefetched.step.dists.values():
                for p in (
                    getattr(d, "keys", None),
                    getattr(d, "lengths", None),
                    getattr(d, "weights", None),
                    getattr(d, "positions", None),
                ):
                    if p is not None:
                        p.wait()
            self._prefetched = None

    def forward(self, batch_sparse) -> dict[str, Tensor]:  # type: ignore[override]
        if self._prefetched is not None and self._prefetched.batch is batch_sparse:
            step = self._prefetched.step
            self._prefetched = None
        else:
            self._drop_prefetched()
            step = self._distribute(batch_sparse)
        self._last = step.traffic
        self._in_flight = torch.is_grad_enabled()
        outs = _Lookup.apply(self._anchor, self, step)
        return dict(zip(step.outputs, outs, strict=True))

    def _forward_step(self, step: _Step) -> list[Tensor]:
        result: dict[str, Tensor] = {}
        for c in self.clusters:
            saved: dict = {}
            result.update(c.forward(step.dists[c.name], step.feats, step.bvec, step.traffic, saved))
            step.saved[c.name] = saved
        step.outputs = [f.name for f in self.plan.features]
        return [result[name] for name in step.outputs]

    def _backward_step(self, step: _Step, grads) -> None:
        g = {name: gr for name, gr in zip(step.outputs, grads, strict=True)}
        for name, fi in step.feats.items():
            if g[name] is None:
                out_dim = self.plan.table(fi.table).dim * (
                    fi.hotness if fi.pooling == "concat" else 1
                )
                g[name] = torch.zeros(fi.b, out_dim, dtype=self.kernels.accum, device=self.device)
        # dp exchanges go out first and complete last: they overlap the rb/ub traffic
        pending = [
            (c, c.start_backward(step.saved[c.name], step.feats, g, step.traffic))
            for c in self.clusters
            if isinstance(c, DpCluster)
        ]
        for c in self.clusters:
            if not isinstance(c, DpCluster):
                c.backward(step.saved[c.name], step.feats, g, step.bvec, step.traffic)  # type: ignore[attr-defined]
        step.saved.clear()
        self._in_flight = False
        self._pending = pending
        if not self.overlap:
            self.finish_backward()

    def finish_backward(self) -> None:
        """Complete the dp gradient exchanges of the last backward and apply their updates.

        With overlap on, the backward leaves them in flight so that they run while the
        caller all-reduces the dense model's gradients; the trainer calls this after that
        all-reduce. Every other entry point (forward, prefetch, bytes_moved, gathers,
        cells) calls it first, so forgetting it costs overlap, never correctness.
        Collective: every rank calls it at the same point.
        """
        pending, self._pending = self._pending, []
        for c, p in pending:
            c.finish_backward(p)  # type: ignore[attr-defined]
        self._stage_prefetched()

    def _stage_prefetched(self) -> None:
        """With the next batch prefetched and every update of the last step applied, the
        host-tier cells admit and read the next step's rows now (embark_runtime.cache):
        the fetches run before the next forward instead of in it. Exact, since nothing
        changes a row between here and that forward. Once per prefetched step."""
        p = self._prefetched
        if p is None or p.staged or self._in_flight or self._pending:
            return
        p.staged = True
        for c in self.clusters:
            if c.has_host_tier():
                c.stage(p.step.dists[c.name], p.step.bvec)

    # ------------------------------------------------------------------ inspection
    def bytes_moved(self) -> dict[str, dict[str, int]]:
        """Bytes this rank sent in the last step, per cluster (docs/communication.md)."""
        self.finish_backward()
        out = {c.name: {"intra": 0, "inter": 0} for c in self.plan.clusters}
        out.update(self._last.as_dict())
        return out

    def _cluster_of(self, table: str) -> Cluster:
        for c in self.clusters:
            if table in c.table_by_name:
                return c
        raise KeyError(f"no table `{table}` in the plan")

    def gather_table(self, name: str) -> Tensor:
        """The whole table [rows, dim] (fp32) on every rank. Collective; its optimizer
        state is not gathered (an export holds one table at a time, nothing more)."""
        return self._gather(name, state=False)[0]

    def gather_state(self, name: str) -> dict[str, Tensor]:
        """The table's whole optimizer state on every rank. Collective."""
        return self._gather(name)[1]

    def flush(self) -> None:
        """Complete the last backward and write every host-tier cache back, so that every
        cell's `weight` and `state` hold the current values (see embark_runtime.cache).
        Local: each rank flushes its own cells."""
        self.finish_backward()
        for c in self.clusters:
            for cell in c.cells.values():
                if cell.cache is not None:
                    cell.cache.flush()

    def invalidate_caches(self) -> None:
        """Forget every host-tier cache after the cells' host copies were overwritten (and
        the next step's lookups made ahead, which read the old values)."""
        if self._prefetched is not None:
            self._prefetched.staged = False
        for c in self.clusters:
            c.clear_staged()
            for cell in c.cells.values():
                if cell.cache is not None:
                    cell.cache.invalidate()

    def cache_stats(self) -> dict[str, CacheStats]:
        """This rank's host-tier cache counters per cluster since the last call (then
        reset); clusters without a host-tier cell are left out."""
        out: dict[str, CacheStats] = {}
        for c in self.clusters:
            for cell in c.cells.values():
                if cell.cache is not None:
                    out.setdefault(c.name, CacheStats()).add(cell.cache.take_stats())
        return out

    def _gather(self, name: str, state: bool = True) -> tuple[Tensor, dict[str, Tensor]]:
        """The table `name` and (with `state`, else {}) its optimizer state, whole."""
        self.flush()
        c = self._cluster_of(name)
        t = c.table_by_name[name]
        names = STATE_NAMES[t.optimizer] if state else ()
        if isinstance(c, DpCluster):
            cell = c.replica(name)
            kept = cell.state.items() if state else ()
            return cell.weight.float().clone(), {k: v.clone() for k, v in kept}
        weight = torch.zeros(t.rows, t.dim, device=self.device)
        states = {
            n: torch.zeros(state_shape(t.optimizer, n, t.rows, t.dim), device=self.device)
            for n in names
        }
        # every (row, column) is held by exactly one cell, so a sum over ranks assembles the
        # table; per-row state is replicated on the column cells of a row: take column 0's
        for key, cell in c.cells.items():
            if key.table != name:
                continue
            g = global_rows(
                t.rows, key.row_shard, cell.row_shards, self.plan.row_partition, self.device
            )
            weight[g, key.lo : key.hi] = cell.weight.float().to(self.device)
            for sname, s in cell.state.items():
                if sname not in states:
                    continue
                if s.dim() == 2:
                    states[sname][g, key.lo : key.hi] = s.to(self.device)
                elif key.lo == 0:
                    states[sname][g] = s.to(self.device)
        self.comm.all_reduce(weight)
        for sname in names:
            self.comm.all_reduce(states[sname])
        return weight, states

    # ------------------------------------------------------------------ checkpoint
    def cells(self) -> list:
        """This rank's cells as embark_runtime.checkpoint.CellState (dp tables on rank 0)."""
        from embark_runtime.checkpoint import CellState

        self.flush()
        out = []
        for c in self.clusters:
            if isinstance(c, DpCluster) and self.rank != 0:
                continue
            for key, cell in c.cells.items():
                out.append(
                    CellState(
                        table=key.table,
                        row_shard=key.row_shard,
                        row_shards=cell.row_shards,
                        columns=(key.lo, key.hi),
                        weight=cell.weight.detach().cpu().clone(),
                        state={k: v.detach().cpu().clone() for k, v in cell.state.items()},
                    )
                )
        return out

    def load_cells(self, cells) -> None:
        """Load CellState-like objects for exactly this rank's cells (and every dp table)."""
        self.finish_backward()
        mine = {}
        for c in self.clusters:
            for key, cell in c.cells.items():
                mine[(key.table, key.row_shard, cell.row_shards, (key.lo, key.hi))] = cell
        seen = set()
        for cs in cells:
            k = (cs.table, cs.row_shard, cs.row_shards, tuple(cs.columns))
            if k not in mine:
                raise ValueError(
                    f"cell of `{cs.table}` (row shard {cs.row_shard}/{cs.row_shards}, columns "
                    f"{list(cs.columns)}) is not held by rank {self.rank} under this plan"
                )
            load_into(
                mine[k],
                cs.weight.to(self.device),
                {n: s.to(self.device) for n, s in cs.state.items()},
                f"cell {k}",
            )
            seen.add(k)
        self.invalidate_caches()
        missing = sorted(set(mine) - seen, key=str)
        if missing:
            raise ValueError(f"rank {self.rank}: no values given for cell {missing[0]}")
