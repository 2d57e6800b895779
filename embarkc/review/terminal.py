"""A `PlanDiff` on a terminal: rich tables, coloured only when the console is a terminal."""

from __future__ import annotations

from typing import Any

from embarkc.review.compare import SAME_PCT, Change, PlanDiff
from embarkc.review.render import (
    cost_source_note,
    fmt_pct,
    migration_lines,
    not_compared_lines,
    ranks_title,
    spec_line,
)
from embarkc.review.text import (
    arrow,
    fields_text,
    fmt_bytes,
    fmt_rate,
    fmt_time,
    int_or_dash,
    ranks_text,
)


def render_terminal(d: PlanDiff, console: Any) -> None:
    """Print the diff with rich tables on `console` (colour only when it is a terminal)."""
    from rich.table import Table
    from rich.text import Text

    def coloured(c: Change, text: str, worse_when_up: bool = True) -> Text:
        if c.delta is None or c.delta == 0 or (c.pct is not None and abs(c.pct) < SAME_PCT):
            return Text(text)
        up = c.delta > 0
        return Text(text, style="red" if up == worse_when_up else "green")

    verdict = d.verdict.replace("**", "")
    console.print(Text(verdict, style="bold"))
    if d.identical:
        return
    console.print(f"A: {d.a}\nB: {d.b}")
    s = d.summary
    t = Table(title="Predicted step", title_justify="left")
    for h in ("", "A", "B", "change"):
        t.add_column(h, justify="right" if h else "left")
    t.add_row(
        "embedding step time",
        fmt_time(s.step_time.a),
        fmt_time(s.step_time.b),
        coloured(s.step_time, fmt_pct(s.step_time)),
    )
    t.add_row(
        "critical path (phases wait)",
        fmt_time(s.critical_path.a),
        fmt_time(s.critical_path.b),
        coloured(s.critical_path, fmt_pct(s.critical_path)),
    )
    if s.iteration.a is not None or s.iteration.b is not None:
        t.add_row(
            "iteration (with the dense part)",
            fmt_time(s.iteration.a),
            fmt_time(s.iteration.b),
            coloured(s.iteration, fmt_pct(s.iteration)),
        )
        t.add_row(
            "samples/s",
            fmt_rate(s.samples_per_second.a),
            fmt_rate(s.samples_per_second.b),
            fmt_pct(s.samples_per_second),
        )
    t.add_row(
        "peak memory / GPU",
        fmt_bytes(s.peak_memory.a),
        fmt_bytes(s.peak_memory.b),
        coloured(s.peak_memory, fmt_pct(s.peak_memory)),
    )
    t.add_row("HBM / GPU", fmt_bytes(s.hbm_bytes.a), fmt_bytes(s.hbm_bytes.b), fmt_pct(s.hbm_bytes))
    t.add_row("ranks", str(d.world_a), str(d.world_b), "")
    t.add_row("critical rank", int_or_dash(s.critical_rank_a), int_or_dash(s.critical_rank_b), "")
    for name, c in s.components.items():
        t.add_row(f"  {name}", fmt_time(c.a), fmt_time(c.b), coloured(c, fmt_pct(c)))
    if s.lower_bound.a is not None or s.lower_bound.b is not None:
        t.add_row(
            "lower bound (any plan)", fmt_time(s.lower_bound.a), fmt_time(s.lower_bound.b), ""
        )
    if s.bound.a is not None or s.bound.b is not None:
        t.add_row("cp-sat bound (its last model)", fmt_time(s.bound.a), fmt_time(s.bound.b), "")
    t.add_row("planner status", s.status_a, s.status_b, "")
    console.print(t)
    if {"contract", "stale"} & {s.cost_source_a, s.cost_source_b}:
        for note in cost_source_note(s).splitlines():
            console.print(note.strip("_"))

    if d.tables_changed:
        t = Table(
            title=f"Tables placed differently ({len(d.tables_changed)})", title_justify="left"
        )
        for h in (
            "table",
            "changed",
            "cluster",
            "grid",
            "ranks",
            "time A",
            "time B",
            "memory A",
            "memory B",
        ):
            t.add_column(h)
        for tc in d.tables_changed:
            t.add_row(
                tc.table,
                ", ".join(tc.changed),
                arrow(tc.kind_a, tc.kind_b),
                arrow(tc.grid_a, tc.grid_b),
                arrow(ranks_text(tc.ranks_a, 3), ranks_text(tc.ranks_b, 3)),
                fmt_time(tc.time.a),
                coloured(tc.time, fmt_time(tc.time.b)),
                fmt_bytes(tc.memory.a),
                coloured(tc.memory, fmt_bytes(tc.memory.b)),
            )
        console.print(t)
    if d.tables_delta:
        t = Table(title="Tables added, removed or resized", title_justify="left")
        for h in ("table", "", "cluster", "what", "memory"):
            t.add_column(h)
        for x in d.tables_delta:
            t.add_row(
                x.table,
                x.change,
                x.kind,
                fields_text(x.fields),
                arrow(fmt_bytes(x.memory.a), fmt_bytes(x.memory.b)),
            )
        console.print(t)
    if d.ranks_changed:
        t = Table(title=ranks_title(d), title_justify="left")
        for h in ("rank", "time A", "time B", "memory A", "memory B"):
            t.add_column(h, justify="right")
        for r in d.ranks_changed[:30]:
            t.add_row(
                str(r.rank),
                fmt_time(r.time.a),
                coloured(r.time, fmt_time(r.time.b)),
                fmt_bytes(r.memory.a),
                coloured(r.memory, fmt_bytes(r.memory.b)),
            )
        console.print(t)
        if len(d.ranks_changed) > 30:
            console.print(f"... {len(d.ranks_changed) - 30} more ranks changed (--format json)")
    console.print(Text("Migration from a checkpoint of A", style="bold"))
    for line in migration_lines(d.migration):
        console.print(line.replace("`", ""))
    if d.spec_changes:
        title = (
            "Spec changes"
            if d.spec_changes_from == "specs"
            else "Input changes recorded in the plans"
        )
        console.print(Text(title, style="bold"))
        for sc in d.spec_changes:
            console.print(spec_line(sc).replace("`", ""))
    for line in not_compared_lines(d):
        console.print(line)
