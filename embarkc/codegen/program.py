"""Plan -> render spec -> text of the generated training program (train.py, launch.sh, README).

`program_render_spec(program, plan)` is the only place that spells Python and shell values
for these templates: every value in the returned dict is already text in the target
language (a Python literal, a quoted shell word) or a plain number/string for prose. The
templates in templates/program/ only place them. `render_program` renders the templates
with the one Jinja environment of `embarkc.codegen`.

What is baked into train.py: the digest of the plan (`embark_runtime.plan.plan_digest`)
and what the plan does not say, the dense model (with the width each feature feeds it)
and its optimizer. The layout travels once, in plan.json; the trainer
(embark_runtime.trainer) refuses a plan.json whose digest is not the one baked in (a plan
edited or replaced after compiling), so a train.py cannot silently run with a plan it
was not compiled for.
"""

from __future__ import annotations

import math
import re
from typing import Any

from embark_runtime.formatting import format_bytes, format_ms
from embark_runtime.plan import Plan, plan_digest
from embarkc.dense import iteration_of
from embarkc.diagnostics import EmbarkError
from embarkc.emit import GeneratedFile, printable
from embarkc.ir import Program

TEMPLATES = ("train.py", "launch.sh", "README.md")
"""Files rendered from templates/program/<name>.j2."""


