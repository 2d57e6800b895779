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

from embark_runtime.formatting import format_ms
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
        a = top_in
        for w in self.top_mlp:  # ends in the logit (the language and plan files insist)
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


@dataclass(frozen=True)
class Iteration:
    """One training iteration as the generated trainer runs it (runtime/trainer.py,
    `_step`), from a plan's estimate: seconds of each part and what overlaps what.

    The trainer runs, in order: the bottom MLP's forward; the embedding forward (the
    keys were sent during the previous step's dense compute); the interaction and top
    MLP forward and the whole dense backward, during which the next batch's keys travel;
    the embedding backward, whose dp gradient exchange stays in flight while the dense
    gradients are all-reduced; the optimizers. So the iteration is the embedding step
    (the plan's `step_time`, key time beyond the dense window only) plus the dense
    forward and backward plus the dense all-reduce, less the part of the dp exchange that
    the all-reduce hides."""

    embedding: float
    """The plan's step time: lookups, keys beyond the window, exchanges, dp exchange."""
    dense: float
    """The dense part's forward and backward on one GPU's samples (0: no dense rate)."""
    dense_allreduce: float
    """The dense model's gradient all-reduce."""
    hidden: float
    """Seconds of the dp exchange that run under the dense all-reduce."""
    batch: int
    known: bool
    """False when the hardware states no dense_flops: the dense part is not counted."""

    @property
    def seconds(self) -> float:
        return self.embedding + self.dense + self.dense_allreduce - self.hidden

    @property
    def samples_per_second(self) -> float:
        return self.batch / self.seconds if self.seconds > 0 else 0.0


def iteration_of(plan: Any) -> Iteration:
    """The `Iteration` of a plan (a `Plan` or a loaded plan file): its estimate, its dense
    model at the topology's dense rate and the hardware's `dense_efficiency`."""
    est = plan.estimate
    extra = est.model_extra or {}
    ranks = list(est.per_rank or [])
    crit = extra.get("critical_rank")
    if crit is None and ranks:
        crit = max(ranks, key=lambda r: r.time).rank
    comps: dict[str, float] = next(
        (getattr(r, "components", None) or {} for r in ranks if r.rank == crit), {}
    )
    topo = plan.topology
    model = getattr(plan, "model", None)
    dense = 0.0
    known = model is not None and topo.dense_flops > 0
    if model is not None and known:
        by_name = {t.name: t for t in plan.tables}
        widths = [
            by_name[f.table].dim * (f.bag_max if f.pooling == "concat" else 1)
            for f in plan.features
        ]
        data = model if isinstance(model, Mapping) else model.model_dump(mode="json")
        bottom, rest = DenseShape.of(data, widths).forward_flops()
        flops = (bottom + rest) * (1 + K.BACKWARD_FLOPS_FACTOR)
        rate = topo.dense_flops * K.of(topo).dense_efficiency
        dense = flops * plan.batch_size / plan.world_size / rate
    allreduce = float(extra.get("dense_allreduce_time", 0.0) or 0.0)
    dp = float(comps.get("dp_exchange", 0.0))
    return Iteration(
        embedding=float(est.step_time),
        dense=dense,
        dense_allreduce=allreduce,
        hidden=min(dp, allreduce),
        batch=int(plan.batch_size),
        known=known,
    )


def iteration_lines(plan: Any) -> list[str]:
    """What `plan`, the report and the generated README say of the whole iteration: the
    embedding step, the dense forward and backward, the dense all-reduce, what overlaps
    what, the iteration and samples/s."""
    it = iteration_of(plan)
    ms = format_ms
    lines = [
        f"embedding step {ms(it.embedding)} (lookups, keys beyond the dense window, "
        "exchanges, dp exchange: the planner's step time)"
    ]
    if it.known:
        lines.append(
            f"dense forward + backward {ms(it.dense)} (the model's FLOPs on one GPU's "
            "samples; the next batch's keys travel during it)"
        )
    else:
        lines.append("dense forward + backward not counted (the hardware gives no dense_flops)")
    if it.dense_allreduce > 0:
        lines.append(
            f"dense all-reduce {ms(it.dense_allreduce)}"
            + (f", with {ms(it.hidden)} of the dp exchange running under it" if it.hidden else "")
        )
    lines.append(
        f"iteration {ms(it.seconds)} as the trainer runs it, {it.samples_per_second:,.0f} "
        f"samples/s{'' if it.known else ' (without the dense part)'}"
    )
    return lines
