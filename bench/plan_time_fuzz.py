"""Planning time on random medium-sized specs at a short limit:
`python bench/plan_time_fuzz.py [--limit S] [--seeds A B]`.

Each seed writes a spec of 5 to 200 tables (rows log-uniform in [1e3, 3e7], dims 16 to
256, hotness 1 to 100, every optimizer and pooling, zipf access) on 1 to 16 nodes of 8
H100s whose HBM the tables' weights and state fill to about 30, 70, 90 or 97 %, with
communication auto, flat or hierarchical, and plans it as `embarkc plan` does
(`plan_program`, cp-sat) at `--limit` seconds. Prints a markdown table of the planner's
CPU seconds in this process (the command adds Python's start and the spec's parse),
flagging those above 1.5x the limit, with the plan's step time or the refusal, the
fastest fixed strategy where the limit left room to cost them, and whether the search
went on from a fixed strategy's layout (`planner.fixed_start`) or kept one
(`planner.fixed_strategy`). It looks for specs on which the deterministic work budgets
miss the wall clock by far (what bench/results_planner.md records), and for specs on
which the search's own starts lose to a fixed strategy.
"""

from __future__ import annotations

import argparse
import random
import time

from embarkc.diagnostics import EmbarkError
from embarkc.frontend import load_program_text
from embarkc.planner import plan_program

STATE = {"sgd": 0, "adagrad": 1, "adam": 2, "rowwise_adagrad": 0}
"""Optimizer state in weights' widths (rowwise_adagrad: one value per row)."""


def random_spec(seed: int) -> tuple[str, dict[str, object]]:
    rng = random.Random(seed)
    n = rng.choice((5, 12, 30, 80, 200))
    nodes = rng.choice((1, 2, 4, 8, 16))
    comm = rng.choice(("auto", "auto", "flat", "hierarchical"))
    fill = rng.choice((0.3, 0.7, 0.9, 0.97))
    lines = []
    total = 0
    for i in range(n):
        rows = int(10 ** rng.uniform(3, 7.5))
        dim = rng.choice((16, 32, 64, 128, 256))
        hot = max(1, int(round(10 ** rng.uniform(0, 2))))
        opt = rng.choice(tuple(STATE))
        pool = rng.choice(("sum", "sum", "mean", "concat")) if hot <= 20 else "sum"
        alpha = round(rng.uniform(1.02, 1.3), 2)
        lines.append(
            f"table t{i} {{ rows {rows} dim {dim} hotness {hot} optimizer {opt} "
            f"pooling {pool} access zipf({alpha}) }}"
        )
        total += rows * (dim * (1 + STATE[opt]) + (opt == "rowwise_adagrad")) * 4
    hbm = max(int(total / (nodes * 8 * fill)), 64 << 20)
    batch = rng.choice((4096, 16384, 65536))
    text = (
        f"hardware {{ preset dgx_h100 nodes {nodes} hbm {hbm} B }}\n"
        f"model {{ batch {batch} }}\n" + "\n".join(lines) + f"\nplan {{ communication {comm} }}\n"
    )
    return text, {"tables": n, "topo": f"{nodes}x8", "comm": comm, "fill": fill, "batch": batch}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=float, default=3.0, help="time limit (s)")
    ap.add_argument("--seeds", type=int, nargs=2, default=(0, 24), metavar=("A", "B"))
    args = ap.parse_args()
    print("| seed | tables | GPUs | communication | fill | batch | CPU (s) | result |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for seed in range(*args.seeds):
        text, m = random_spec(seed)
        head = (
            f"| {seed} | {m['tables']} | {m['topo']} | {m['comm']} | {m['fill']} | {m['batch']} |"
        )
        try:
            program = load_program_text(text, f"random{seed}.embark")
        except EmbarkError as e:
            print(f"{head} - | spec refused: {e.diagnostics[0].message[:80]} |", flush=True)
            continue
        cpu = time.process_time()
        try:
            plan = plan_program(program, time_limit=args.limit)
            result = f"{plan.estimate.step_time * 1e3:.3f} ms ({plan.planner.status})"
            extra = plan.planner.model_extra or {}
            if fixed := extra.get("baselines"):
                name, t = min(fixed.items(), key=lambda kv: (kv[1], kv[0]))
                result += f"; best fixed {name} {t * 1e3:.3f} ms"
            if start := extra.get("fixed_start"):
                result += f"; searched on from {start}"
            if kept := extra.get("fixed_strategy"):
                result += f"; the plan is {kept}"
        except EmbarkError as e:
            result = "refused: " + e.diagnostics[0].message[:70] + " ..."
        cpu = time.process_time() - cpu
        slow = " **over 1.5x**" if cpu > 1.5 * args.limit else ""
        print(f"{head} {cpu:.1f}{slow} | {result} |", flush=True)


if __name__ == "__main__":
    main()