def py(value: Any) -> str:
    """A Python literal for a str, int, float, bool, None or (nested) tuple/list of those.

    Floats use repr (the shortest text that reads back to the same double), lowercase
    exponents as ruff format writes them; tuples of one element keep their comma. Strings
    are double-quoted, as ruff format writes them, with what is not printable escaped as
    repr escapes it (`printable`): a newline in a value cannot end the literal.
    """
    if value is None or isinstance(value, bool | int):
        return repr(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot spell {value!r} as a Python literal")
        return repr(value)
    if isinstance(value, str):
        return '"' + printable(value).replace('"', '\\"') + '"'
    if isinstance(value, tuple | list):
        items = ", ".join(py(v) for v in value)
        return f"({items},)" if len(value) == 1 else f"({items})"
    raise TypeError(f"cannot spell {type(value).__name__} as a Python literal")


LINE_WIDTH = 88
"""Generated Python keeps its lines within ruff format's default width (88), so the file
is stable under both the default and this repository's (100) settings."""


def py_lines(head: str, value: Any, indent: int = 4) -> list[str]:
    """`head` + the literal of `value` + `,` at `indent` spaces, as ruff format lays it out.

    A line that fits in LINE_WIDTH stays one line; a longer tuple is exploded one element
    per line with a trailing comma (which ruff keeps exploded), recursively.
    """
    pad = " " * indent
    one = f"{pad}{head}{py(value)},"
    if len(one) <= LINE_WIDTH or not isinstance(value, tuple | list) or not value:
        return [one]
    lines = [f"{pad}{head}("]
    for v in value:
        lines += py_lines("", v, indent + 4)
    lines.append(f"{pad}),")
    return lines


def feature_width(pooling: str, hotness: float, dim: int) -> int:
    """Width of a feature's embedding output: dim, or hotness * dim for concat."""
    if pooling == "concat":
        return int(round(hotness)) * dim
    return dim


def md_code(text: str) -> str:
    """`text` (a path: free text) as a Markdown code span: `printable` (one line), fenced
    by one backtick more than its longest run of backticks, so that nothing in it is read
    as Markdown or HTML (CommonMark strips the one space of padding added on each side
    when it starts or ends with a backtick or a space)."""
    text = printable(text)
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text[:1] in ("`", " ") or text[-1:] in ("`", " ") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def program_render_spec(program: Program, plan: Plan, spec_path: str) -> dict[str, Any]:
    """Everything the program templates need, spelled for their languages.

    Raises EmbarkError when the plan and the program disagree on what the trainer must
    bake in (a plan made for another spec).
    """
    tables = {t.name: t for t in plan.tables}
    if set(tables) != {t.name for t in program.tables}:
        raise EmbarkError.at(spec_path, "the plan's tables are not the spec's tables")
    if plan.batch_size != program.model.batch_size:
        raise EmbarkError.at(spec_path, "the plan's batch size is not the spec's")
    # the batch splits evenly over the ranks: the spec's batch is checked when it is
    # lowered (embarkc.lower.check_batch), a plan file's when it is loaded
    topo = plan.topology
    world = topo.world_size
    widths = tuple(feature_width(f.pooling, f.hotness, tables[f.table].dim) for f in plan.features)

    m = program.model
    o = m.optimizer
    dense_kwargs = [
        *py_lines("dense_features=", m.dense_features),
        *py_lines("bottom_mlp=", tuple(m.bottom_mlp)),
        *py_lines("interaction=", m.interaction.kind),
        *py_lines("cross_layers=", m.interaction.layers),
        *py_lines("low_rank=", m.interaction.low_rank),
        *py_lines("top_mlp=", tuple(m.top_mlp)),
        *py_lines("feature_widths=", widths),
    ]
    optimizer_kwargs = [
        *py_lines("kind=", o.kind),
        *py_lines("lr=", float(o.lr)),
        *py_lines("eps=", float(o.eps)),
        *py_lines("beta1=", float(o.beta1)),
        *py_lines("beta2=", float(o.beta2)),
        # only when set: the programs of specs without it are as before
        *(py_lines("weight_decay=", float(o.weight_decay)) if o.weight_decay else []),
    ]

    memory = plan.memory_by_rank()
    cluster_rows = []
    for c in plan.clusters:
        cells = [s for s in plan.shards if s.table in c.tables]
        ranks = sorted({s.rank for s in cells}) if cells else list(range(world))
        params = sum(tables[n].rows * tables[n].dim for n in c.tables)
        cluster_rows.append(
            {
                "name": c.name,
                "kind": c.kind + (f" ({c.communication})" if c.communication else ""),
                "tables": len(c.tables),
                "cells": len(cells),
                "ranks": len(ranks),
                "parameters": f"{params:,}",
            }
        )
    it = iteration_of(plan)
    return {
        "name": program.name,
        "spec": md_code(spec_path),
        "world_size": world,
        "nodes": topo.nodes,
        "gpus_per_node": topo.gpus_per_node,
        "arch": topo.arch,
        "batch_size": plan.batch_size,
        "local_batch": plan.batch_size // world,
        "row_partition": py(plan.row_partition),
        "strategy": plan.planner.strategy,
        "solver": plan.planner.solver,
        "status": plan.planner.status,
        "step_time_ms": format_ms(plan.estimate.step_time).removesuffix(" ms"),
        "dense_ms": format_ms(it.dense)
        if it.known
        else "not counted (the hardware gives no dense_flops)",
        "dense_allreduce_ms": format_ms(it.dense_allreduce),
        "iteration_ms": format_ms(it.seconds).removesuffix(" ms"),
        "overlap": (
            "the next batch's keys travel during the dense compute"
            if it.known
            else "without the dense part: the hardware gives no dense_flops"
        )
        + (
            f"; {format_ms(it.hidden)} of the dp exchange runs under the dense all-reduce"
            if it.hidden
            else ""
        ),
        "samples_per_s": f"{it.samples_per_second:,.0f}",
        "max_memory": format_bytes(max(memory)) if memory else "0 B",
        "hbm": format_bytes(topo.hbm_bytes),
        "parameters": f"{sum(t.rows * t.dim for t in plan.tables):,}",
        "plan_sha256": py(plan_digest(plan)),
        "cluster_rows": cluster_rows,
        "dense_kwargs": dense_kwargs,
        "optimizer_kwargs": optimizer_kwargs,
        "interaction": m.interaction.kind,
        "dense_optimizer": o.kind,
        "dense_features": m.dense_features,
        # a bare word: it sits inside "${RDZV_ID:-...}", where quotes would be kept
        "rdzv_id": re.sub(r"[^A-Za-z0-9_.-]", "_", f"embark-{program.name}"),
    }


def render_program(program: Program, plan: Plan, spec_path: str) -> list[GeneratedFile]:
    """train.py, launch.sh and README.md for `plan` (text without the generated header)."""
    from embarkc.codegen import environment

    spec = program_render_spec(program, plan, spec_path)
    env = environment()
    out = []
    for name in TEMPLATES:
        template = f"program/{name}.j2"
        text = env.get_template(template).render(**spec)
        out.append(
            GeneratedFile(
                name, text, f"templates/{template}", executable=name in ("train.py", "launch.sh")
            )
        )
    return out
