"""The data distributor: validated bags, their split by row shard, per-destination dedup.

Pooling slots. Every cluster pools "slots" with a plain sum: for sum and mean features a
slot is a sample's bag (the requester divides by the WHOLE bag length afterwards, so a
mean over a row-sharded bag is exact), for a concat feature of hotness h a slot is one
(sample, position) pair holding at most one id (output [b, h * dim], absent positions are
zeros). `FeatureInput.slot_offsets()` gives the slots' offsets into the feature's ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from embark_runtime.kernels import Kernels, bag_of_ids


class BatchError(ValueError):
    """A batch that does not fit the plan (missing feature, id out of range, ...)."""


@dataclass
class FeatureInput:
    """One feature's bags on this rank, validated and on the runtime's device."""

    name: str
    table: str
    pooling: str
    hotness: int
    ids: Tensor
    offsets: Tensor
    weights: Tensor | None

    @property
    def b(self) -> int:
        return int(self.offsets.numel()) - 1

    @property
    def slots(self) -> int:
        return self.b * self.hotness if self.pooling == "concat" else self.b

    def lengths(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def sample_of_ids(self) -> Tensor:
        return bag_of_ids(self.offsets, self.ids.numel())

    def positions(self) -> Tensor:
        """Position of every id inside its bag."""
        return (
            torch.arange(self.ids.numel(), device=self.ids.device)
            - self.offsets[self.sample_of_ids()]
        )

    def slot_offsets(self) -> Tensor:
        if self.pooling != "concat":
            return self.offsets
        h = self.hotness
        p = torch.arange(h, device=self.offsets.device).unsqueeze(0)
        starts = self.offsets[:-1].unsqueeze(1) + torch.minimum(p, self.lengths().unsqueeze(1))
        return torch.cat([starts.reshape(-1), self.offsets[-1:]])

    def finish(self, pooled_slots: Tensor, dim: int) -> Tensor:
        """Summed slots [slots, dim] -> the feature's output [b, out_dim]."""
        if self.pooling == "concat":
            return pooled_slots.reshape(self.b, self.hotness * dim)
        if self.pooling == "mean":
            return pooled_slots / self.lengths().clamp(min=1).unsqueeze(1).to(pooled_slots.dtype)
        return pooled_slots

    def unit_grads(self, grad: Tensor, dim: int) -> Tensor:
        """Gradient of the output [b, out_dim] -> gradient of the summed slots [slots, dim]
        (fp64 stays fp64, the exact mode; anything else becomes fp32)."""
        if grad.dtype != torch.float64:
            grad = grad.float()
        if self.pooling == "concat":
            return grad.reshape(self.slots, dim)
        if self.pooling == "mean":
            return grad / self.lengths().clamp(min=1).unsqueeze(1).to(grad.dtype)
        return grad


def _tensor(x, dtype: torch.dtype, device, what: str) -> Tensor:
    if isinstance(x, Tensor):
        t = x
    elif isinstance(x, np.ndarray | list | tuple):
        t = torch.as_tensor(np.asarray(x))
    else:
        raise BatchError(f"{what} must be a tensor or an array, got {type(x).__name__}")
    if t.dim() != 1:
        raise BatchError(f"{what} must be one-dimensional, got shape {tuple(t.shape)}")
    if dtype == torch.int64 and (t.is_floating_point() or t.is_complex()):
        raise BatchError(f"{what} must hold integers, got {t.dtype}")
    return t.to(device=device, dtype=dtype)


