"""Machine-readable summaries: what `check`, `plan` and `simulate` print with
`--format json` (one JSON object on stdout, numbers in bytes and seconds, as in the plan
file), and the line `plan` prints for a `--target` plan.

Each summary carries `"kind"` (`spec`, `plan_file`, `plan`, `simulation`) so that a tool
reading several knows which it has.
"""

from __future__ import annotations

from typing import Any


def target_line(target: dict[str, Any]) -> str:
    """`planned for torchrec: 1.08x the unrestricted plan's step time (...)`."""
    from embark_runtime.formatting import format_ms

    pinned = target.get("pinned") or {}
    pins = f"; {len(pinned)} table{'s' if len(pinned) != 1 else ''} pinned" if pinned else ""
    return (
        f"planned for {target['system']}: {target['slowdown']:.3f}x the unrestricted plan's "
        f"step time ({format_ms(target['unrestricted_step_time'])}){pins}"
    )


def spec_summary(path: str, program: Any) -> dict[str, Any]:
    """`check --format json` of a spec."""
    topo = program.topology
    kinds: dict[str, int] = {}
    for t in program.tables:
        kinds[t.optimizer.kind] = kinds.get(t.optimizer.kind, 0) + 1
    per_gpu = topo.hbm_bytes - program.options.memory_headroom
    return {
        "kind": "spec",
        "file": path,
        "ok": True,
        "nodes": topo.nodes,
        "gpus_per_node": topo.gpus_per_node,
        "gpus": topo.world_size,
        "arch": topo.arch,
        "hbm_bytes": topo.hbm_bytes,
        "memory_headroom_bytes": program.options.memory_headroom,
        "tables": len(program.tables),
        "optimizers": dict(sorted(kinds.items())),
        "features": len(program.features),
        "parameters": program.parameters,
        "weight_bytes": sum(t.rows * t.row_weight_bytes for t in program.tables),
        "embedding_bytes": program.embedding_bytes,
        "lookups_per_sample": program.lookups_per_sample,
        "batch_size": program.batch_size,
        "capacity_bytes": per_gpu * topo.world_size,
    }


def plan_file_summary(path: str, plan: Any, against: str) -> dict[str, Any]:
    """`check --format json` of a plan file."""
    mem = plan.memory_by_rank()
    out = _plan_fields(plan)
    out.update(kind="plan_file", file=path, ok=True, checked_against=against)
    out["max_memory_bytes"] = max(mem) if mem else 0
    return out


def plan_summary(plan: Any, wall: float, output: str | None) -> dict[str, Any]:
    """`plan --format json`."""
    out = _plan_fields(plan)
    out.update(kind="plan", wall_time=round(wall, 3), output=output)
    return out


def _plan_fields(plan: Any) -> dict[str, Any]:
    from collections import Counter

    est = plan.estimate
    extra = est.model_extra or {}
    info = plan.planner
    topo = plan.topology
    cells = Counter(s.table for s in plan.shards)
    return {
        "spec": plan.source.spec,
        "nodes": topo.nodes,
        "gpus_per_node": topo.gpus_per_node,
        "batch_size": plan.batch_size,
        "row_partition": plan.row_partition,
        "step_time": est.step_time,
        "critical_rank": extra.get("critical_rank"),
        "components": extra.get("components"),
        "per_rank": [
            {"rank": r.rank, "time": r.time, "memory_bytes": r.memory_bytes} for r in est.per_rank
        ],
        "clusters": [
            {
                "name": c.name,
                "kind": c.kind,
                "communication": c.communication,
                "tables": len(c.tables),
                "cells": sum(cells[t] for t in c.tables),
            }
            for c in plan.clusters
        ],
        "planner": {
            "strategy": info.strategy,
            "solver": info.solver,
            "status": info.status,
            "seed": info.seed,
            **{
                k: v
                for k, v in (info.model_extra or {}).items()
                if k in ("lower_bound", "greedy_step_time", "baselines", "target", "message")
            },
        },
    }


def simulation_summary(plan: Any, result: Any, diff: dict[str, Any], wall: float) -> dict[str, Any]:
    """`simulate --format json`: per rank and per cluster what was counted, and the
    difference to the plan's estimate in percent."""
    return {
        "kind": "simulation",
        "spec": plan.source.spec,
        "batches": result.batches,
        "seed": result.seed,
        "wall_time": round(wall, 3),
        "step_time": result.step_time,
        "critical_rank": result.critical_rank,
        "critical_path": result.critical_path,
        "dense_allreduce_time": result.dense_allreduce_time,
        "step_times": list(result.step_times),
        "estimate_step_time": plan.estimate.step_time,
        "difference_percent": diff,
        "per_rank": [
            {
                "rank": r.rank,
                "time": r.time,
                "ids": r.ids,
                "distinct": r.distinct,
                "hbm_bytes": r.hbm_bytes,
                "intra_node_bytes": sum(v["intra"] for v in r.sent.values()),
                "inter_node_bytes": sum(v["inter"] for v in r.sent.values()),
                "components": dict(r.components),
            }
            for r in sorted(result.per_rank, key=lambda r: r.rank)
        ],
        "clusters": {
            name: {"intra_node_bytes": v["intra"], "inter_node_bytes": v["inter"]}
            for name, v in result.clusters.items()
        },
    }
