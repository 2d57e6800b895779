"""`embarkc report`: a plan as a page a person would rather look at than read.

    report_data(plan, program) -> ReportData      numbers only (no matplotlib), read from the
                                                  plan's view (embarkc.review.views.view_of)
    figures(data) -> {name: Figure}               matplotlib, Agg backend
    render_html(data) -> str                      one self-contained page (figures as base64 PNG)
    render_image(data, path)                      one composite PNG or SVG

The page needs no network: figures are embedded, the style sheet is inline, no script is
loaded. The tables x ranks heat map stays legible for 500 tables on 128 ranks: it shows
the `HEATMAP_TABLES` costliest tables one per row and folds the others into one row per
cluster kind.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from embark_runtime.plan import Plan
from embarkc.dense import iteration_lines
from embarkc.diagnostics import EmbarkError
from embarkc.ir import Program
from embarkc.planner import fixed_strategy_note
from embarkc.review.text import fmt_bytes, fmt_time, ranks_text
from embarkc.review.views import COMPONENTS, PlanView, view_of

HEATMAP_TABLES = 40
"""Tables shown one per row in the heat map; the rest are folded by cluster kind."""

COMPONENT_COLOURS = {
    "lookup": "#4c72b0",
    "distributor": "#dd8452",
    "nvlink": "#55a868",
    "network": "#c44e52",
    "dp_exchange": "#8172b3",
}
MEMORY_COLOURS = {"weights": "#4c72b0", "optimizer_state": "#dd8452", "buffers": "#937860"}


@dataclass
class ClusterRow:
    name: str
    kind: str
    communication: str
    tables: int
    parameters: int
    memory_bytes: int
    time: float | None


@dataclass
class TierRow:
    """One table with host-tier cells: where its cells live and what its caches hold."""

    table: str
    host_cells: int
    cells: int
    rows: int
    """rows of its host-tier cells, summed over them (a row of two column cells twice)"""
    cache_rows: int
    hbm_bytes: int
    """what its host-tier cells hold in HBM: their caches with their optimizer state"""
    host_bytes: int
    hit_rate: float | None
    """the estimate's expected hit rate (steady state); None without `estimate.host_tier`"""
    ranks: tuple[int, ...]

    @property
    def cache_share(self) -> float:
        return self.cache_rows / self.rows if self.rows else 0.0


@dataclass
class ReportData:
    """Everything the page shows, computed once."""

    label: str
    plan: Plan
    view: PlanView
    clusters: list[ClusterRow]
    heat: np.ndarray
    """rows of the heat map x ranks; each row sums to 1 (share of the row's total)."""
    heat_rows: list[str]
    heat_what: str
    """What a heat-map cell measures (work from the cost model, or parameters)."""
    memory_parts: dict[str, list[int]]
    """weights / optimizer_state / buffers per rank; just `memory` when the plan lacks them."""
    baselines: list[tuple[str, float]]
    """(label, step time), the plan's own first."""
    facts: list[tuple[str, str]] = field(default_factory=list)
    tiers: list[TierRow] = field(default_factory=list)
    """tables with host-tier cells, in plan order (empty: every cell in HBM)"""
    node_host_bytes: list[int] = field(default_factory=list)
    """host memory the host-tier cells take on each node (empty without them)"""


def tier_rows(plan: Plan) -> list[TierRow]:
    """The tables of `plan` with host-tier cells, counted from its shards; the expected
    hit rate from its estimate (`estimate.host_tier`) when it has one."""
    expected = {
        t["table"]: t.get("hit_rate")
        for t in (_extra(plan.estimate, "host_tier") or {}).get("tables", [])
    }
    out = []
    for t in plan.tables:
        cells = plan.shards_of(t.name)
        host = [c for c in cells if c.on_host]
        if not host:
            continue
        rows = [plan.row_count(c.table, c.row_shard, c.row_shards) for c in host]
        out.append(
            TierRow(
                table=t.name,
                host_cells=len(host),
                cells=len(cells),
                rows=sum(rows),
                cache_rows=sum(plan.cell_hbm_rows(c) for c in host),
                hbm_bytes=sum(t.bytes_for(plan.cell_hbm_rows(c), c.width) for c in host),
                host_bytes=sum(t.bytes_for(r, c.width) for r, c in zip(rows, host, strict=True)),
                hit_rate=expected.get(t.name),
                ranks=tuple(sorted({c.rank for c in host})),
            )
        )
    return out


