"""The optimizers of embedding tables: their state, and what that state allows.

This is the one table of optimizer facts; the language, the cost model, the checker,
the migration, the plan file, the kernels, the trainer's state and the checkpoints all
read it. Torch-free, so the compiler's command line imports it without torch.

State is fp32 whatever the weights' dtype (`STATE_ELEMENT_BYTES`), one tensor per named
state, each either per element ([rows, width]: it moves with its column) or per row
([rows]: replicated on every column cell of the row):

    sgd              no state
    adagrad          sum [rows, width]
    rowwise_adagrad  sum [rows]          (the mean of the row's squared gradients)
    adam             m, v [rows, width], step [rows] (lazy Adam: a row's moments move
                     only on the steps that touch it)

rowwise_adagrad is never cut into columns: its accumulator is the mean over the whole
row, which no column cell sees on its own. adam's per-row step count is the same on
every cell of a row, so adam tables may be cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

StateKind = Literal["element", "row"]

STATE_ELEMENT_BYTES = 4
"""Optimizer state is always kept in fp32, whatever the weights' dtype."""


@dataclass(frozen=True)
class OptimizerFacts:
    """One optimizer: its state tensors in a fixed order and whether columns may be cut."""

    name: str
    state: tuple[tuple[str, StateKind], ...]
    columns_may_be_cut: bool

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.state)

    @property
    def layout(self) -> dict[str, StateKind]:
        """State name -> "element" ([rows, width]) or "row" ([rows])."""
        return dict(self.state)

    @property
    def per_element(self) -> int:
        """fp32 state values per weight element."""
        return sum(1 for _, k in self.state if k == "element")

    @property
    def per_row(self) -> int:
        """fp32 state values per row of a cell, whatever its width."""
        return sum(1 for _, k in self.state if k == "row")

    def elements_per_row(self, width: int) -> int:
        """fp32 state values of one row of `width` columns."""
        return width * self.per_element + self.per_row

    def state_bytes(self, rows: int, width: int) -> int:
        """Bytes of the state of `rows` rows of `width` columns (one cell)."""
        return rows * self.elements_per_row(width) * STATE_ELEMENT_BYTES


OPTIMIZERS: dict[str, OptimizerFacts] = {
    o.name: o
    for o in (
        OptimizerFacts("sgd", (), True),
        OptimizerFacts("adagrad", (("sum", "element"),), True),
        OptimizerFacts("rowwise_adagrad", (("sum", "row"),), False),
        OptimizerFacts("adam", (("m", "element"), ("v", "element"), ("step", "row")), True),
    )
}
"""Every optimizer a table may use, by name (the spec's `optimizer` kinds)."""

OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def optimizer(name: str) -> OptimizerFacts:
    """The facts of optimizer `name`; a ValueError naming the known ones otherwise."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(
            f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZER_NAMES)}"
        ) from None


def columns_may_be_cut(name: str) -> bool:
    """Whether a table of optimizer `name` may be split into column cells."""
    return optimizer(name).columns_may_be_cut
