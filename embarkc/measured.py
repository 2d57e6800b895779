"""A plan's predicted phase times beside a run's measured ones (`embarkc measured`).

The run is a `train.py --measure-phases --log-json LOG` log: each step's record carries,
per rank, the exclusive seconds of every phase (embark_runtime.phases). The plan's
estimate carries, per rank, the planner's components. They are paired as:

  lookup       measured lookup + embedding_update (the planner's lookup counts the
               rows read in the forward and read and written by the fused update)
  distributor, nvlink, network, dp_exchange   one to one
  dense        measured dense_forward + dense_backward against the estimate's dense
               compute window (`key_window`; only when the hardware states dense_flops)
  dense_allreduce   against `dense_allreduce_time`

Each is compared for the plan's critical rank and for the mean over ranks, on the median
over the measured steps after the first `skip` (warm-up). The step itself: the plan's two
step times (largest per-rank sum, `step_time`, and the critical path, every phase waiting
for its slowest rank) are both measured from the run's phases, and the step's own wall
time is set beside both (`Comparison.follows`).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embarkc.diagnostics import EmbarkError

PAIRS: dict[str, tuple[str, ...]] = {
    "lookup": ("lookup", "embedding_update"),
    "distributor": ("distributor",),
    "nvlink": ("nvlink",),
    "network": ("network",),
    "dp_exchange": ("dp_exchange",),
    "dense": ("dense_forward", "dense_backward"),
    "dense_allreduce": ("dense_allreduce",),
}
"""Each compared phase: the measured phases that make it up."""

EMBEDDING = ("lookup", "distributor", "nvlink", "network", "dp_exchange")
"""The phases the plan's step_time and critical_path add up."""


@dataclass
class Row:
    phase: str
    predicted_critical: float | None
    measured_critical: float
    predicted_mean: float | None
    measured_mean: float

    def error(self, mean: bool = False) -> float | None:
        """(measured - predicted) / predicted, None without a prediction."""
        p = self.predicted_mean if mean else self.predicted_critical
        m = self.measured_mean if mean else self.measured_critical
        if p is None or p <= 0:
            return None
        return (m - p) / p


@dataclass
class Comparison:
    critical_rank: int
    steps: int
    rows: list[Row]
    predicted_step_time: float
    predicted_critical_path: float
    measured_rank_sum: float
    """The largest per-rank sum of the measured embedding phases (median over steps)."""
    measured_critical_path: float
    """The sum over embedding phases of the slowest rank's time (median over steps)."""
    measured_embedding_wall: float
    """The step's wall time less what lies outside the plan's embedding phases."""
    measured_step: float
    notes: list[str] = field(default_factory=list)

    @property
    def follows(self) -> str:
        """Which of the plan's two step times the step's own wall time (its embedding part)
        is closer to, or "undetermined" where the two predictions lie within
        SEPARATION of each other (a run cannot tell them apart). The run's measured
        largest per-rank sum is no evidence either way: a rank's wall time is the sum of
        its own phases, waits for its peers included, so it sits at that sum by
        construction (docs/measure.md, "Which step time the runtime follows")."""
        s, c = self.predicted_step_time, self.predicted_critical_path
        if s <= 0 or abs(c - s) <= SEPARATION * s:
            return "undetermined"
        wall = self.measured_embedding_wall
        return "critical_path" if abs(wall - c) <= abs(wall - s) else "step_time"


SEPARATION = 0.05
"""The least relative gap between the plan's two step times for `follows` to pick one."""


def read_log(path: Path) -> list[dict[str, Any]]:
    """The step records of a --measure-phases log that carry phases."""
    if not path.is_file():
        raise EmbarkError.at(str(path), "no such file (give the --log-json of a run)")
    records = []
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise EmbarkError.at(
                str(path), f"line {n} is not JSON ({e.msg}); give a train.py --log-json file"
            ) from None
        if isinstance(r, dict) and isinstance(r.get("phases"), dict) and "eval" not in r:
            records.append(r)
    if not records:
        raise EmbarkError.at(
            str(path),
            "no step with phase times: run train.py with --measure-phases --log-json FILE",
        )
    return records


