"""Cluster assignment: which kind (dp, rb, ub) and grid bounds each table may take.

`Unit`s are what the search places: one table, or the tables of a `colocate` group, which
share kind, grid and ranks. `allowed_kinds` and `grid_bounds` turn the spec's constraints
into the search space; `initial_kinds` picks each unit's starting kind by the cost
model (the kind with the least total work over all ranks), never by size thresholds;
the search then revisits kinds as moves. `check_fits` raises the infeasibility error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from embark_runtime.formatting import format_bytes
from embark_runtime.optimizers import columns_may_be_cut
from embarkc.diagnostics import Diagnostic, EmbarkError, Span
from embarkc.ir import Program
from embarkc.planner.cost import CostModel, aggregator_seconds, owner_seconds
from embarkc.planner.types import Kind, column_widths


class NoFit(EmbarkError):
    """The tables find no placement in the cluster's HBM (the error says why): where the
    hardware gives host memory, the planner puts tables there instead
    (`embarkc.planner.tiers`)."""

    @staticmethod
    def at(path: str, message: str, hint: str | None = None) -> NoFit:
        return NoFit(Diagnostic(message, Span.of_file(path), hint))


@dataclass(frozen=True)
class Unit:
    """Tables placed together: one table, or a colocate group (same kind, grid, ranks)."""

    tables: tuple[str, ...]
    kinds: tuple[Kind, ...]
    """Kinds the constraints allow, in preference order for ties."""
    min_r: int
    max_r: int
    min_c: int
    max_c: int
    within_node: bool

    @property
    def name(self) -> str:
        return self.tables[0]


def _unit_error(
    prog: Program, names: tuple[str, ...], message: str, hint: str | None = None
) -> EmbarkError:
    """An EmbarkError about the constraints of the unit `names`, at the colocate group that
    joins them (or the first of their constraints) when the spec says where."""
    spans = [c.span for c in prog.colocate if set(c.tables) & set(names) and c.span]
    spans += [c.span for n in names if (c := prog.constraint_of.get(n)) is not None and c.span]
    if not spans:
        return EmbarkError.at(prog.sources[0].path, message, hint=hint)
    return EmbarkError(Diagnostic(message, spans[0].to_span(), hint))


def units_of(cm: CostModel) -> list[Unit]:
    """The program's units in table declaration order, with their constraint bounds."""
    prog = cm.program
    group_of: dict[str, tuple[str, ...]] = {}
    for col in prog.colocate:
        members = tuple(sorted(set(col.tables), key=lambda n: cm.facts[n].index))
        merged = set(members)
        for n in members:
            merged |= set(group_of.get(n, ()))
        g = tuple(sorted(merged, key=lambda n: cm.facts[n].index))
        for n in g:
            group_of[n] = g
    out: list[Unit] = []
    seen: set[str] = set()
    for t in prog.tables:
        if t.name in seen:
            continue
        names = group_of.get(t.name, (t.name,))
        seen.update(names)
        kinds: set[str] = {"dp", "rb", "ub"}
        min_r, max_r, min_c, max_c, within = 1, max(cm.W, 1) * 64, 1, 1 << 30, False
        # what set each bound, for the message when they contradict
        why = {"min_r": "", "max_r": "the planner (64 per GPU)", "min_c": "", "max_c": ""}
        for n in names:
            tab = prog.table_by_name[n]
            c = prog.constraint_of.get(n)
            if max(1, tab.dim // 4) < max_c:
                max_c, why["max_c"] = max(1, tab.dim // 4), f"{n} (dim {tab.dim})"
            if not columns_may_be_cut(tab.optimizer.kind) and max_c > 1:
                max_c, why["max_c"] = 1, f"{n} ({tab.optimizer.kind})"
            if tab.rows < max_r:
                max_r, why["max_r"] = tab.rows, f"{n} ({tab.rows:,} rows)"
            if c is None:
                continue
            if c.cluster is not None:
                kinds &= {c.cluster}
            if c.min_row_shards > min_r:
                min_r, why["min_r"] = c.min_row_shards, n
            if c.max_row_shards is not None and c.max_row_shards < max_r:
                max_r, why["max_r"] = c.max_row_shards, n
            if c.min_column_shards > min_c:
                min_c, why["min_c"] = c.min_column_shards, n
            if c.max_column_shards is not None and c.max_column_shards < max_c:
                max_c, why["max_c"] = c.max_column_shards, n
            within = within or c.within_node
        if within and cm.nodes > 1:
            # a dp table lives on every rank, so on several nodes it is never within one
            if kinds == {"dp"}:
                raise _unit_error(
                    prog,
                    names,
                    f"{', '.join(names)}: cluster dp puts a table on every node, which "
                    "contradicts within_node",
                    hint="drop within_node or pin the table to rb or ub",
                )
            kinds.discard("dp")
        if not kinds:
            raise _unit_error(
                prog,
                names,
                f"tables {', '.join(names)} are colocated but pinned to different clusters",
                hint="the planner places a colocate group as one unit of one cluster kind; "
                "pin them to the same kind or drop the colocate",
            )
        if min_r > max_r or min_c > max_c:
            what = []
            if min_r > max_r:
                what.append(
                    f"{why['min_r']} asks for at least {min_r} row shards, "
                    f"{why['max_r']} allows at most {max_r}"
                )
            if min_c > max_c:
                what.append(
                    f"{why['min_c']} asks for at least {min_c} column shards, "
                    f"{why['max_c']} allows at most {max_c}"
                )
            raise _unit_error(
                prog,
                names,
                f"the shard bounds of {', '.join(names)} contradict each other: " + "; ".join(what),
                hint="a colocate group shares one grid: relax the bounds or drop the colocate"
                if len(names) > 1
                else None,
            )
        if "dp" in kinds and (min_r > 1 or min_c > 1):
            kinds.discard("dp")
        ordered = tuple(k for k in ("rb", "ub", "dp") if k in kinds)
        out.append(Unit(names, ordered, min_r, max_r, min_c, max_c, within))  # type: ignore[arg-type]
    return out


def unit_bytes(cm: CostModel, u: Unit) -> float:
    return float(sum(cm.program.table_by_name[n].bytes for n in u.tables))


def default_comm(cm: CostModel, kind: str) -> str:
    """The communication a unit of `kind` starts with: the spec's when it names one; under
    `auto` hierarchical ub on several nodes (each node's ids deduplicated before the
    network) and flat rb (the search tries the other as a move)."""
    mode = cm.program.options.communication
    if mode != "auto":
        return mode
    return "hierarchical" if kind == "ub" and cm.nodes > 1 else "flat"


def sharded_total_seconds(
    cm: CostModel, u: Unit, kind: str, r: int, c: int, ub_comm: str | None = None
) -> float:
    """Total seconds (over all ranks) that the unit costs as kind rb/ub on an r x c grid,
    with the kind's starting communication (`default_comm`, or `ub_comm` for ub)."""
    total = 0.0
    comm = ub_comm if ub_comm is not None else default_comm(cm, kind)
    node_dedup = kind == "ub" and comm == "hierarchical"
    G, N = cm.G, cm.nodes
    for n in u.tables:
        tf = cm.facts[n]
        widths = column_widths(tf.dim, c)
        offs = [sum(widths[:k]) for k in range(c)]
        cells = tuple((j, offs[k], offs[k] + widths[k]) for j in range(r) for k in range(c))
        cv = cm.cell_values(tf, kind, r, cells, node_dedup)
        total += float(owner_seconds(cm, cv).sum()) + cm.W * cv.hbm_all / cm.bw_hbm
        if cv.node_dedup:
            # the N - 1 aggregators of every cell: their HBM work and their NVLink side
            # (their network side is the owner's, counted once as every link is)
            keys = cm.keys_beyond_window((G - 1) * cv.dist / cm.bw_intra)
            total += (N - 1) * float((aggregator_seconds(cm, cv) + keys).sum())
    return total


def dp_total_seconds(cm: CostModel, u: Unit) -> float:
    total = 0.0
    for n in u.tables:
        tf = cm.facts[n]
        dv = cm.dp_values(tf, cm.best_exchange(tf))
        total += cm.W * (dv.hbm / cm.bw_hbm + dv.exchange_time)
    return total


def dp_bytes(cm: CostModel, u: Unit) -> float:
    """Memory a dp unit puts on every rank (weights, state, buffers)."""
    total = 0.0
    for n in u.tables:
        tf = cm.facts[n]
        dv = cm.dp_values(tf, cm.best_exchange(tf))
        total += dv.weights + dv.state + dv.buf
    return total


def initial_grid(cm: CostModel, u: Unit) -> tuple[int, int]:
    """Smallest grid within bounds whose cells take at most half a GPU.

    Columns are split first: a column split keeps the forward bytes of the table the
    same, while every row shard adds one more partial vector per sample.
    """
    need = max(1, math.ceil(unit_bytes(cm, u) / (0.5 * cm.capacity)))
    c = max(u.min_c, min(u.max_c, need))
    r = max(u.min_r, min(u.max_r, math.ceil(need / c)))
    return r, c


def initial_kinds(
    cm: CostModel, units: list[Unit], allow_dp: bool = True, ub_comm: str | None = None
) -> dict[str, str]:
    """Each unit's starting kind: the allowed kind with the least total work.

    dp is taken only while the replicated tables leave every rank room for its share of
    the sharded ones (dp memory is paid on every rank); without `allow_dp` only for the
    units pinned to dp.
    """
    choice: dict[str, str] = {}
    dp_cands: list[tuple[float, int, Unit]] = []
    sharded_bytes = 0.0
    for i, u in enumerate(units):
        r, c = initial_grid(cm, u)
        costs: dict[str, float] = {
            k: sharded_total_seconds(cm, u, k, r, c, ub_comm) for k in u.kinds if k != "dp"
        }
        best = min(costs, key=lambda k: (costs[k], u.kinds.index(k))) if costs else None
        if "dp" in u.kinds and (allow_dp or best is None):
            dpc = dp_total_seconds(cm, u)
            if best is None or dpc < costs[best]:
                gain = (costs[best] - dpc) if best is not None else math.inf
                dp_cands.append((-gain, i, u))
        choice[u.name] = best or "dp"
        sharded_bytes += unit_bytes(cm, u)
    budget = cm.capacity - sharded_bytes / cm.W
    used = 0.0
    for _, _, u in sorted(dp_cands, key=lambda x: (x[0], x[1])):
        b = dp_bytes(cm, u)
        pinned = u.kinds == ("dp",)
        if pinned or used + b + unit_bytes(cm, u) / cm.W <= budget * 0.9:
            choice[u.name] = "dp"
            used += b
            budget += unit_bytes(cm, u) / cm.W
    return choice


def smaller_tables(cm: CostModel) -> list[str]:
    """What would make the tables themselves smaller, with what it saves: fp16 weights for
    fp32 tables, an optimizer with less state."""
    prog = cm.program
    out = []
    fp32 = sum(t.rows * t.dim * 2 for t in prog.tables if t.dtype == "fp32")
    if fp32:
        out.append(f"fp16 weights (saves {format_bytes(fp32)})")
    state = float(prog.embedding_bytes) - sum(t.rows * t.row_weight_bytes for t in prog.tables)
    if state > 0:
        out.append(
            f"an optimizer with less state (sgd or rowwise_adagrad; state is {format_bytes(state)})"
        )
    return out


def check_fits(cm: CostModel, units: list[Unit]) -> None:
    """Raise EmbarkError when the tables cannot fit, saying what would make them fit."""
    prog = cm.program
    # a host-tier table holds its caches' share of its bytes in HBM
    total = float(sum(t.bytes * cm.tiers.get(t.name, 1.0) for t in prog.tables))
    have = cm.capacity * cm.W
    dp_pinned = sum(dp_bytes(cm, u) for u in units if u.kinds == ("dp",))
    if dp_pinned > cm.capacity:
        raise EmbarkError.at(
            prog.sources[0].path,
            f"the tables pinned to dp need {format_bytes(dp_pinned)} on every GPU, "
            f"more than the {format_bytes(cm.capacity)} a GPU has for embeddings",
            hint="shard some of them (cluster rb or ub) or lower memory_headroom",
        )
    if total <= have:
        # whether the cells and every rank's buffers pack is the search's to say
        return
    weights = float(
        sum(t.rows * t.row_weight_bytes * cm.tiers.get(t.name, 1.0) for t in prog.tables)
    )
    state = total - weights
    gpus = math.ceil(total / cm.capacity)
    nodes = math.ceil(gpus / cm.G)
    fixes = [f"at least {nodes} nodes of {cm.G} GPUs ({nodes * cm.G} GPUs) instead of {cm.nodes}"]
    fixes += smaller_tables(cm)
    raise NoFit.at(
        prog.sources[0].path,
        f"the embedding tables need {format_bytes(total)} ({format_bytes(weights)} of weights, "
        f"{format_bytes(state)} of optimizer state), but {cm.W} GPUs x "
        f"{format_bytes(cm.capacity)} hold only {format_bytes(have)}",
        hint="it would fit with " + "; or ".join(fixes),
    )
