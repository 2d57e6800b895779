"""Optimizer state of embedding rows, and the fused sparse update.

The update rules themselves live in the kernels (`Kernels.sparse_update`, one per device)
so that the CUDA path fuses them with the backward; this module owns the state layout
and the checks that make a plan trainable:

* state is fp32 and per cell: adagrad {"sum": [n, w]}, rowwise_adagrad {"sum": [n]},
  adam {"m": [n, w], "v": [n, w], "step": [n]} (per-row step counts: lazy Adam, a row's
  moments only move on the steps that touch it), sgd {};
* adagrad accumulators start at `optimizer_params.initial_accumulator`;
* a row is updated once per step with its gradient summed over the whole global batch
  (the clusters guarantee it), so the result equals the unsharded table's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from embark_runtime.kernels import Kernels
from embark_runtime.optimizers import OPTIMIZER_NAMES, OPTIMIZERS

STATE_NAMES = {name: o.state_names for name, o in OPTIMIZERS.items()}
"""The state tensors of every optimizer, in a fixed order."""


def state_shape(optimizer: str, name: str, rows: int, width: int) -> tuple[int, ...]:
    """[rows] for per-row state (rowwise_adagrad's sum, adam's step), else [rows, width]."""
    per_row = OPTIMIZERS[optimizer].layout[name] == "row"
    return (rows,) if per_row else (rows, width)


def new_state(
    optimizer: str, rows: int, width: int, params, device: torch.device | str
) -> dict[str, Tensor]:
    """Fresh optimizer state for `rows` x `width` weights."""
    f32 = {"dtype": torch.float32, "device": device}
    if optimizer == "sgd":
        return {}
    if optimizer == "adagrad":
        return {"sum": torch.full((rows, width), float(params.initial_accumulator), **f32)}
    if optimizer == "rowwise_adagrad":
        return {"sum": torch.full((rows,), float(params.initial_accumulator), **f32)}
    if optimizer == "adam":
        return {
            "m": torch.zeros(rows, width, **f32),
            "v": torch.zeros(rows, width, **f32),
            "step": torch.zeros(rows, **f32),
        }
    raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZER_NAMES}")


def apply_update(
    kernels: Kernels, weight: Tensor, state: dict[str, Tensor], rows: Tensor, grads: Tensor, table
) -> None:
    """Update the rows `rows` of `weight` with their summed gradients (rows may repeat:
    duplicates are summed first, since the kernels require unique rows)."""
    if rows.numel() == 0:
        return
    unique, inverse = kernels.dedup(rows)
    if unique.numel() != rows.numel():
        acc = kernels.accum
        summed = torch.zeros(unique.numel(), grads.shape[1], dtype=acc, device=grads.device)
        kernels.scatter_add_rows(summed, inverse, grads.to(acc))
        rows, grads = unique, summed
    kernels.sparse_update(weight, state, rows, grads, table.optimizer, table.optimizer_params)


def scheduled(table, step: int):
    """`table` (a plan table) with its optimizer's rate at `step` under its schedule
    (embark_runtime.schedules); `table` itself when it has none."""
    params = table.optimizer_params
    if params.schedule is None:
        return table
    lr = params.schedule.rate(params.lr, step)
    return table.model_copy(update={"optimizer_params": params.model_copy(update={"lr": lr})})


def schedule_clusters(clusters, step: int) -> None:
    """Give the tables of every cluster (their `tables` and `table_by_name`, which the
    updates read their rates from) the rates of `step`; called before each step's
    forward, so that every update of the step, in the backward or in `finish_backward`,
    uses them."""
    for c in clusters:
        tables = [scheduled(c.plan.table(name), step) for name in c.spec.tables]
        if any(t.optimizer_params.schedule is not None for t in tables):
            c.tables = tables
            c.table_by_name = {t.name: t for t in tables}
