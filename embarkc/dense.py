"""The dense part's size and arithmetic, shared by the planner and the simulator.

One description of runtime/dense.py's architecture (bottom MLP, dot or DCN-V2
interaction with the dot's bias-free projections, top MLP ending in one logit) gives:

* `parameters()`: weights and biases, the fp32 gradients the trainer all-reduces every
  step (a test checks the count against the torch model);
* `forward_flops()`: multiply-adds x 2 per sample of the bottom MLP and of the rest
  (projections, interaction, top MLP). Bias adds, ReLUs and the DCN-V2 elementwise
  terms are counted one FLOP per element; the dot interaction's batched matmul computes
  the whole `n x n` Gram matrix, as `torch.bmm` does.

`prefetch_window` turns them into the time in which the next batch's keys travel while
this step's dense part computes (docs/communication.md, "Overlap").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from embarkc.planner import constants as K


@dataclass(frozen=True)
class DenseShape:
    """The dense model's layer widths; `feature_widths` in the order features are fed."""

    dense_features: int
    bottom_mlp: tuple[int, ...]
    interaction: str
    top_mlp: tuple[int, ...]
    feature_widths: tuple[int, ...]
    cross_layers: int = 3
    low_rank: int = 512

    @classmethod
    def of(cls, model: Mapping[str, Any], feature_widths: Sequence[int]) -> DenseShape:
        """From a model as dumped into a plan (`plan.model`) or `ir.DenseModel.model_dump`."""
        inter = model.get("interaction") or {}
        if not isinstance(inter, Mapping):
            inter = {"kind": str(inter)}
        return cls(
            dense_features=int(model.get("dense_features", 0)),
            bottom_mlp=tuple(int(x) for x in model.get("bottom_mlp", ())),
            interaction=str(inter.get("kind", "dot")),
            top_mlp=tuple(int(x) for x in model.get("top_mlp", (1,))),
            feature_widths=tuple(int(w) for w in feature_widths),
            cross_layers=int(inter.get("layers", 3)),
            low_rank=int(inter.get("low_rank", 512)),
        )

    def _layers(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """(parameters, forward FLOPs per sample) of every layer: bottom, then the rest."""
        bottom: list[tuple[int, float]] = []
        rest: list[tuple[int, float]] = []

        def linear(out: list[tuple[int, float]], a: int, c: int, bias: bool = True) -> None:
            out.append((a * c + (c if bias else 0), 2.0 * a * c + (2.0 * c if bias else 0.0)))

        d = self.dense_features
        for w in self.bottom_mlp:
            linear(bottom, d, w)
            d = w
        has_x = self.dense_features > 0
        widths = self.feature_widths
        if self.interaction == "dot":
            if not has_x and widths:
                d = widths[0]
            for w in widths:
                if w != d:
                    linear(rest, w, d, bias=False)
            n = len(widths) + int(has_x)
            rest.append((0, 2.0 * n * n * d))  # the Gram matrix of the n vectors
            top_in = (d if has_x else 0) + n * (n - 1) // 2
        else:
            top_in = (d if has_x else 0) + sum(widths)
            for _ in range(self.cross_layers):
                linear(rest, top_in, self.low_rank, bias=False)
                linear(rest, self.low_rank, top_in)
                rest.append((0, 2.0 * top_in))  # x0 * (...) + x
        top = self.top_mlp if self.top_mlp and self.top_mlp[-1] == 1 else (*self.top_mlp, 1)
        a = top_in
        for w in top:
            linear(rest, a, w)
            a = w
        return bottom, rest

    def parameters(self) -> int:
        bottom, rest = self._layers()
        return sum(p for p, _ in bottom) + sum(p for p, _ in rest)

    def forward_flops(self) -> tuple[float, float]:
        """Forward FLOPs per sample: (bottom MLP, everything after it)."""
        bottom, rest = self._layers()
        return sum(f for _, f in bottom), sum(f for _, f in rest)


def prefetch_window(
    shape: DenseShape,
    samples_per_gpu: float,
    flops_per_second: float,
    efficiency: float,
) -> float:
    """Seconds of dense compute per step during which the next batch's keys travel.

    The trainer starts the next batch's key exchange after this step's embedding forward
    (runtime/trainer.py, `_step`): the interaction and top MLP forward and the whole dense
    backward (twice the forward's FLOPs: input and weight gradients) follow. The bottom
    MLP's forward ran before the lookup and is not part of the window. 0 when the
    hardware's dense rate is unknown (`flops_per_second` 0): no overlap is credited.
    `efficiency`: the share of that rate the GEMMs sustain (the hardware's
    `dense_efficiency`, by default constants.DENSE_EFFICIENCY).
    """
    if flops_per_second <= 0:
        return 0.0
    bottom, rest = shape.forward_flops()
    flops = rest + K.BACKWARD_FLOPS_FACTOR * (bottom + rest)
    return flops * samples_per_gpu / (flops_per_second * efficiency)