def prepare_batch(plan, batch_sparse, device) -> dict[str, FeatureInput]:
    """Validate a batch's bags against the plan (every feature present, offsets well-formed,
    ids inside the table, weights exactly for the plan's weighted features, concat bags no
    longer than the hotness, one local batch size) and move them to `device`."""
    if not hasattr(batch_sparse, "get"):
        raise BatchError(
            f"the sparse batch must be a dict of feature name -> bag, got {type(batch_sparse).__name__}"
        )
    known = {f.name for f in plan.features}
    unknown = sorted(set(batch_sparse) - known)
    if unknown:
        raise BatchError(f"the batch has feature `{unknown[0]}` that the plan does not know")
    out: dict[str, FeatureInput] = {}
    b = None
    for f in plan.features:
        bag = batch_sparse.get(f.name)
        if bag is None:
            raise BatchError(f"the batch has no bags for feature `{f.name}`")
        ids = _tensor(bag.ids, torch.int64, device, f"feature `{f.name}`: ids")
        offsets = _tensor(bag.offsets, torch.int64, device, f"feature `{f.name}`: offsets")
        raw_w = getattr(bag, "weights", None)
        if f.weighted and raw_w is None:
            raise BatchError(
                f"feature `{f.name}` is weighted in the plan but its bags have no weights"
            )
        if not f.weighted and raw_w is not None:
            raise BatchError(
                f"feature `{f.name}` is not weighted in the plan but its bags have weights"
            )
        weights = (
            None
            if raw_w is None
            else _tensor(raw_w, torch.float32, device, f"feature `{f.name}`: weights")
        )
        if offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel():
            raise BatchError(
                f"feature `{f.name}`: offsets must start at 0 and end at the number of ids ({ids.numel()})"
            )
        if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
            raise BatchError(f"feature `{f.name}`: offsets must not decrease")
        if weights is not None and weights.numel() != ids.numel():
            raise BatchError(f"feature `{f.name}`: {weights.numel()} weights for {ids.numel()} ids")
        rows = plan.table(f.table).rows
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            bad = int(ids[(ids < 0) | (ids >= rows)][0])
            raise BatchError(
                f"feature `{f.name}`: id {bad} is outside table `{f.table}` [0, {rows})"
            )
        hot = f.bag_max if f.pooling == "concat" else 0
        fi = FeatureInput(f.name, f.table, f.pooling, hot, ids, offsets, weights)
        if f.pooling == "concat" and fi.b and int(fi.lengths().max()) > hot:
            raise BatchError(
                f"feature `{f.name}` pools by concat of {hot} ids but a bag has {int(fi.lengths().max())}"
            )
        if b is None:
            b = fi.b
        elif fi.b != b:
            raise BatchError(f"feature `{f.name}` has {fi.b} samples, other features have {b}")
        out[f.name] = fi
    return out


@dataclass
class ShardPart:
    """The ids of one feature's local bags that fall into one row shard, bags kept."""

    keys: Tensor
    lengths: Tensor
    weights: Tensor | None
    positions: Tensor | None


def split_by_row_shard(
    kernels: Kernels, feat: FeatureInput, rows: int, row_shards: int, partition: str
) -> list[ShardPart]:
    """For every row shard j, the feature's ids in shard j in their original order, the
    per-sample count of them (int32, the bag lengths sent to shard j's owners), their
    weights and, for concat, their positions inside the bag."""
    order, counts, _ = kernels.bucketize(feat.ids, rows, row_shards, partition)
    sample = feat.sample_of_ids()
    pos = feat.positions() if feat.pooling == "concat" else None
    parts = []
    start = 0
    for n in counts.tolist():
        sel = order[start : start + n]
        start += n
        s = sample[sel]
        parts.append(
            ShardPart(
                keys=feat.ids[sel],
                lengths=torch.bincount(s, minlength=feat.b).to(torch.int32),
                weights=None if feat.weights is None else feat.weights[sel],
                positions=None if pos is None else pos[sel],
            )
        )
    return parts


def local_rows_of(
    keys: Tensor, rows: int, row_shard: int, row_shards: int, partition: str
) -> Tensor:
    """Local row of every key of row shard `row_shard` (see embark_runtime.keys.local_row)."""
    if partition == "mod":
        return torch.div(keys, row_shards, rounding_mode="floor")
    block = -(-rows // row_shards)
    return keys - row_shard * block


@dataclass
class UniqueSplit:
    """A table's distinct keys on this rank, split by row shard (UB distribution)."""

    unique: Tensor
    inverse: Tensor
    index_of_shard: list[Tensor]
    """positions in `unique` of row shard j's keys, ascending key order"""

    def keys_of_shard(self, j: int) -> Tensor:
        return self.unique[self.index_of_shard[j]]


def unique_by_row_shard(
    kernels: Kernels, keys: Tensor, rows: int, row_shards: int, partition: str
) -> UniqueSplit:
    unique, inverse = kernels.dedup(keys)
    order, counts, _ = kernels.bucketize(unique, rows, row_shards, partition)
    parts = []
    start = 0
    for n in counts.tolist():
        parts.append(order[start : start + n])
        start += n
    return UniqueSplit(unique, inverse, parts)


def unit_lengths_at_owner(
    lengths: Tensor, positions: Tensor | None, pooling: str, hotness: int
) -> Tensor:
    """The slot lengths of one feature's shard part as received by an owner."""
    if pooling != "concat":
        return lengths.to(torch.int64)
    assert positions is not None
    b = lengths.numel()
    sample = torch.repeat_interleave(
        torch.arange(b, device=lengths.device), lengths.to(torch.int64)
    )
    slot = sample * hotness + positions
    return torch.bincount(slot, minlength=b * hotness)


def offsets_of(lengths: Tensor) -> Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
