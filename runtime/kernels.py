"""The lookup kernels behind one interface, and their torch implementation.

`Kernels` is the contract shared by `TorchKernels` (here, any torch device) and
`embark_runtime.cuda_kernels.CudaKernels` (NVRTC-compiled kernels emitted by the
compiler). Every cluster of the runtime calls only these methods, so swapping the
implementation changes no result beyond fp32 summation order.

Conventions, for every method:
* `rows`, `keys`, `index`, `offsets` are int64; `offsets` has B+1 entries, `offsets[0] == 0`
  and `offsets[-1] == len(rows)`; bag `i` is `rows[offsets[i]:offsets[i+1]]`.
* Results are in the kernels' accumulation dtype `accum` (fp32, or fp64 for the exact
  mode of `TorchKernels`) whatever the weight's dtype: pooled sums and row gradients
  are accumulated in it, and the communication buffers of the clusters use it too.
  `sparse_update` rounds the row gradients to fp32, computes in fp32 and stores back in
  the weight's dtype, so the same fp32 gradient gives the same update everywhere.
* Optimizer state (see `sparse_update`) is always fp32: adagrad {"sum": [n, w]},
  rowwise_adagrad {"sum": [n]}, adam {"m": [n, w], "v": [n, w], "step": [n]} (per-row
  step counts held in fp32: exact up to 2**24 steps), sgd {}.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from embark_runtime.optimizers import OPTIMIZER_NAMES

POOLINGS = ("sum", "mean")
OPTIMIZERS = OPTIMIZER_NAMES


class OptimizerParamsLike(Protocol):
    lr: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float


class Kernels(Protocol):
    """What a cluster needs from a device. See the module docstring for conventions."""

    accum: torch.dtype
    """dtype of pooled results, row gradients and the clusters' value buffers"""

    def pooled_forward(
        self,
        weight: Tensor,
        rows: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        mode: str,
    ) -> Tensor:
        """[B, w] in `accum`: per bag, the sum (or mean: sum / bag length, empty bag -> zeros)
        of its rows, each multiplied by its per-id weight when given."""
        ...

    def pooled_backward(
        self,
        grad_out: Tensor,
        rows: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        mode: str,
        num_rows: int,
    ) -> tuple[Tensor, Tensor]:
        """(unique rows sorted ascending [U], their gradients [U, w] in `accum`): the
        gradient of every distinct row, summed over all its occurrences in all bags."""
        ...

    def sparse_update(
        self,
        weight: Tensor,
        state: dict[str, Tensor],
        unique_rows: Tensor,
        row_grads: Tensor,
        optimizer: str,
        params: OptimizerParamsLike,
    ) -> None:
        """Apply `optimizer` in place to the (unique) rows given, nothing else."""
        ...

    def dedup(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        """(unique keys sorted ascending, inverse index with unique[inverse] == keys)."""
        ...

    def bucketize(
        self, keys: Tensor, rows: int, row_shards: int, partition: str
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(stable permutation grouping keys by row shard, count per row shard, local row
        of every key in original order) under the `mod` or `range` row partition."""
        ...

    def gather_rows(self, src: Tensor, index: Tensor) -> Tensor: ...

    def scatter_add_rows(self, dst: Tensor, index: Tensor, src: Tensor) -> None: ...


def bag_of_ids(offsets: Tensor, nnz: int) -> Tensor:
    """Bag index of every id: [nnz] int64."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(
        torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=nnz
    )


def check_mode(mode: str) -> None:
    if mode not in POOLINGS:
        raise ValueError(
            f"pooling mode {mode!r} is not one of {POOLINGS} (concat is pooled as sum of one-id bags)"
        )


class TorchKernels:
    """The reference implementation of `Kernels` in plain torch ops (CPU or any device).

    `accum=torch.float64` is the exact mode: every sum of the lookup (pooling, row
    gradients) is taken in fp64 from fp32 values, so that summing the same numbers in
    another order (other row shards, another world size, the unsharded reference) gives
    the same result up to fp64 rounding, and the fp32 gradient the optimizer sees is
    almost always the same bits. It costs twice the bytes of every value buffer.
    """

    name = "torch"

    def __init__(self, accum: torch.dtype = torch.float32):
        if accum not in (torch.float32, torch.float64):
            raise ValueError(f"accumulation dtype must be float32 or float64, got {accum}")
        self.accum = accum

    def pooled_forward(
        self,
        weight: Tensor,
        rows: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        mode: str,
    ) -> Tensor:
        check_mode(mode)
        bags = offsets.numel() - 1
        acc = self.accum
        if bags == 0:
            return torch.zeros(0, weight.shape[1], dtype=acc, device=weight.device)
        if weight.dtype == torch.float32 and acc == torch.float32:
            # fused gather-and-sum: no [nnz, w] temporary (30x faster on CPU than gather + index_add)
            out = F.embedding_bag(
                rows,
                weight,
                offsets,
                mode="sum",
                per_sample_weights=None if per_id_weights is None else per_id_weights.float(),
                include_last_offset=True,
            )
        else:
            vals = weight.index_select(0, rows).to(acc)
            if per_id_weights is not None:
                vals = vals * per_id_weights.to(acc).unsqueeze(1)
            out = torch.zeros(bags, weight.shape[1], dtype=acc, device=weight.device)
            out.index_add_(0, bag_of_ids(offsets, rows.numel()), vals)
        if mode == "mean":
            lengths = (offsets[1:] - offsets[:-1]).clamp(min=1)
            out = out / lengths.unsqueeze(1).to(acc)
        return out

    def pooled_backward(
        self,
        grad_out: Tensor,
        rows: Tensor,
        offsets: Tensor,
        per_id_weights: Tensor | None,
        mode: str,
        num_rows: int,
    ) -> tuple[Tensor, Tensor]:
        check_mode(mode)
        acc = self.accum
        grad = grad_out.to(acc)
        if mode == "mean":
            lengths = (offsets[1:] - offsets[:-1]).clamp(min=1)
            grad = grad / lengths.unsqueeze(1).to(acc)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            raise IndexError(f"row index outside [0, {num_rows})")
        unique, inverse = torch.unique(rows, sorted=True, return_inverse=True)
        if rows.numel() == 0:
            return unique, torch.zeros(0, grad.shape[1], dtype=acc, device=grad.device)
        # the transpose of a pooling is a pooling: row u's gradient is the sum, over the
        # occurrences of u, of its bag's gradient times the id's weight; occurrences are
        # grouped by row in their original order (stable sort): a fixed summation order
        order = torch.sort(inverse, stable=True).indices
        counts = torch.bincount(inverse, minlength=unique.numel())
        row_offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        row_grads = F.embedding_bag(
            bag_of_ids(offsets, rows.numel())[order],
            grad,
            row_offsets,
            mode="sum",
            per_sample_weights=None if per_id_weights is None else per_id_weights.to(acc)[order],
            include_last_offset=True,
        )
        return unique, row_grads

    def sparse_update(
        self,
        weight: Tensor,
        state: dict[str, Tensor],
        unique_rows: Tensor,
        row_grads: Tensor,
        optimizer: str,
        params: OptimizerParamsLike,
    ) -> None:
        if unique_rows.numel() == 0:
            return
        w = weight.index_select(0, unique_rows).float()
        g = row_grads.float()
        if params.weight_decay:
            g = g + params.weight_decay * w
        if optimizer == "sgd":
            w = w - params.lr * g
        elif optimizer == "adagrad":
            s = state["sum"].index_select(0, unique_rows) + g * g
            state["sum"].index_copy_(0, unique_rows, s)
            w = w - params.lr * g / (s.sqrt() + params.eps)
        elif optimizer == "rowwise_adagrad":
            s = state["sum"].index_select(0, unique_rows) + (g * g).mean(dim=1)
            state["sum"].index_copy_(0, unique_rows, s)
            w = w - params.lr * g / (s.sqrt() + params.eps).unsqueeze(1)
        elif optimizer == "adam":
            step = state["step"].index_select(0, unique_rows) + 1
            m = params.beta1 * state["m"].index_select(0, unique_rows) + (1 - params.beta1) * g
            v = params.beta2 * state["v"].index_select(0, unique_rows) + (1 - params.beta2) * g * g
            state["step"].index_copy_(0, unique_rows, step)
            state["m"].index_copy_(0, unique_rows, m)
            state["v"].index_copy_(0, unique_rows, v)
            bc1 = (1 - torch.pow(params.beta1, step.double())).float().unsqueeze(1)
            bc2 = (1 - torch.pow(params.beta2, step.double())).float().unsqueeze(1)
            w = w - params.lr * (m / bc1) / ((v / bc2).sqrt() + params.eps)
        else:
            raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {OPTIMIZERS}")
        weight.index_copy_(0, unique_rows, w.to(weight.dtype))

    def dedup(self, keys: Tensor) -> tuple[Tensor, Tensor]:
        unique, inverse = torch.unique(keys, sorted=True, return_inverse=True)
        return unique, inverse

    def bucketize(
        self, keys: Tensor, rows: int, row_shards: int, partition: str
    ) -> tuple[Tensor, Tensor, Tensor]:
        if partition == "mod":
            shard = torch.remainder(keys, row_shards)
            local = torch.div(keys, row_shards, rounding_mode="floor")
        elif partition == "range":
            block = -(-rows // row_shards)
            shard = torch.div(keys, block, rounding_mode="floor")
            local = keys - shard * block
        else:
            raise ValueError(f"unknown row partition {partition!r}; expected 'mod' or 'range'")
        order = torch.sort(shard, stable=True).indices
        counts = torch.bincount(shard, minlength=row_shards)
        return order, counts, local

    def gather_rows(self, src: Tensor, index: Tensor) -> Tensor:
        return src.index_select(0, index)

    def scatter_add_rows(self, dst: Tensor, index: Tensor, src: Tensor) -> None:
        dst.index_add_(0, index, src.to(dst.dtype))
