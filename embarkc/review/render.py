"""A `PlanDiff` as a pull-request comment (Markdown) and as JSON, and the lines that the
terminal renderer (`embarkc.review.terminal`) prints without their Markdown."""

from __future__ import annotations

import json
from typing import Any

from embark_runtime.formatting import format_pct
from embarkc.migration import Migration
from embarkc.review.compare import SAME_PCT, Change, PlanDiff, SpecChange, Summary, same_to_rounding
from embarkc.review.text import (
    arrow,
    fields_text,
    fmt_bytes,
    fmt_rate,
    fmt_time,
    int_or_dash,
    ranks_text,
)

MD_ROWS = 15
"""Rows shown per markdown table (a PR comment stays short; JSON has everything)."""


def _md_table(head: list[str], rows: list[list[str]], total: int | None = None) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows[:MD_ROWS]]
    n = len(rows) if total is None else total
    if n > MD_ROWS:
        out.append(f"\n_{n - MD_ROWS} more not shown; `--format json` has all of them._")
    return out


def render_markdown(d: PlanDiff) -> str:
    """A compact pull-request comment: the verdict on the first line, then the details."""
    lines = [d.verdict, ""]
    if d.identical:
        lines.append(f"`{d.a}` and `{d.b}` plan the same thing.")
        return "\n".join(lines) + "\n"
    s = d.summary
    lines.append(f"A: `{d.a}`, B: `{d.b}`")
    lines.append("")
    rows = [
        [
            "embedding step time",
            fmt_time(s.step_time.a),
            fmt_time(s.step_time.b),
            fmt_pct(s.step_time),
        ],
        [
            "critical path (phases wait)",
            fmt_time(s.critical_path.a),
            fmt_time(s.critical_path.b),
            fmt_pct(s.critical_path),
        ],
        *(
            [
                [
                    "iteration (with the dense part)",
                    fmt_time(s.iteration.a),
                    fmt_time(s.iteration.b),
                    fmt_pct(s.iteration),
                ],
                [
                    "samples/s",
                    fmt_rate(s.samples_per_second.a),
                    fmt_rate(s.samples_per_second.b),
                    fmt_pct(s.samples_per_second),
                ],
            ]
            if s.iteration.a is not None or s.iteration.b is not None
            else []
        ),
        [
            "peak memory / GPU",
            fmt_bytes(s.peak_memory.a),
            fmt_bytes(s.peak_memory.b),
            fmt_pct(s.peak_memory),
        ],
        ["HBM / GPU", fmt_bytes(s.hbm_bytes.a), fmt_bytes(s.hbm_bytes.b), fmt_pct(s.hbm_bytes)],
        ["ranks", str(d.world_a), str(d.world_b), ""],
        ["critical rank", int_or_dash(s.critical_rank_a), int_or_dash(s.critical_rank_b), ""],
    ]
    for name, c in s.components.items():
        rows.append([f"&nbsp;&nbsp;{name}", fmt_time(c.a), fmt_time(c.b), fmt_pct(c)])
    if s.lower_bound.a is not None or s.lower_bound.b is not None:
        rows.append(
            ["lower bound (any plan)", fmt_time(s.lower_bound.a), fmt_time(s.lower_bound.b), ""]
        )
    if s.bound.a is not None or s.bound.b is not None:
        rows.append(["cp-sat bound (its last model)", fmt_time(s.bound.a), fmt_time(s.bound.b), ""])
    rows.append(["planner status", s.status_a, s.status_b, ""])
    lines += _md_table(["", "A", "B", "change"], rows)
    if {"contract", "stale"} & {s.cost_source_a, s.cost_source_b}:
        lines += ["", cost_source_note(s)]

    if d.tables_changed:
        lines += ["", f"### Tables placed differently ({len(d.tables_changed)})", ""]
        lines += _md_table(
            ["table", "changed", "cluster", "grid", "ranks", "time", "memory"],
            [
                [
                    f"`{c.table}`",
                    ", ".join(c.changed),
                    arrow(c.kind_a, c.kind_b),
                    arrow(c.grid_a, c.grid_b),
                    arrow(ranks_text(c.ranks_a, 3), ranks_text(c.ranks_b, 3)),
                    f"{fmt_time(c.time.a)} -> {fmt_time(c.time.b)}",
                    f"{fmt_bytes(c.memory.a)} -> {fmt_bytes(c.memory.b)}",
                ]
                for c in d.tables_changed
            ],
        )
    if d.tables_delta:
        lines += ["", f"### Tables added, removed or resized ({len(d.tables_delta)})", ""]
        lines += _md_table(
            ["table", "", "cluster", "what", "memory"],
            [
                [
                    f"`{t.table}`",
                    t.change,
                    t.kind,
                    fields_text(t.fields),
                    arrow(fmt_bytes(t.memory.a), fmt_bytes(t.memory.b)),
                ]
                for t in d.tables_delta
            ],
        )
    if d.ranks_changed:
        lines += ["", f"### {ranks_title(d)}", ""]
        lines += _md_table(
            ["rank", "time", "change", "memory", "change"],
            [
                [
                    str(r.rank),
                    arrow(fmt_time(r.time.a), fmt_time(r.time.b)),
                    fmt_delta(r.time, fmt_time),
                    arrow(fmt_bytes(r.memory.a), fmt_bytes(r.memory.b)),
                    fmt_delta(r.memory, fmt_bytes),
                ]
                for r in d.ranks_changed
            ],
        )
    lines += ["", "### Migration from a checkpoint of A", ""]
    lines += migration_lines(d.migration)
    if d.spec_changes:
        title = (
            "Spec changes"
            if d.spec_changes_from == "specs"
            else "Input changes recorded in the plans"
        )
        lines += ["", f"### {title} ({len(d.spec_changes)})", ""]
        lines += [spec_line(c) for c in d.spec_changes[:MD_ROWS]]
        if len(d.spec_changes) > MD_ROWS:
            lines.append(f"- ... {len(d.spec_changes) - MD_ROWS} more")
    lines += [f"\n_{line}_" for line in not_compared_lines(d)]
    return "\n".join(lines) + "\n"