def compare(plan: Any, records: list[dict[str, Any]], skip: int) -> Comparison:
    est = plan.estimate
    extra = est.model_extra or {}
    per_rank = sorted(est.per_rank, key=lambda r: r.rank)
    world = len(per_rank)
    notes = []
    steps = records[skip:] if len(records) > skip else records[-1:]
    if len(records) <= skip:
        notes.append(f"only {len(records)} measured steps: compared the last, no warm-up skipped")
    for r in steps:
        if len(r["phases"].get("per_rank", [])) != world:
            raise EmbarkError.at(
                "log",
                f"step {r.get('step')} has {len(r['phases'].get('per_rank', []))} ranks, the "
                f"plan {world}: give the log of a run of this plan",
            )
    crit = int(extra.get("critical_rank", max(per_rank, key=lambda r: r.time).rank))

    def measured(rank: int, phase: str, rec: dict[str, Any]) -> float:
        return sum(rec["phases"]["per_rank"][rank].get(p, 0.0) for p in PAIRS[phase])

    def med(values: list[float]) -> float:
        return statistics.median(values)

    dense_flops = float(getattr(plan.topology, "dense_flops", 0.0) or 0.0)
    window = float(extra.get("key_window", 0.0) or 0.0)
    allreduce = extra.get("dense_allreduce_time")
    rows = []
    for phase in PAIRS:
        if phase == "dense":
            pc = pm = window if dense_flops > 0 else None
        elif phase == "dense_allreduce":
            pc = pm = float(allreduce) if allreduce is not None else None
        else:
            comps = [float(r.components.get(phase, 0.0)) for r in per_rank]
            pc, pm = comps[crit], sum(comps) / world
        mc = med([measured(crit, phase, rec) for rec in steps])
        mm = med([sum(measured(q, phase, rec) for q in range(world)) / world for rec in steps])
        rows.append(Row(phase, pc, mc, pm, mm))
    if dense_flops <= 0:
        notes.append("the plan's hardware states no dense_flops: the dense phase has no prediction")

    def rank_sum(rec: dict[str, Any]) -> float:
        return max(sum(measured(q, p, rec) for p in EMBEDDING) for q in range(world))

    def critical_path(rec: dict[str, Any]) -> float:
        return sum(max(measured(q, p, rec) for q in range(world)) for p in EMBEDDING)

    def embedding_wall(rec: dict[str, Any]) -> float:
        # the wall time of the slowest rank less its phases outside the embedding ones
        walls = rec["phases"].get("step_s_per_rank") or [rec.get("step_s", 0.0)] * world
        q = max(range(world), key=lambda i: walls[i])
        outside = sum(
            v
            for p, v in rec["phases"]["per_rank"][q].items()
            if not any(p in PAIRS[e] for e in EMBEDDING)
        )
        return walls[q] - outside

    return Comparison(
        critical_rank=crit,
        steps=len(steps),
        rows=rows,
        predicted_step_time=float(extra.get("step_time", est.step_time)),
        predicted_critical_path=float(extra.get("critical_path") or est.step_time),
        measured_rank_sum=med([rank_sum(r) for r in steps]),
        measured_critical_path=med([critical_path(r) for r in steps]),
        measured_embedding_wall=med([embedding_wall(r) for r in steps]),
        measured_step=med(
            [max(r["phases"].get("step_s_per_rank") or [r["step_s"]]) for r in steps]
        ),
        notes=notes,
    )


FOLLOWS = {
    "step_time": "nearer the plan's largest per-rank sum",
    "critical_path": "nearer the plan's critical path",
    "undetermined": f"the plan's two step times lie within {SEPARATION:.0%}: this run "
    "cannot tell which one it follows",
}


def _us(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e6:,.1f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v * 100:+.0f}%"


def render(c: Comparison, tolerance: float) -> str:
    """The side-by-side table; a phase whose critical-rank or mean error exceeds
    `tolerance` (a share) is flagged `off`."""
    lines = [
        f"{c.steps} measured steps (median), critical rank {c.critical_rank}; times in us",
        "",
        f"{'phase':<16}{'plan crit':>11}{'run crit':>11}{'err':>7}"
        f"{'plan mean':>12}{'run mean':>11}{'err':>7}",
    ]
    for r in c.rows:
        errs = [e for e in (r.error(), r.error(mean=True)) if e is not None]
        flag = "  off" if any(abs(e) > tolerance for e in errs) else ""
        lines.append(
            f"{r.phase:<16}{_us(r.predicted_critical):>11}{_us(r.measured_critical):>11}"
            f"{_pct(r.error()):>8}{_us(r.predicted_mean):>12}{_us(r.measured_mean):>11}"
            f"{_pct(r.error(mean=True)):>8}{flag}"
        )
    lines += [
        "",
        "embedding part of the step (the plan's two step times):",
        f"  largest per-rank sum   plan {_us(c.predicted_step_time)}  run "
        f"{_us(c.measured_rank_sum)}",
        f"  critical path          plan {_us(c.predicted_critical_path)}  run "
        f"{_us(c.measured_critical_path)}",
        f"  the run's own wall time (less the non-embedding phases) {_us(c.measured_embedding_wall)}"
        f": {FOLLOWS[c.follows]}",
        f"whole step (slowest rank) {_us(c.measured_step)}",
    ]
    off = [
        r.phase
        for r in c.rows
        if any(abs(e) > tolerance for e in (r.error(), r.error(True)) if e is not None)
    ]
    if off:
        lines.append(
            f"off by more than {tolerance:.0%}: {', '.join(off)} (calibrate the hardware block "
            "to the machine: `embarkc calibrate`)"
        )
    lines += [f"note: {n}" for n in c.notes]
    return "\n".join(lines)


def as_json(c: Comparison) -> dict[str, Any]:
    return {
        "critical_rank": c.critical_rank,
        "steps": c.steps,
        "phases": {
            r.phase: {
                "predicted_critical": r.predicted_critical,
                "measured_critical": r.measured_critical,
                "predicted_mean": r.predicted_mean,
                "measured_mean": r.measured_mean,
                "error_critical": r.error(),
                "error_mean": r.error(mean=True),
            }
            for r in c.rows
        },
        "predicted_step_time": c.predicted_step_time,
        "predicted_critical_path": c.predicted_critical_path,
        "measured_rank_sum": c.measured_rank_sum,
        "measured_critical_path": c.measured_critical_path,
        "measured_embedding_wall": c.measured_embedding_wall,
        "measured_step": c.measured_step,
        "follows": c.follows,
        "notes": c.notes,
    }
