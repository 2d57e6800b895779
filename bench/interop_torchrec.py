"""Proof with the real TorchRec: an embarkc plan, exported, trains under
DistributedModelParallel the same tables as embarkc's unsharded reference.

    bash bench/peer_torchrec_setup.sh                        # once, a separate venv
    /tmp/embark-torchrec-venv/bin/python bench/interop_torchrec.py [--steps 3]

Steps: the spec below (2 nodes x 2 GPUs, one table per TorchRec sharding type, pinned by
the spec's own constraints; `row_partition range`) is planned with `--target torchrec`
(embarkc.interop.targets), the plan exported (`export_plan(plan, "torchrec")`), turned into
a ShardingPlan by `embarkc.interop.torchrec_plan.to_sharding_plan(doc, "cpu")`, and given
to DistributedModelParallel on 4 gloo processes (bench/peer_torchrec.py's worker: fused
fbgemm CPU kernels, the same synthetic batches and loss as the reference, gradient
division off). Every cell is then compared with `embark_runtime.reference` after --steps
steps: the largest difference next to the largest change training made.

Without TorchRec the script says how to install it and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

SPEC = """\
hardware {
  nodes 2
  gpus_per_node 2
  hbm 64 MiB
  hbm_bandwidth 100 GB/s
  nvlink 50 GB/s
  network 10 Gb/s
  arch sm_80
}

defaults {
  optimizer %(optimizer)s { lr 0.05 }
  hotness 3
  access zipf(1.1)
}

table tw { rows 500 dim 16 }
table cw { rows 800 dim 16 }
table rw { rows 4001 dim 8 }
table twrw { rows 3001 dim 8 }
table grid { rows 2002 dim 16 }
table dp { rows 50 dim 8 hotness 2 }

model { batch 64 }

plan {
  solver greedy
  row_partition range
  table cw { row_shards 1 column_shards 2 }
  table dp { cluster dp }
}
"""


def hand_laid(plan: object) -> object:
    """`plan` with `grid` cut into 2 column blocks x 2 row shards, each block on one node
    (grid_shard) and `cw` cut into 2 column blocks on two nodes (column_wise): the layouts
    the planner did not choose for this small spec, to run every TorchRec type."""
    from embark_runtime.plan import parse_plan, plan_to_dict

    data = plan_to_dict(plan)  # type: ignore[arg-type]
    cells = {
        "grid": [(0, 2, (0, 8), 0), (1, 2, (0, 8), 1), (0, 2, (8, 16), 2), (1, 2, (8, 16), 3)],
        "cw": [(0, 1, (0, 8), 0), (0, 1, (8, 16), 3)],
    }
    kinds = {t: c["kind"] for c in data["clusters"] for t in c["tables"]}
    assert kinds["grid"] != "dp" and kinds["cw"] != "dp", kinds
    data["shards"] = [s for s in data["shards"] if s["table"] not in cells] + [
        {"table": t, "row_shard": j, "row_shards": r, "columns": list(c), "rank": k}
        for t, cs in cells.items()
        for j, r, c, k in cs
    ]
    return parse_plan(json.dumps(data))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad"))
    a = ap.parse_args(argv)
    import peer_torchrec as peer

    missing = peer.torchrec_missing()
    if missing:
        print(missing)
        return 0
    from embark_runtime.plan import parse_plan, plan_to_dict
    from embarkc.frontend import load_program
    from embarkc.interop.plan_export import export_plan
    from embarkc.interop.targets import plan_for_target
    from embarkc.interop.torchrec_plan import to_sharding_plan
    from embarkc.planner.baselines import build_baseline

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "interop.embark"
        spec.write_text(SPEC % {"optimizer": a.optimizer})
        program = load_program(str(spec))
        plan, info = plan_for_target(program, "torchrec", time_limit=10)
    print(f"--target torchrec pinned: {info['pinned'] or 'nothing'}")
    plans = [("embarkc plan --target torchrec", plan)] + [
        (f"embarkc baseline {name}", build_baseline(program, name))
        for name in ("row-wise", "table-row-wise", "data-parallel")
    ]
    plans.append(("the target plan, 2 tables re-laid by hand", hand_laid(plan)))
    failed = 0
    print(
        f"| plan | TorchRec sharding types | max abs diff after {a.steps} {a.optimizer} steps | max abs change | elements |"
    )
    print("| --- | --- | ---: | ---: | ---: |")
    for label, p in plans:
        doc, warnings = export_plan(plan_to_dict(p), "torchrec")
        types = ", ".join(sorted({f"{rec['sharding_type']}" for rec in doc["plan"].values()}))
        for w in warnings:
            print(f"  ({label}) warning: {w}", file=sys.stderr)
        # the worker builds TorchRec's plan with this instead of its own generators
        peer.sharding_plan = lambda *args, _doc=doc, **kw: to_sharding_plan(_doc, "cpu")
        parsed = parse_plan(json.dumps(plan_to_dict(p)))
        r = peer.check_torchrec(parsed, "exported", a.steps, parsed.topology.gpus_per_node)
        if "error" in r:
            print(f"| {label} | {types} | error: {r['error']} ({r['where']}) | | |")
            failed += 1
            continue
        ok = not r["tables_not_covered"] and r["max_diff"] <= 1e-4 * max(1.0, r["max_change"])
        failed += not ok
        print(
            f"| {label} | {types} | {r['max_diff']:.1e}{'' if ok else ' MISMATCH'} | "
            f"{r['max_change']:.2e} | {r['elements']:,} |"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
