"""What if the cost model credited the runtime's key prefetch? Re-plan and compare.

The trainer sends the next batch's keys while the current step's dense part computes
(`ShardedEmbeddings.prefetch`); the cost model charges the key phase in full
(docs/communication.md). This experiment changes the model for one process only: a
rank's key phase costs `max(0, its key links' time - W)` plus its collective latencies,
where W is the dense part's compute time, the window the keys travel in:

    W = 6 * P_top * b / (FP32_FLOPS * DENSE_EFFICIENCY)

with P_top the parameters of the interaction and top MLP (`cost.dense_parameters` less
the bottom MLP; 2 FLOPs per parameter and sample forward, twice that backward), b the
samples per GPU, FP32_FLOPS = 67 TFLOP/s (H100 SXM fp32 without tensor cores: the
trainer does not enable TF32) and DENSE_EFFICIENCY = 0.7 (an assumption: large fp32
GEMMs). It costs today's greedy plan (made for the model that charges the keys in full)
under the changed model, then plans again with the greedy search (CP-SAT's model does
not know the change) and every fixed strategy under the changed model, and prints the
ratios the issue sets targets for. It is not a planner option: the window needs a dense compute model that
the planner does not have yet.

    python bench/whatif_key_overlap.py [--specs dcnv2 t180 t200 t510] [--efficiency 0.7]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SPECS = ("dcnv2", "t180", "t200", "t510")
FP32_FLOPS = 67e12
"""H100 SXM5 fp32 (non-tensor) peak, NVIDIA H100 datasheet."""


def install(efficiency: float, patch: Any = setattr) -> None:
    """Make every CostModel of this process credit the key prefetch (see above).

    `patch(owner, name, value)` does the replacing (a test passes pytest's
    `monkeypatch.setattr`, which undoes it)."""
    from embarkc.planner.cost import CostModel, RankState, dense_parameters, mlp_parameters

    components = RankState.components
    init = CostModel.__init__

    def windowed(self: RankState) -> dict[str, np.ndarray]:
        out = components(self)
        c = self.counts
        a2a = int(c["rb_flat"] > 0) + int(c["rb_hier"] > 0) + int(c["ub"] > 0)
        latency = a2a * self.cm.collective_latency
        links = out["distributor"] - latency
        out["distributor"] = np.maximum(links - self.cm.key_window, 0.0) + latency
        return out

    def with_window(self: CostModel, program) -> None:  # type: ignore[no-untyped-def]
        init(self, program)
        m = program.model
        pooled = sum(f.outputs for f in self.facts.values())
        top = dense_parameters(program, pooled) - mlp_parameters([m.dense_features, *m.bottom_mlp])
        self.key_window = 6.0 * top * self.b / (FP32_FLOPS * efficiency)

    patch(RankState, "components", windowed)
    patch(CostModel, "__init__", with_window)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=list(SPECS), choices=SPECS)
    ap.add_argument("--efficiency", type=float, default=0.7)
    args = ap.parse_args(argv)
    if not 0 < args.efficiency <= 1:
        ap.error(f"--efficiency {args.efficiency:g} is not a fraction of the peak in (0, 1]")
    from embarkc.frontend import load_program
    from embarkc.planner import plan_program
    from embarkc.planner.cost import CostModel, layout_of_plan

    programs = {s: load_program(ROOT / "specs" / "paper" / f"{s}.embark") for s in args.specs}
    # today's plans, made for the model that charges the keys in full
    today = {s: layout_of_plan(plan_program(p, solver="greedy")) for s, p in programs.items()}
    install(args.efficiency)
    print(
        "| workload (16 x 8) | window W (ms) | today's plan (ms) | re-planned greedy (ms) "
        "| table-wise | column-wise | table-row-wise | vs TRW | vs best fixed | plan wall (s) |"
    )
    print("| --- " * 10 + "|")
    for spec, program in programs.items():
        start = time.perf_counter()
        plan = plan_program(program, solver="greedy")
        wall = time.perf_counter() - start
        base = (plan.planner.model_extra or {})["baselines"]
        t = plan.estimate.step_time
        best = min(base.items(), key=lambda kv: kv[1])
        cm = CostModel(program)
        window = cm.key_window  # type: ignore[attr-defined]
        old = cm.step_time(today[spec])
        print(
            f"| {spec} | {window * 1e3:.3f} | {old * 1e3:.3f} | {t * 1e3:.3f} "
            f"| {base['table-wise'] * 1e3:.3f} "
            f"| {base['column-wise'] * 1e3:.3f} | {base['table-row-wise'] * 1e3:.3f} "
            f"| {base['table-row-wise'] / t:.2f}x | {best[1] / t:.2f}x ({best[0]}) "
            f"| {wall:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
