"""The one table of optimizers and of dtypes: every reader agrees with it, and the
compiler's command line imports it without torch."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from embark_runtime.dtypes import DTYPE_BYTES
from embark_runtime.optimizers import OPTIMIZER_NAMES, OPTIMIZERS, columns_may_be_cut, optimizer
from embark_runtime.plan import PlanTable
from embarkc import ir


def test_literals_name_the_tables() -> None:
    assert get_args(ir.OptimizerKind) == OPTIMIZER_NAMES
    assert get_args(PlanTable.model_fields["optimizer"].annotation) == OPTIMIZER_NAMES
    assert get_args(ir.DType) == tuple(DTYPE_BYTES)
    assert get_args(PlanTable.model_fields["dtype"].annotation) == tuple(DTYPE_BYTES)


@pytest.mark.parametrize(
    ("name", "per_element", "per_row", "cut"),
    [
        ("sgd", 0, 0, True),
        ("adagrad", 1, 0, True),
        ("rowwise_adagrad", 0, 1, False),
        ("adam", 2, 1, True),
    ],
)
def test_optimizer_facts(name: str, per_element: int, per_row: int, cut: bool) -> None:
    o = OPTIMIZERS[name]
    assert (o.per_element, o.per_row, columns_may_be_cut(name)) == (per_element, per_row, cut)
    assert o.state_bytes(10, 8) == 10 * (8 * per_element + per_row) * 4
    t = PlanTable(name="t", rows=10, dim=8, dtype="fp16", optimizer=name)  # type: ignore[arg-type]
    assert t.bytes_for(10, 8) == 10 * 8 * 2 + o.state_bytes(10, 8)
    assert t.state_elements_per_row() == ir.Optimizer(kind=name).state_elements_per_row(8)  # type: ignore[arg-type]


def test_runtime_readers_follow_the_table() -> None:
    from embark_runtime import checkpoint, optim

    for name, o in OPTIMIZERS.items():
        assert optim.STATE_NAMES[name] == o.state_names
        assert checkpoint.STATE_LAYOUT[name] == o.layout
        for s, kind in o.state:
            assert optim.state_shape(name, s, 5, 8) == ((5,) if kind == "row" else (5, 8))


def test_unknown_optimizer_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="expected one of sgd, adagrad, rowwise_adagrad, adam"):
        optimizer("lamb")


def test_tables_and_cli_import_no_torch() -> None:
    code = (
        "import sys, embark_runtime.optimizers, embark_runtime.dtypes, embarkc.cli, embarkc.ir;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runtime_never_imports_the_compiler() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "runtime"
    for f in root.glob("*.py"):
        text = f.read_text()
        assert "from embarkc" not in text and "import embarkc" not in text, f.name