def fmt_pct(c: Change) -> str:
    """A change in percent; "=" below SAME_PCT, "new" from 0, "-" when a side lacks it."""
    if c.pct is None:
        if c.a is None or c.b is None:
            return "-"
        return "=" if c.a == c.b else "new"
    if abs(c.pct) < SAME_PCT:
        return "="
    return f"{format_pct(c.pct, signed=True)} %"


def fmt_delta(c: Change, fmt: Any) -> str:
    """A change as a signed difference written with `fmt` ("=" when none)."""
    if c.delta is None:
        return "new" if c.a is None and c.b is not None else "-"
    if c.delta == 0:
        return "="
    sign = "+" if c.delta > 0 else "-"
    return f"{sign}{fmt(abs(c.delta))}"


def not_compared_lines(d: PlanDiff) -> list[str]:
    """One line per plan that lacks input fields the other records."""
    return [
        f"Plan {side} does not record {', '.join(names)} (fields of embarkc's own, or of a "
        "newer embarkc): they are not compared."
        for side, names in d.not_compared.items()
    ]


def ranks_title(d: PlanDiff) -> str:
    """The heading of the rank table: how many ranks it lists, of how many, and how each
    of them changed (the parts add up to the rows listed)."""
    counts = dict.fromkeys(("worse", "better", "the same to rounding", "only in B", "only in A"), 0)
    for r in d.ranks_changed:
        if r.memory.a is None:
            counts["only in B"] += 1
        elif r.memory.b is None:
            counts["only in A"] += 1
        elif r.worse:
            counts["worse"] += 1
        elif (r.memory.delta or 0) < 0 or (
            (r.time.delta or 0) < 0 and not same_to_rounding(r.time.a, r.time.b)
        ):
            counts["better"] += 1
        else:
            counts["the same to rounding"] += 1
    parts = ", ".join(f"{n} {what}" for what, n in counts.items() if n)
    return f"Ranks: {len(d.ranks_changed)} of {max(d.world_a, d.world_b)} changed ({parts})"


