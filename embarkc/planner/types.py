"""The planner's working representation of a plan, between the IR and `Plan`.

A `Layout` maps every table to a `Placement`: its cluster kind, its 3D shard grid and the
rank of every cell. Stages exchange Layouts; only `embarkc.planner.build` turns one into an
`embark_runtime.plan.Plan`. Invariants of a Placement (checked by `Placement.check`):

* kind dp: no grid (row_shards == 1, one column of the full width) and no ranks;
* kind rb/ub: `ranks` has `row_shards * len(widths)` entries, cell (j, k) at index
  `j * len(widths) + k`, every width positive and the widths summing to the table's dim;
* `cache`, when given, has one entry per cell: its HBM cache rows (at most the cell's
  rows), or -1 for a cell in HBM;
* `communication` is "flat" or "hierarchical" (meaningful for rb and ub: rb sums the
  owner node's partials before the network, ub deduplicates each node's ids before it),
  `exchange` is "dense" or "sparse" (meaningful for dp only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["dp", "rb", "ub"]


def column_widths(dim: int, parts: int) -> tuple[int, ...]:
    """Split `dim` columns into `parts` widths that are multiples of 4, as equal as possible.

    Cuts fall at multiples of 4 (the vector width of the lookup kernels); when `dim` is not
    a multiple of 4 the last cell also takes the remainder. Requires 1 <= parts <= max(1,
    dim // 4).
    """
    if parts == 1:
        return (dim,)
    units, rest = divmod(dim, 4)
    if not 1 <= parts <= units:
        raise ValueError(f"cannot cut {dim} columns into {parts} multiples of 4")
    base, extra = divmod(units, parts)
    widths = [4 * (base + (1 if i < extra else 0)) for i in range(parts)]
    widths[-1] += rest
    return tuple(widths)


@dataclass(frozen=True)
class Placement:
    """Where one table lives: kind, grid (row_shards x widths) and the rank of each cell."""

    kind: Kind
    row_shards: int = 1
    widths: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    communication: Literal["flat", "hierarchical"] = "flat"
    exchange: Literal["dense", "sparse"] = "dense"
    cells_explicit: tuple[tuple[int, int, int, int], ...] | None = None
    """Cells (row_shard, lo, hi, rank) of a plan read from a file, whose column cuts may
    differ between row shards; None for the planner's own regular grids."""
    cache: tuple[int, ...] | None = None
    """Host tier: per cell (in `cell_list` order) its HBM cache rows, -1 for a cell in
    HBM; None: every cell in HBM (or, in the search, as the cost model's `tiers` say)."""

    @property
    def hierarchical(self) -> bool:
        """rb whose partials are summed in the owner node before the network."""
        return self.kind == "rb" and self.communication == "hierarchical"

    @property
    def node_dedup(self) -> bool:
        """ub whose ids are deduplicated per node before the network (hierarchical ub)."""
        return self.kind == "ub" and self.communication == "hierarchical"

    @property
    def column_shards(self) -> int:
        return len(self.widths)

    @property
    def cells(self) -> int:
        if self.kind == "dp":
            return 0
        if self.cells_explicit is not None:
            return len(self.cells_explicit)
        return self.row_shards * len(self.widths)

    def offsets(self) -> tuple[int, ...]:
        """Start column of every column shard."""
        out, pos = [], 0
        for w in self.widths:
            out.append(pos)
            pos += w
        return tuple(out)

    def cell_list(self) -> list[tuple[int, int, int, int]]:
        """Every cell as (row_shard, lo, hi, rank), row shard major."""
        if self.cells_explicit is not None:
            return list(self.cells_explicit)
        offs = self.offsets()
        c = len(self.widths)
        return [
            (j, offs[k], offs[k] + self.widths[k], self.ranks[j * c + k])
            for j in range(self.row_shards)
            for k in range(c)
        ]

    def rank_list(self) -> list[int]:
        if self.cells_explicit is not None:
            return [c[3] for c in self.cells_explicit]
        return list(self.ranks)

    def with_ranks(self, ranks: tuple[int, ...]) -> Placement:
        # the search calls this for every table it places: no dataclasses.replace
        return Placement(
            self.kind,
            self.row_shards,
            self.widths,
            ranks,
            self.communication,
            self.exchange,
            self.cells_explicit,
            self.cache,
        )

    def check(self, dim: int) -> None:
        if self.kind == "dp":
            assert not self.ranks
            return
        assert self.row_shards >= 1 and self.widths and sum(self.widths) == dim
        assert all(w > 0 for w in self.widths)
        assert len(self.ranks) == self.row_shards * len(self.widths)
        assert self.cache is None or len(self.cache) == len(self.ranks)


Layout = dict[str, Placement]
"""table name -> Placement, for every table of the program."""
