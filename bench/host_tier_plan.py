"""The planner's host tier: the step time by cache size, and planning time with tiers.

Two tables, for a paper workload on far fewer GPUs than its tables need in HBM (T180 on
one DGX H100 node whose GPUs keep --hbm of HBM for embeddings; its tables need 247 GiB):

* **The curve the planner walks.** The plan's placement, with every host-tier cell's
  cache set to one share of its rows (the shares of `embarkc.planner.tiers.SHARES`), costed
  by the cost model: the step time, the expected hit rate over the host tables, the
  fullest GPU's HBM and whether it fits. The planner's own plan (tiers chosen by the cost
  per byte freed, caches grown per rank into the free HBM) is the last row.
* **Planning time.** `plan_program` on the same spec with enough HBM for every table
  (no host tier: the plan of before) and with --hbm (the host tier), wall and CPU time
  of this process, each --rounds times, alternating, medians.

    python bench/host_tier_plan.py                      # T180, 16 GiB a GPU
    python bench/host_tier_plan.py --hbm 24 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HARDWARE = 'include "../hardware/dgx_h100_16.embark"'


def spec_text(hbm_gib: float | None) -> str:
    text = (ROOT / "specs" / "paper" / "t180.embark").read_text()
    assert text.count(HARDWARE) == 1
    hbm = f" hbm {hbm_gib:g} GiB" if hbm_gib is not None else ""
    return text.replace(HARDWARE, f"hardware {{ preset dgx_h100 nodes 1{hbm} }}")


def plan_once(text: str) -> tuple[float, float, object]:
    from embarkc.frontend import load_program_text
    from embarkc.planner import plan_program

    w, c = time.perf_counter(), time.process_time()
    prog = load_program_text(text, str(ROOT / "specs" / "paper" / "t180_1node.embark"))
    plan = plan_program(prog)
    return time.perf_counter() - w, time.process_time() - c, (prog, plan)


def curve(prog, plan) -> list[dict]:
    """Step time, hit rate and fullest HBM of the plan's placement by cache share."""
    from embarkc.planner.cost import CostModel, cache_rows_of, layout_of_plan, shard_rows
    from embarkc.planner.tiers import SHARES, _with_cache

    cm = CostModel(prog)
    layout = layout_of_plan(plan)
    rows = []
    for share in SHARES[1:]:
        shaped = {}
        for name, p in layout.items():
            if p.cache is None:
                shaped[name] = p
                continue
            r = shard_rows(cm.facts[name].rows, p.row_shards, cm.partition)
            j = np.array([c[0] for c in p.cell_list()])
            shaped[name] = _with_cache(p, tuple(int(x) for x in cache_rows_of(r[j], share)))
        rows.append(_row(cm, shaped, f"{share:g}"))
    rows.append(_row(cm, layout, "the plan"))
    return rows


def _row(cm, layout, label: str) -> dict:
    est = cm.evaluate_layout(layout)
    tables = est["host_tier"]["tables"]
    lookups = sum(t["lookups"] for t in tables)
    misses = sum(t["misses"] for t in tables)
    held = max(r["memory_bytes"] + r["memory"]["buffers"] for r in est["per_rank"])
    return {
        "share": label,
        "step_ms": est["step_time"] * 1e3,
        "hit": 1 - misses / lookups,
        "hbm_gib": held / 2**30,
        "fits": held <= cm.capacity,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hbm", type=float, default=16.0, help="GiB of HBM a GPU (default 16)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    plain, tiered = spec_text(None), spec_text(args.hbm)
    times: dict[str, list[tuple[float, float]]] = {"in HBM (80 GiB)": [], "host tier": []}
    result = None
    for _ in range(args.rounds):
        for label, text in (("in HBM (80 GiB)", plain), ("host tier", tiered)):
            wall, cpu, out = plan_once(text)
            times[label].append((wall, cpu))
            if label == "host tier":
                result = out
    assert result is not None
    prog, plan = result
    print(f"T180 on 1 node x 8 H100, {args.hbm:g} GiB of HBM a GPU for embeddings")
    print(f"{'cache share':>12}  {'step ms':>9}  {'hit rate':>8}  {'fullest GPU':>11}  fits")
    for r in curve(prog, plan):
        print(
            f"{r['share']:>12}  {r['step_ms']:9.3f}  {r['hit']:8.1%}  "
            f"{r['hbm_gib']:8.2f} GiB  {'yes' if r['fits'] else 'no'}"
        )
    print()
    print(f"{'planning':>16}  {'wall s':>7}  {'cpu s':>7}  (median of {args.rounds})")
    for label, ts in times.items():
        wall = statistics.median(t[0] for t in ts)
        cpu = statistics.median(t[1] for t in ts)
        print(f"{label:>16}  {wall:7.2f}  {cpu:7.2f}")
    base = statistics.median(t[1] for t in times["in HBM (80 GiB)"])
    print(
        f"host tier / in HBM, CPU: {statistics.median(t[1] for t in times['host tier']) / base:.2f}x"
    )


if __name__ == "__main__":
    main()