def cost_source_note(s: Summary) -> str:
    notes = []
    for kind, text in (
        (
            "contract",
            "carries only the contract's estimate and no spec was given to re-cost it: "
            "components and per-table costs are not shown.",
        ),
        (
            "stale",
            "was edited after embarkc costed it (its estimate is of another layout) and the "
            "spec it names (source.spec, relative to where it was planned; looked for from "
            "here and from the plan's folder) was not found unchanged to re-cost it: its "
            "times are those of the layout before the edit, its memory is exact. Run the diff "
            "where that spec is found to see the new costs.",
        ),
    ):
        sides = [n for n, src in (("A", s.cost_source_a), ("B", s.cost_source_b)) if src == kind]
        if sides:
            notes.append(f"_Plan {' and '.join(sides)} {text}_")
    return "\n".join(notes)


def migration_lines(m: Migration) -> list[str]:
    if not m.total_bytes:
        out = ["Nothing moves between ranks."]
    else:
        out = [
            f"{fmt_bytes(m.total_bytes)} move between ranks ({fmt_bytes(m.weight_bytes)} weights, "
            f"{fmt_bytes(m.state_bytes)} optimizer state): {fmt_bytes(m.intra_node_bytes)} "
            f"inside nodes, {fmt_bytes(m.inter_node_bytes)} across nodes.",
        ]
        cross = [f for f in m.by_node if f.src != f.dst][:5]
        if cross:
            out.append(
                "Busiest node pairs: "
                + ", ".join(f"node {f.src} -> {f.dst} {fmt_bytes(f.bytes)}" for f in cross)
                + "."
            )
        top = m.by_table[:5]
        out.append(
            "Largest tables: " + ", ".join(f"`{t.table}` {fmt_bytes(t.bytes)}" for t in top) + "."
        )
    h = m.host_hbm
    if h is not None and h.total_bytes:
        out.append(
            f"{fmt_bytes(h.total_bytes)} host <-> HBM bytes copied on their ranks "
            f"({fmt_bytes(h.to_hbm_bytes)} into HBM, {fmt_bytes(h.to_host_bytes)} into host "
            "memory): "
            + ", ".join(
                f"`{t.table}` {fmt_bytes(t.to_hbm_bytes + t.to_host_bytes)}" for t in h.by_table[:5]
            )
            + "."
        )
    elif h is not None:
        out.append(
            "Nothing moves between host memory and HBM on a rank (a cache size changes no "
            "bytes: caches refill from the host copy)."
        )
    if m.fresh_tables:
        out.append(f"Start from their initialiser: {', '.join(f'`{t}`' for t in m.fresh_tables)}.")
    if m.fresh_state_tables:
        out.append(
            "Optimizer changed, state starts fresh: "
            + ", ".join(f"`{t}`" for t in m.fresh_state_tables)
            + "."
        )
    return out


def spec_line(c: SpecChange) -> str:
    subject = c.what if c.name == c.what else f"{c.what} `{c.name}`"
    if c.change == "removed":
        return f"- {subject} removed"
    text = fields_text(c.fields)
    return f"- {subject} {c.change}" + (f": {text}" if text else "")


def render_json(d: PlanDiff) -> str:
    """The whole diff as deterministic JSON (sorted keys, newline at the end)."""
    data = d.model_dump(mode="json")
    data["migration"]["total_bytes"] = d.migration.total_bytes
    if d.migration.host_hbm is None:
        del data["migration"]["host_hbm"]  # an all-HBM diff reads as it did
    else:
        data["migration"]["host_hbm"]["total_bytes"] = d.migration.host_hbm.total_bytes
    if not d.not_compared:
        del data["not_compared"]
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