def _extra(model: Any, key: str) -> Any:
    return (getattr(model, "model_extra", None) or {}).get(key)


def _table_rank_work(plan: Plan, program: Program | None) -> tuple[dict[str, np.ndarray], str]:
    """Per table, the amount of it on every rank: the seconds its cells put on their
    owners by the cost model when the program is known, else its parameters."""
    world = plan.world_size
    out: dict[str, np.ndarray] = {}
    cm = None
    if program is not None and [t.name for t in program.tables] == [t.name for t in plan.tables]:
        from embarkc.planner import cost

        cm = cost.CostModel(program)
    for t in plan.tables:
        row = np.zeros(world)
        cells = sorted(plan.shards_of(t.name), key=lambda s: (s.row_shard, s.columns[0]))
        if not cells:  # dp: the same on every rank
            row[:] = 1.0
        elif cm is not None:
            from embarkc.planner import cost

            cv = cm.cell_values(
                cm.facts[t.name],
                plan.cluster_of(t.name).kind,
                cells[0].row_shards,
                tuple((s.row_shard, s.columns[0], s.columns[1]) for s in cells),
                plan.cluster_of(t.name).communication == "hierarchical",
            )
            cluster = plan.cluster_of(t.name)
            hier = cluster.kind == "rb" and cluster.communication == "hierarchical"
            np.add.at(row, [s.rank for s in cells], cost.owner_seconds(cm, cv, hier))
        else:
            for s in cells:
                row[s.rank] += plan.row_count(t.name, s.row_shard, s.row_shards) * s.width
        out[t.name] = row
    if cm is not None:
        return out, "share of each table's work (cost-model seconds on the cells' owners)"
    return out, "share of each table's parameters (no spec given: work is not known)"


def _heat(plan: Plan, view: PlanView, work: dict[str, np.ndarray]) -> tuple[np.ndarray, list[str]]:
    def weight(name: str) -> tuple[float, int, str]:
        tv = view.tables[name]
        return (-(tv.time or 0.0), -tv.memory_bytes, name)

    names = sorted(work, key=weight)
    shown, rest = names[:HEATMAP_TABLES], names[HEATMAP_TABLES:]
    if len(rest) == 1:
        shown, rest = names, []
    rows, labels = [], []
    for name in shown:
        rows.append(work[name])
        labels.append(f"{name} ({view.tables[name].kind})")
    for kind in ("rb", "ub", "dp"):
        group = [n for n in rest if view.tables[n].kind == kind]
        if group:
            # each table counts once: its shares, not its absolute size, are summed
            rows.append(sum((_share(work[n]) for n in group), np.zeros(plan.world_size)))
            labels.append(f"{len(group)} other {kind} tables")
    heat = np.array([_share(r) for r in rows]) if rows else np.zeros((0, plan.world_size))
    return heat, labels


def _share(row: np.ndarray) -> np.ndarray:
    total = row.sum()
    return row / total if total > 0 else row


