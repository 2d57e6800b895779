"""ReferenceEmbeddings: the plan's tables unsharded in one process, for exactness tests.

Written independently of the sharded path (no kernels, no clusters, no distributor):
plain gathers and index_add over the whole global batch, and the optimizer formulas
spelled out again, so that a bug in a shared helper cannot hide in both. Same initial
values (`embark_runtime.init`), same optimizer semantics (`embark_runtime.kernels`
module docstring): every touched row is updated once per step with its gradient summed
over all its occurrences in the global batch.

`accum=torch.float64` is the exact mode (see embark_runtime.kernels.TorchKernels): sums in
fp64, gradients rounded to fp32 before the optimizer, as the sharded path does.
`device` holds the tables and does the arithmetic (a reference on the GPU compares a GPU run
with the same device's rounding of the dense model).
"""

from __future__ import annotations

import torch
from torch import Tensor

from embark_runtime.init import initial_values
from embark_runtime.optim import new_state
from embark_runtime.schedules import rate_at
from embark_runtime.storage import TORCH_DTYPES


def _as_tensor(x, dtype, device: torch.device) -> Tensor:
    return (torch.as_tensor(x) if not isinstance(x, Tensor) else x).to(device, dtype)


class _RefLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, module, batch):  # type: ignore[override]
        ctx.module, ctx.batch = module, batch
        return tuple(module._lookup(batch))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.module._update(ctx.batch, grads)
        return None, None, None


class ReferenceEmbeddings(torch.nn.Module):
    """forward(global batch sparse) -> {feature: [B, out_dim]}; backward updates in place."""

    def __init__(
        self,
        plan,
        *,
        seed: int = 0,
        accum: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        self.plan = plan
        self.accum = accum
        self.device = torch.device(device)
        self.weights: dict[str, Tensor] = {}
        self.states: dict[str, dict[str, Tensor]] = {}
        for t in plan.tables:
            rows = torch.arange(t.rows, dtype=torch.int64)
            self.weights[t.name] = initial_values(seed, t.name, rows, 0, t.dim, t.init).to(
                self.device, TORCH_DTYPES[t.dtype]
            )
            self.states[t.name] = new_state(
                t.optimizer, t.rows, t.dim, t.optimizer_params, self.device
            )
        self._anchor = torch.nn.Parameter(torch.zeros(0))
        self.step = 0
        """The step being trained (0-based): the optimizers' rates follow their schedules
        at it. The trainer sets it before each step."""

    def table_weights(self, name: str) -> Tensor:
        return self.weights[name].float()

    def table_state(self, name: str) -> dict[str, Tensor]:
        return self.states[name]

    def forward(self, batch_sparse) -> dict[str, Tensor]:  # type: ignore[override]
        batch = {}
        for f in self.plan.features:
            bag = batch_sparse[f.name]
            w = getattr(bag, "weights", None)
            dev = self.device
            batch[f.name] = (
                _as_tensor(bag.ids, torch.int64, dev),
                _as_tensor(bag.offsets, torch.int64, dev),
                None if w is None else _as_tensor(w, torch.float32, dev).to(self.accum),
            )
        outs = _RefLookup.apply(self._anchor, self, batch)
        return {f.name: o for f, o in zip(self.plan.features, outs, strict=True)}

    @staticmethod
    def _where(offsets: Tensor, nnz: int) -> tuple[Tensor, Tensor, Tensor]:
        lengths = offsets[1:] - offsets[:-1]
        dev = offsets.device
        sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths)
        pos = torch.arange(nnz, device=dev) - offsets[sample]
        return sample, pos, lengths

    def _lookup(self, batch) -> list[Tensor]:
        outs = []
        for f in self.plan.features:
            ids, offsets, w = batch[f.name]
            table = self.weights[f.table].to(self.accum)
            b, dim = offsets.numel() - 1, table.shape[1]
            sample, pos, lengths = self._where(offsets, ids.numel())
            vals = table[ids] if w is None else table[ids] * w[:, None]
            if f.pooling == "concat":
                out = torch.zeros(b, f.bag_max, dim, dtype=self.accum, device=self.device)
                out[sample, pos] = vals
                outs.append(out.reshape(b, f.bag_max * dim))
                continue
            out = torch.zeros(b, dim, dtype=self.accum, device=self.device)
            out.index_add_(0, sample, vals)
            if f.pooling == "mean":
                out = out / lengths.clamp(min=1)[:, None]
            outs.append(out)
        return outs

    def _update(self, batch, grads) -> None:
        dev = self.device
        acc = {
            t.name: torch.zeros(t.rows, t.dim, dtype=self.accum, device=dev)
            for t in self.plan.tables
        }
        touched = {
            t.name: torch.zeros(t.rows, dtype=torch.bool, device=dev) for t in self.plan.tables
        }
        for f, g in zip(self.plan.features, grads, strict=True):
            ids, offsets, w = batch[f.name]
            dim = self.plan.table(f.table).dim
            sample, pos, lengths = self._where(offsets, ids.numel())
            if g is None:
                g = torch.zeros(
                    offsets.numel() - 1,
                    dim * (f.bag_max if f.pooling == "concat" else 1),
                    dtype=self.accum,
                    device=dev,
                )
            if f.pooling == "concat":
                per_id = g.reshape(-1, f.bag_max, dim)[sample, pos]
            elif f.pooling == "mean":
                per_id = (g / lengths.clamp(min=1)[:, None])[sample]
            else:
                per_id = g[sample]
            per_id = per_id.to(self.accum)
            if w is not None:
                per_id = per_id * w[:, None]
            acc[f.table].index_add_(0, ids, per_id)
            touched[f.table][ids] = True
        for t in self.plan.tables:
            rows = torch.nonzero(touched[t.name]).reshape(-1)
            self._apply(t, rows, acc[t.name][rows])

    def _apply(self, t, rows: Tensor, g: Tensor) -> None:
        p = t.optimizer_params
        lr = rate_at(p.lr, p.schedule, self.step)
        weight, st = self.weights[t.name], self.states[t.name]
        g = g.float()  # the optimizer sees the fp32 gradient (rounded once in exact mode)
        w = weight[rows].float()
        g = g + p.weight_decay * w if p.weight_decay else g
        if t.optimizer == "sgd":
            w = w - lr * g
        elif t.optimizer == "adagrad":
            st["sum"][rows] += g * g
            w = w - lr * g / (st["sum"][rows].sqrt() + p.eps)
        elif t.optimizer == "rowwise_adagrad":
            st["sum"][rows] += (g * g).mean(dim=1)
            w = w - lr * g / (st["sum"][rows].sqrt() + p.eps)[:, None]
        else:
            st["step"][rows] += 1
            k = st["step"][rows].double()
            st["m"][rows] = p.beta1 * st["m"][rows] + (1 - p.beta1) * g
            st["v"][rows] = p.beta2 * st["v"][rows] + (1 - p.beta2) * g * g
            m_hat = st["m"][rows] / (1 - torch.pow(p.beta1, k)).float()[:, None]
            v_hat = st["v"][rows] / (1 - torch.pow(p.beta2, k)).float()[:, None]
            w = w - lr * m_hat / (v_hat.sqrt() + p.eps)
        weight[rows] = w.to(weight.dtype)
