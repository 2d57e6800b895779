"""Lower parsed spec files into the typed IR (`embarkc.ir.Program`).

`lower(files, name, sources)` takes the parse trees of the root spec and of every file it
includes (in include order) and returns a `Program` whose invariants are those written
at the top of `embarkc/ir.py`: names resolved, units normalised, defaults applied, spans
kept. Every mistake found is collected as a diagnostic; when there is any, one
`EmbarkError` carrying all of them (and the source texts, for carets) is raised.

Semantics, in the order they are checked (docs/language.md is the user's version):

* At most one `hardware`, `model` and `plan` block over all files; `defaults` blocks
  merge (a field given twice is an error). A field given twice in one block is an error.
* `table X {...}` declares table X; `tables t[0..3] {...}` declares t0..t3 (inclusive).
  Table fields come from the block, else from `defaults`, else the IR's defaults; `rows`,
  `dim` and (for a table's own feature) `hotness` have no IR default.
* A table that no `feature` block reads declares a feature of its own name, with the
  feature fields (hotness, pooling, weighted, access) of its block or `defaults`. A table
  that `feature` blocks read has no feature of its own; feature fields in its block are
  then an error (they would be silently ignored).
* Cross-object checks: batch divisible by the GPU count, constraint contradictions, and
  whether the tables fit in the cluster's memory (one copy of weights plus optimizer
  state against nodes x GPUs x (HBM - headroom)).

The lowering of each block lives in `embarkc/lowering/` (hardware, model, tables, features,
constraints, the cross-block checks, and the shared helpers in `base`); `Lowerer`
combines them and `Lowerer.run` walks the files.
"""

from __future__ import annotations

from lark import Token, Tree

from embarkc import ir
from embarkc.diagnostics import Diagnostic, Span
from embarkc.lowering.base import Block, Field_, SourceFile
from embarkc.lowering.checks import CrossChecks
from embarkc.lowering.constraints import PlanBlockLowering
from embarkc.lowering.features import FeatureLowering
from embarkc.lowering.hardware import HardwareLowering
from embarkc.lowering.model import ModelLowering
from embarkc.lowering.tables import TableLowering
from embarkc.syntax import parts, span_of

__all__ = ["Lowerer", "SourceFile", "lower"]


class Lowerer(
    HardwareLowering,
    ModelLowering,
    TableLowering,
    FeatureLowering,
    PlanBlockLowering,
    CrossChecks,
):
    """Lowers one spec (its files, root first): each block by its part, then the checks
    across blocks."""

    def run(self, name: str, sources: tuple[ir.Source, ...]) -> ir.Program:
        singles: dict[str, Block] = {}
        defaults: dict[str, Field_] = {}
        table_blocks: list[tuple[str, Span, Block]] = []
        declares_tables = False  # a `tables` group whose range failed has its own error
        feature_blocks: list[Block] = []
        for f in self.files:
            for item in parts(f.tree):
                if not isinstance(item, Tree):
                    continue
                if item.data in ("hardware", "model", "plan"):
                    b = self.block(item, f.path)
                    if item.data in singles:
                        first = singles[item.data]
                        where = first.keyword_span()
                        self.error(
                            f"a second `{item.data}` block",
                            b.keyword_span(),
                            f"the first is at {where.render_location()}; merge them",
                        )
                        continue
                    singles[item.data] = b
                elif item.data == "defaults":
                    b = self.block(item, f.path)
                    for key, fld in b.fields.items():
                        if key in defaults:
                            where = defaults[key].span
                            self.error(
                                f"`{key}` is given twice in `defaults`",
                                self._head_span(fld),
                                f"the first is at {where.render_location()}",
                            )
                        else:
                            defaults[key] = fld
                elif item.data == "table":
                    declares_tables = True
                    b = self.block(item, f.path)
                    name_tok = parts(item)[0]
                    assert isinstance(name_tok, Token)
                    table_blocks.append((str(name_tok), span_of(name_tok, f.path), b))
                elif item.data == "tables":
                    declares_tables = True
                    b = self.block(item, f.path)
                    rng = parts(item)[0]
                    assert isinstance(rng, Tree)
                    span = span_of(rng, f.path)
                    for tname in self.attempt(self.name_range, rng, f.path) or ():
                        table_blocks.append((tname, span, b))
                elif item.data == "feature":
                    feature_blocks.append(self.block(item, f.path))

        topology = self.attempt(self.topology, singles.get("hardware"))
        model = self.attempt(self.model, singles.get("model"))
        if not declares_tables:
            self.error(
                "the spec declares no embedding table: embarkc plans and trains embedding tables",
                Span.of_file(self.files[0].path),
                "add one, e.g. `table items { rows 1M dim 64 hotness 1 }`",
            )
        tables = self.tables(table_blocks, defaults)
        table_names = {name for name, _, _ in table_blocks}
        features = self.features(feature_blocks, table_blocks, tables, defaults)
        options, constraints, colocate = self.plan(singles.get("plan"), table_names, topology)
        if topology is not None and model is not None:
            self.check_batch(model, topology, singles["model"])
        if topology is not None:
            self.check_constraints(tables, constraints, colocate, topology)
            if options is not None:
                self.check_memory(tables, constraints, topology, options, singles.get("hardware"))
        self.c.raise_if_failed()
        assert topology is not None and model is not None and options is not None
        return ir.Program(
            name=name,
            sources=sources,
            topology=topology,
            tables=tuple(tables),
            features=tuple(features),
            model=model,
            options=options,
            constraints=tuple(constraints),
            colocate=tuple(colocate),
        )


def lower(
    files: list[SourceFile],
    name: str,
    sources: tuple[ir.Source, ...],
    warnings: list[Diagnostic] | None = None,
) -> ir.Program:
    """Lower parsed files (root first, then includes) into a `Program`; raise `EmbarkError`
    (whose diagnostics include the warnings). The warnings of a spec that lowers are
    appended to `warnings` when it is given."""
    lowerer = Lowerer(files)
    program = lowerer.run(name, sources)
    if warnings is not None:
        warnings.extend(lowerer.c.warnings)
    return program