def report_data(plan: Plan, program: Program | None = None, label: str = "") -> ReportData:
    """Collect the page's numbers; `program` (when the plan came from a spec) lets the
    report re-cost a plan without our estimate fields and show work, not parameters."""
    view = view_of(plan, program)
    clusters = []
    for c in plan.clusters:
        times = [view.tables[n].time for n in c.tables]
        clusters.append(
            ClusterRow(
                name=c.name,
                kind=c.kind,
                communication=c.communication or c.gradient_exchange or "",
                tables=len(c.tables),
                parameters=sum(plan.table(n).rows * plan.table(n).dim for n in c.tables),
                memory_bytes=sum(view.tables[n].memory_bytes for n in c.tables),
                time=None if any(t is None for t in times) else sum(t or 0.0 for t in times),
            )
        )
    work, what = _table_rank_work(plan, program)
    heat, heat_rows = _heat(plan, view, work)

    parts: dict[str, list[int]] = {}
    raw = [_extra(r, "memory") for r in plan.estimate.per_rank]
    if len(raw) == plan.world_size and all(isinstance(m, dict) for m in raw):
        for key in MEMORY_COLOURS:
            parts[key] = [int(m.get(key, 0)) for m in raw]
    else:
        parts["memory"] = [r.memory_bytes for r in view.per_rank]

    planner = plan.planner
    baselines = [(f"this plan ({planner.strategy})", view.step_time)]
    greedy = _extra(planner, "greedy_step_time")
    if greedy is not None:
        baselines.append(("greedy start", float(greedy)))
    for name, t in sorted((_extra(planner, "baselines") or {}).items()):
        if t is not None:
            baselines.append((str(name), float(t)))

    topo = plan.topology
    bound = view.bound
    gap = (
        f" (gap {100 * (view.step_time - bound) / view.step_time:.1f} %)"
        if bound and view.step_time
        else ""
    )
    low = view.lower_bound
    lower = (
        f"; lower bound {fmt_time(low)} for any plan (this plan "
        f"{100 * (view.step_time / low - 1):.1f} % above it)"
        if low
        else ""
    )
    facts = [
        ("spec", plan.source.spec),
        (
            "cluster",
            f"{topo.nodes} nodes x {topo.gpus_per_node} GPUs ({plan.world_size} ranks), "
            f"{fmt_bytes(topo.hbm_bytes)} HBM at {topo.hbm_bandwidth / 1e12:.2f} TB/s, "
            f"NVLink {topo.intra_node_bandwidth / 1e9:.0f} GB/s, "
            f"network {topo.inter_node_bandwidth / 1e9:.1f} GB/s per GPU",
        ),
        ("batch", f"{plan.batch_size} samples per step"),
        (
            "embeddings",
            f"{len(plan.tables)} tables, {len(plan.features)} features, "
            f"{sum(t.rows * t.dim for t in plan.tables):,} parameters",
        ),
        (
            "predicted embedding step",
            f"{fmt_time(view.step_time)}, critical rank {view.critical_rank}"
            if view.critical_rank is not None
            else fmt_time(view.step_time),
        ),
        ("predicted iteration", "; ".join(iteration_lines(plan)[1:])),
        (
            "peak memory",
            f"{fmt_bytes(view.peak_memory)} of {fmt_bytes(topo.hbm_bytes)} per GPU "
            f"({100 * view.peak_memory / topo.hbm_bytes:.1f} %)",
        ),
        (
            "planner",
            f"{planner.strategy}, solver {planner.solver}, status {planner.status}, "
            f"{planner.wall_time:.1f} s"
            + (f"; {note}" if (note := fixed_strategy_note(planner)) else "")
            + lower
            + (
                f"; cp-sat bound {fmt_time(bound)}{gap} in its last model"
                if bound is not None
                else ""
            ),
        ),
        ("costs from", _source_text(view)),
    ]
    tiers = tier_rows(plan)
    node_host: list[int] = []
    if tiers:
        node_host = [0] * topo.nodes
        for rank, b in enumerate(plan.host_memory_by_rank()):
            node_host[rank // topo.gpus_per_node] += b
        cap = topo.host_memory_bytes
        facts.append(
            (
                "host tier",
                f"{sum(t.host_cells for t in tiers)} cells of {len(tiers)} tables in host "
                f"memory behind HBM caches of {fmt_bytes(sum(t.hbm_bytes for t in tiers))}; "
                f"the fullest node holds {fmt_bytes(max(node_host))}"
                + (f" of its {fmt_bytes(cap)}" if cap else ""),
            )
        )
    message = _extra(planner, "message")
    if message:
        facts.append(("planner says", str(message)))
    for v in _extra(planner, "ignored_constraints") or []:
        facts.append(("constraint ignored", f"({v['rule']}) {v['message']}"))
    return ReportData(
        label=label or plan.source.spec,
        plan=plan,
        view=view,
        clusters=clusters,
        heat=heat,
        heat_rows=heat_rows,
        heat_what=what,
        memory_parts=parts,
        baselines=baselines,
        facts=facts,
        tiers=tiers,
        node_host_bytes=node_host,
    )


def _source_text(view: PlanView) -> str:
    return {
        "plan": "the plan's own estimate",
        "cost model": "embarkc's cost model (the plan lacks our estimate fields, or its "
        "layout or estimate was edited after embarkc wrote it)",
        "contract": "the plan's contract fields only (no per-component or per-table costs)",
        "stale": "the plan's own estimate, which is STALE: its layout or its figures were "
        "edited after embarkc wrote it; give the spec to re-cost it",
    }[view.cost_source]


# --------------------------------------------------------------------------- figures


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.hashsalt": "embarkc", "font.size": 9})
    return plt


def _rank_ticks(ax: Any, world: int) -> None:
    step = max(1, world // 32)
    ax.set_xticks(range(0, world, step))
    ax.set_xlim(-0.6, world - 0.4)


def plot_time(ax: Any, d: ReportData) -> None:
    ranks = np.arange(d.plan.world_size)
    bottom = np.zeros(len(ranks))
    if all(r.components is not None for r in d.view.per_rank):
        for k in COMPONENTS:
            v = np.array([(r.components or {})[k] for r in d.view.per_rank]) * 1e3
            ax.bar(ranks, v, bottom=bottom, color=COMPONENT_COLOURS[k], label=k, width=0.85)
            bottom += v
    elif all(r.time is not None for r in d.view.per_rank):
        v = np.array([r.time for r in d.view.per_rank]) * 1e3
        ax.bar(ranks, v, color="#4c72b0", label="time (no components in the plan)", width=0.85)
    else:
        ax.bar(ranks, bottom, color="#4c72b0", label="no per-rank times in the plan", width=0.85)
    ax.axhline(d.view.step_time * 1e3, color="black", lw=0.8, ls="--", label="step time")
    if d.view.critical_rank is not None:
        ax.annotate(
            "critical",
            (d.view.critical_rank, d.view.step_time * 1e3),
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    _rank_ticks(ax, d.plan.world_size)
    ax.set_xlabel("rank")
    ax.set_ylabel("ms per step")
    ax.set_title("Time per rank by component")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_memory(ax: Any, d: ReportData) -> None:
    ranks = np.arange(d.plan.world_size)
    bottom = np.zeros(len(ranks))
    gib = float(1 << 30)
    for k, v in d.memory_parts.items():
        arr = np.array(v, dtype=np.float64) / gib
        ax.bar(
            ranks, arr, bottom=bottom, color=MEMORY_COLOURS.get(k, "#4c72b0"), label=k, width=0.85
        )
        bottom += arr
    ax.axhline(d.plan.topology.hbm_bytes / gib, color="#c44e52", lw=1.2, label="HBM capacity")
    _rank_ticks(ax, d.plan.world_size)
    ax.set_ylim(0, d.plan.topology.hbm_bytes / gib * 1.08)
    ax.set_xlabel("rank")
    ax.set_ylabel("GiB")
    ax.set_title("Memory per rank against capacity")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_host(ax: Any, d: ReportData) -> None:
    """Host memory per node against `host_memory`, by table (host-tier plans only)."""
    g = d.plan.topology.gpus_per_node
    nodes = np.arange(len(d.node_host_bytes))
    mib = float(1 << 20)
    bottom = np.zeros(len(nodes))
    colours = list(COMPONENT_COLOURS.values())
    for i, t in enumerate(d.tiers):
        per_node = np.zeros(len(nodes))
        table = d.plan.table(t.table)
        for c in d.plan.shards_of(t.table):
            if c.on_host:
                rows = d.plan.row_count(c.table, c.row_shard, c.row_shards)
                per_node[c.rank // g] += table.bytes_for(rows, c.width) / mib
        ax.bar(nodes, per_node, bottom=bottom, color=colours[i % len(colours)], label=t.table)
        bottom += per_node
    cap = d.plan.topology.host_memory_bytes
    if cap:
        ax.axhline(cap / mib, color="#c44e52", lw=1.2, label="host_memory")
    ax.set_xticks(nodes)
    ax.set_xlabel("node")
    ax.set_ylabel("MiB")
    ax.set_title("Host memory per node (host-tier cells with their optimizer state)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def plot_heat(ax: Any, d: ReportData, fig: Any) -> None:
    if d.heat.size == 0:
        ax.set_axis_off()
        return
    from matplotlib.colors import PowerNorm

    # a square-root scale keeps the small shares of widely split tables visible
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=max(float(d.heat.max()), 1e-12))
    im = ax.imshow(d.heat, aspect="auto", cmap="viridis", interpolation="nearest", norm=norm)
    ax.set_yticks(range(len(d.heat_rows)))
    ax.set_yticklabels(d.heat_rows, fontsize=7 if len(d.heat_rows) <= 30 else 5)
    _rank_ticks(ax, d.plan.world_size)
    ax.set_xlabel("rank")
    ax.set_title(f"Where the tables live: {d.heat_what}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, pad=0.01, label="share")


def plot_baselines(ax: Any, d: ReportData) -> None:
    labels = [b[0] for b in d.baselines]
    values = [b[1] * 1e3 for b in d.baselines]
    colours = ["#55a868"] + ["#8c8c8c"] * (len(values) - 1)
    y = np.arange(len(values))
    ax.barh(y, values, color=colours)
    # the planner's lower bound holds for any plan of the spec; CP-SAT's bound only for
    # the model it last solved (docs/plan.md), so it is drawn apart and named so
    lines = (
        (d.view.lower_bound, "lower bound (any plan)", "-"),
        (d.view.bound, "cp-sat bound (its last model)", ":"),
    )
    drawn = [(v * 1e3, label, ls) for v, label, ls in lines if v is not None and v > 0]
    for x, label, ls in drawn:
        ax.axvline(x, color="black", ls=ls, lw=1, label=label)
    if drawn:
        ax.legend(fontsize=7, loc="lower right")
    for yi, v in zip(y, values, strict=True):
        ax.text(v, yi, f" {v:.3g} ms", va="center", fontsize=7)
    ax.set_yticks(y)
    ax.set_yticklabels(labels)
    ax.invert_yaxis()
    ax.set_title(f"This plan beside the baselines (status: {d.plan.planner.status})")
    positive = [v for v in values if v > 0]
    if positive and max(positive) > 20 * min(positive):
        # one far-off baseline would flatten the others on a linear axis
        ax.set_xscale("log")
        ax.set_xlim(min(positive) / 1.5, max(positive) * 3)
        ax.set_xlabel("predicted ms per step (log scale)")
    else:
        ax.set_xlim(0, max(values) * 1.25 if positive else 1)
        ax.set_xlabel("predicted ms per step")


def _rank_width(world: int) -> float:
    return min(18.0, max(7.0, 0.12 * world + 4))


def figures(d: ReportData) -> dict[str, Any]:
    """One matplotlib Figure per panel of the page, by name."""
    plt = _pyplot()
    w = _rank_width(d.plan.world_size)
    out: dict[str, Any] = {}
    fig, ax = plt.subplots(figsize=(w, 3.4), layout="constrained")
    plot_time(ax, d)
    out["time"] = fig
    fig, ax = plt.subplots(figsize=(w, 3.0), layout="constrained")
    plot_memory(ax, d)
    out["memory"] = fig
    fig, ax = plt.subplots(
        figsize=(w, max(2.5, 0.16 * len(d.heat_rows) + 1.2)), layout="constrained"
    )
    plot_heat(ax, d, fig)
    out["heat"] = fig
    if d.tiers:
        fig, ax = plt.subplots(figsize=(7, 3.0), layout="constrained")
        plot_host(ax, d)
        out["host"] = fig
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(d.baselines) + 1.3), layout="constrained")
    plot_baselines(ax, d)
    out["baselines"] = fig
    return out


def _encode(fig: Any, fmt: str) -> bytes:
    buf = io.BytesIO()
    meta = {"Software": None} if fmt == "png" else {"Date": None, "Creator": None}
    fig.savefig(buf, format=fmt, dpi=110, metadata=meta)
    return buf.getvalue()


def render_html(d: ReportData) -> str:
    """The whole page: figures embedded as base64 PNG, inline CSS, no external resource."""
    import jinja2
    import matplotlib.pyplot as plt

    imgs = {}
    for name, fig in figures(d).items():
        imgs[name] = base64.b64encode(_encode(fig, "png")).decode("ascii")
        plt.close(fig)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(Path(str(files("embarkc.templates"))) / "report")),
        undefined=jinja2.StrictUndefined,
        autoescape=True,
        keep_trailing_newline=True,
    )
    top = sorted(d.view.tables.values(), key=lambda t: (-(t.time or 0.0), -t.memory_bytes, t.table))
    return env.get_template("report.html.j2").render(
        d=d,
        imgs=imgs,
        clusters=d.clusters,
        top_tables=top[:20],
        more_tables=max(0, len(top) - 20),
        fmt_time=fmt_time,
        fmt_bytes=fmt_bytes,
        ranks_text=_ranks_short,
    )


def _ranks_short(ranks: Iterable[int]) -> str:
    return ranks_text(tuple(ranks), 4)


def render_image(d: ReportData, path: Path) -> None:
    """One composite figure of every panel, as PNG or SVG by `path`'s suffix."""
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise EmbarkError.at(str(path), "the output must end in .html, .png or .svg")
    plt = _pyplot()
    w = _rank_width(d.plan.world_size)
    heat_h = max(2.5, 0.16 * len(d.heat_rows) + 1.2)
    base_h = 0.35 * len(d.baselines) + 1.3
    heights = [3.4, 3.0, heat_h] + ([3.0] if d.tiers else []) + [base_h]
    fig = plt.figure(figsize=(w, sum(heights) + 1.4), layout="constrained")
    grid = fig.add_gridspec(len(heights), 1, height_ratios=heights)
    plot_time(fig.add_subplot(grid[0]), d)
    plot_memory(fig.add_subplot(grid[1]), d)
    plot_heat(fig.add_subplot(grid[2]), d, fig)
    if d.tiers:
        plot_host(fig.add_subplot(grid[3]), d)
    plot_baselines(fig.add_subplot(grid[len(heights) - 1]), d)
    v = d.view
    fig.suptitle(
        f"{d.label}\n{fmt_time(v.step_time)} per step, peak {fmt_bytes(v.peak_memory)} of "
        f"{fmt_bytes(v.hbm_bytes)}, {len(d.plan.tables)} table{'s' if len(d.plan.tables) != 1 else ''} in "
        f"{len(d.clusters)} cluster{'s' if len(d.clusters) != 1 else ''} "
        f"on {d.plan.world_size} ranks, planner {d.plan.planner.status}",
        fontsize=10,
    )
    data = _encode(fig, fmt)
    plt.close(fig)
    _write(path, data)


def _write(path: Path, data: bytes) -> None:
    from embarkc.emit import write_output

    write_output(path, data, "the report")


def write_report(d: ReportData, path: Path) -> None:
    """Write the page (.html / .htm) or the composite figure (.png / .svg) to `path`."""
    if path.suffix.lower() in (".html", ".htm"):
        _write(path, render_html(d).encode("utf-8"))
    else:
        render_image(d, path)
