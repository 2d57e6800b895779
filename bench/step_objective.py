"""Which of the plan's two step times does a real step follow? Several plans of one spec,
each run without phase barriers, their measured step times set beside both predictions.

A plan states `step_time` (the largest per-rank sum of the embedding phases, what the
planner minimises) and `critical_path` (every phase waiting for its slowest rank). One run
cannot say which the runtime follows: a rank's wall time is the sum of its own phases, the
waits for its peers included, so the run's wall time always sits at its largest per-rank
sum of measured phases (what `embarkc measured` compares it with). Across plans it can: the
plans of each strategy (embark and the fixed baselines) give different pairs (step_time,
critical_path), and the step's wall time is fitted to each prediction, `wall = a + b x`
over the plans; the prediction that explains the walls better (R^2, and the rank order of
the plans) is the one the runtime follows. The dense part and the data are the same in
every plan, so they sit in the intercept.

    python bench/step_objective.py [--spec specs/tiny.embark] [--steps 20] [--no-write]

On this CPU: 4 gloo processes (the spec's 2 x 2 ranks), the hardware file `embarkc
calibrate --quick` measured under the same torchrun just before. Writes
bench/results_step_objective.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_vs_run import BIN, ROOT, _torchrun, criteo_like, stamp  # noqa: E402

RESULTS = ROOT / "bench" / "results_step_objective.md"
STRATEGIES = ("embark", "table-wise", "row-wise", "column-wise", "table-row-wise")


def r_squared(xs: list[float], ys: list[float]) -> float:
    """R^2 of the least-squares line through (xs, ys) (1: the line explains every y)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    if sxx == 0 or syy == 0:
        return 0.0
    return sxy * sxy / (sxx * syy)


def rank_agreement(xs: list[float], ys: list[float]) -> float:
    """Share of the pairs of plans that xs and ys order the same way (Kendall's concordance)."""
    pairs = [(i, j) for i in range(len(xs)) for j in range(i + 1, len(xs))]
    same = sum((xs[i] - xs[j]) * (ys[i] - ys[j]) > 0 for i, j in pairs)
    return same / len(pairs) if pairs else 0.0


def run_plan(strategy: str, spec: Path, d: Path, steps: int) -> dict:
    """Compile `spec` with `strategy`, train `steps` steps, and the medians of the run."""
    from embark_runtime.plan import load_plan
    from embarkc.measured import compare, read_log

    out = d / f"build_{strategy}"
    r = subprocess.run(
        [str(BIN / "embarkc"), "compile", str(spec), "--strategy", strategy, "-o", str(out)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        return {"strategy": strategy, "error": r.stderr.strip().splitlines()[-1:]}
    log = d / f"log_{strategy}.jsonl"
    args = [str(out / "train.py"), "--steps", str(steps), "--measure-phases"]
    _torchrun([*args, "--log-json", str(log), "--quiet"], d)
    plan = load_plan(out / "plan.json")
    records = read_log(log)
    skip = min(5, steps - 1)
    c = compare(plan, records, skip=skip)
    walls = [max(r["phases"].get("step_s_per_rank") or [r["step_s"]]) for r in records[skip:]]
    return {
        "strategy": strategy,
        "step_time": c.predicted_step_time,
        "critical_path": c.predicted_critical_path,
        "wall": statistics.median(walls),
        "embedding_wall": c.measured_embedding_wall,
        "measured_rank_sum": c.measured_rank_sum,
        "measured_critical_path": c.measured_critical_path,
        "steps": c.steps,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "specs" / "tiny.embark"))
    ap.add_argument(
        "--criteo-like",
        action="store_true",
        help="model_vs_run.py's criteo_kaggle-like spec (rows / 100, batch 1024) in place of --spec",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from embarkc.calibrate import with_hardware

    text = criteo_like(100, 1024) if args.criteo_like else Path(args.spec).read_text()
    name = (
        "criteo_kaggle-like (bench/model_vs_run.py)" if args.criteo_like else Path(args.spec).name
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        base = d / "base.embark"
        base.write_text(text)
        hw = d / "cpu.embark"
        _torchrun(
            ["-m", "embarkc.cli", "calibrate", "--quick", "--spec", str(base), "-o", str(hw)], d
        )
        spec = d / "calibrated.embark"
        spec.write_text(with_hardware(text, hw.name))
        for s in STRATEGIES:
            row = run_plan(s, spec, d, args.steps)
            print(json.dumps(row), flush=True)
            rows.append(row)
    ok = [r for r in rows if "error" not in r]
    lines = [
        "| plan | step_time (plan) | critical_path (plan) | step wall (run) | embedding part "
        "of the wall (run) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in ok:
        lines.append(
            f"| {r['strategy']} | {r['step_time'] * 1e3:.3f} ms | {r['critical_path'] * 1e3:.3f} ms"
            f" | {r['wall'] * 1e3:.2f} ms | {r['embedding_wall'] * 1e3:.2f} ms |"
        )
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | not compiled: {' '.join(r['error'])} | | | |")
    verdict: dict[str, dict[str, float]] = {}
    if len(ok) >= 3:
        for key in ("step_time", "critical_path"):
            xs = [r[key] for r in ok]
            verdict[key] = {}
            for wall in ("wall", "embedding_wall"):
                ys = [r[wall] for r in ok]
                verdict[key] |= {
                    f"r2_{wall}": r_squared(xs, ys),
                    f"order_{wall}": rank_agreement(xs, ys),
                }
        lines += [
            "",
            "| prediction | R^2, step wall | plan pairs ordered as the step walls | R^2, "
            "embedding part | plan pairs ordered as the embedding parts |",
            "|---|---:|---:|---:|---:|",
        ]
        for key, v in verdict.items():
            lines.append(
                f"| {key} | {v['r2_wall']:.3f} | {v['order_wall']:.0%} | "
                f"{v['r2_embedding_wall']:.3f} | {v['order_embedding_wall']:.0%} |"
            )
        same = all(abs(r["critical_path"] - r["step_time"]) <= 0.05 * r["step_time"] for r in ok)
        if same:
            lines += [
                "",
                "Every plan's two step times lie within 5 %: these plans cannot tell them apart.",
            ]
    print("\n".join(lines))
    if args.no_write:
        return 0
    when, commit = stamp()
    head = [
        f"# Which step time the run follows (`python bench/step_objective.py`, {when}, "
        f"commit {commit})",
        "",
        f"{name} on 4 gloo processes ({os.cpu_count()} cores), {args.steps} "
        "steps per plan (medians after 5), --measure-phases without phase barriers, every "
        "plan costed with the hardware file `embarkc calibrate --quick` measured just before.",
        "",
    ]
    results = RESULTS.with_name(RESULTS.stem + ("_criteo_like" if args.criteo_like else ""))
    results.with_suffix(".md").write_text("\n".join(head + lines) + "\n")
    results.with_suffix(".json").write_text(
        json.dumps({"rows": rows, "verdict": verdict}, indent=2) + "\n"
    )
    print(f"wrote {results.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
