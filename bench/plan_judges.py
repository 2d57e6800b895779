"""Plan quality under other judges: do embarkc's plans stay ahead when the time model changes?

The planner optimises its own cost model, and `embarkc simulate` times the counted bytes
with the same conversion (`embarkc.simulate.step_time_of`). Outside reviewers judge plans
with their own models of the same hardware. This bench plans every paper spec once (embarkc
with CP-SAT and greedy-only, and every fixed strategy), counts every plan's traffic on the
SAME sampled batches with the simulator, and converts the counts to step times under
several judges that differ from ours in how the hardware is assumed to behave:

* `embarkc`: our conversion, recomputed here from the counts (checked against the
  simulator's own step time: the bench stops if they differ).
* `concurrent links`: NCCL drives NVLink and the NIC at once, so each all-to-all phase
  takes the longer of its NVLink and NIC times instead of their sum. The counts do not
  separate the two steps of hierarchical rb (NVLink to the rail peers, then the NIC), so
  they overlap too, as in a runtime that pipelines them in chunks (ours runs them one
  after the other).
* `pipelined`: HBM work and both links overlap completely (a perfectly pipelined
  runtime); a rank's time is the busiest of its HBM, NVLink and NIC totals plus the fixed
  latencies, each link's total less the keys it carries during the dense compute window
  (up to the window). An optimistic bound.
* `network x0.5`, `hbm x0.5`, `nvlink x0.5`: one resource reaches only half the
  efficiency our constants assume (a congested fabric; gather kernels far below the
  roofline; NVLink all-to-all at small messages).
* `latency x5`: every fixed collective and kernel-launch latency five times ours.
* `keys in full`: no key time hides under the dense compute (a trainer run with
  `--no-overlap`, or a judge that does not credit the prefetch; our model before
  `hardware.dense_flops`).
* `dense x8 faster`: the dense part computes eight times faster than our fp32 window
  assumes (TF32 or bf16 tensor cores), so only an eighth as much key time hides.
* `keys hidden`: the key all-to-all costs no time of its own, only its share of the
  links, however long it is: it overlaps the whole step as well as the dense compute
  window. A rank's time is the larger of its step without the key phase and each link's
  total occupancy (keys included) less the keys it carries during the window (up to the
  window). A bound for a runtime that streams keys at any time.
* `forward waits`: the forward all-to-all of the results starts when the last rank
  enters it (NCCL's point-to-point transfers of large messages move only while both
  peers run the collective's kernel), so a rank that finishes its lookups early cannot
  send ahead. The step is the slowest rank's chain from the backward all-to-all to the
  forward one (backward results, HBM work of the update and the next lookups, dp
  exchange) plus the slowest rank's forward all-to-all, plus the keys beyond the window
  of the slowest key phase. Ours lets a rank's forward results start when its own
  lookups end, as if every peer were ready then.
* `phases wait`: every phase waits for every rank (bulk-synchronous): the sum over the
  phases (HBM work, keys beyond the window, forward and backward all-to-alls, dp
  exchange) of the slowest rank's time in it. A pessimistic bound: a plan that trades a
  rank's lookups against its links loses what it traded.

The plans are not re-planned per judge: the question is how plans made for our model fare
under another. For each judge the bench prints the step time of every plan and the ratios
the issue sets targets for (>= 2x table-row-wise, >= 1.3x the best fixed strategy under
that judge, CP-SAT >= greedy), and writes bench/results_judges.md.

    python bench/plan_judges.py [--specs dcnv2 t180] [--topologies 16x8 4x8] [--time-limit 30]
                                [--batches 1] [--out PATH]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPECS = ("dcnv2", "t180", "t200", "t510")
A2A_PHASES = ("distributor", "forward", "backward", "dp_exchange")
"""The all-to-all-like phases, the key phase first: a rank's time in each is its busier
direction per link."""


@dataclass(frozen=True)
class Judge:
    name: str
    hbm: float = 1.0
    """Factor on our HBM efficiency."""
    nvlink: float = 1.0
    network: float = 1.0
    latency: float = 1.0
    """Factor on every fixed latency (collective calls, kernel launches)."""
    links: str = "serial"
    """serial: NVLink then NIC time per phase (ours); concurrent: the longer of the two;
    pipelined: max(HBM, NVLink total, NIC total) per rank."""
    keys_hidden: bool = False
    """The key phase overlaps the rest of the step and only occupies the links."""
    window: float = 1.0
    """Factor on our dense compute window, under which key time hides."""
    sync: str = "none"
    """none: a rank's phases add, the slowest rank decides (ours); forward: the forward
    all-to-all starts when every rank has entered it; phases: every phase waits for
    every rank."""


JUDGES = (
    Judge("embarkc"),
    Judge("concurrent links", links="concurrent"),
    Judge("pipelined", links="pipelined"),
    Judge("network x0.5", network=0.5),
    Judge("hbm x0.5", hbm=0.5),
    Judge("nvlink x0.5", nvlink=0.5),
    Judge("latency x5", latency=5.0),
    Judge("keys in full", window=0.0),
    Judge("dense x8 faster", window=0.125),
    Judge("keys hidden", keys_hidden=True),
    Judge("forward waits", sync="forward"),
    Judge("phases wait", sync="phases"),
)


@dataclass(frozen=True)
class _Parts:
    """One rank's step under a judge, before the phases are combined."""

    hbm: float
    per_phase: list[tuple[float, float]]
    """(NVLink, NIC) seconds of each of A2A_PHASES."""
    fixed: float
    key_calls: float
    window: float


def _parts(plan: Any, rc: Any, judge: Judge, window: float | None) -> _Parts:
    from embarkc.planner import constants as C
    from embarkc.simulate import hierarchical_rb_clusters, hierarchical_ub_clusters, key_window

    topo = plan.topology
    many = topo.world_size > 1
    window = (key_window(plan) if window is None else window) * judge.window
    bw_hbm = topo.hbm_bandwidth * C.HBM_EFFICIENCY * judge.hbm
    bw_i = topo.intra_node_bandwidth * C.NVLINK_EFFICIENCY * judge.nvlink
    bw_n = topo.inter_node_bandwidth * C.NETWORK_EFFICIENCY * judge.network
    a2a = sum(1 for c in plan.clusters if c.kind != "dp")
    hier = hierarchical_rb_clusters(plan)  # flat rb on one node
    ub = sum(1 for c in plan.clusters if c.kind == "ub")
    hub = hierarchical_ub_clusters(plan)  # flat ub on one node
    dp = int(any(c.kind == "dp" for c in plan.clusters))
    call = C.COLLECTIVE_LATENCY_SECONDS + (C.INTER_NODE_LATENCY_SECONDS if topo.nodes > 1 else 0.0)
    call *= judge.latency
    launch = C.KERNEL_LAUNCH_SECONDS * judge.latency
    fixed = (3 * (a2a + dp) + 2 * ub + 3 * hub) * launch
    key_calls = (a2a + hub) * call if many else 0.0
    if many:
        fixed += key_calls + (2 * a2a + 2 * hier + 2 * hub) * call + dp * call

    def link(phase: str, lk: str) -> float:
        nbytes = max(rc.sent.get(phase, {}).get(lk, 0.0), rc.received.get(phase, {}).get(lk, 0.0))
        return nbytes / (bw_i if lk == "intra" else bw_n)

    per_phase = [(link(p, "intra"), link(p, "inter")) for p in A2A_PHASES]
    return _Parts(rc.hbm_bytes / bw_hbm, per_phase, fixed, key_calls, window)


def _phase_times(judge: Judge, parts: _Parts) -> list[float]:
    """Seconds of each of A2A_PHASES on the rank, its two links serial or concurrent."""
    if judge.links == "concurrent":
        return [max(ti, tn) for ti, tn in parts.per_phase]
    return [ti + tn for ti, tn in parts.per_phase]


def rank_seconds(
    plan: Any, rc: Any, ring: tuple[float, float], judge: Judge, window: float | None = None
) -> float:
    """One rank's step time under `judge`, from the simulator's counts `rc` (a RankCounts),
    its phases added (a judge that synchronises phases combines ranks in `step_seconds`).

    `ring` is the dp dense all-reduce's (NVLink, NIC) seconds of its slowest rank: the
    phases of the hierarchical all-reduce move in lock step, so every rank waits for it.
    With `judge` = Judge("embarkc") this is `embarkc.simulate.step_time_of`'s sum.
    """
    parts = _parts(plan, rc, judge, window)
    hbm, per_phase, fixed, key_calls = parts.hbm, parts.per_phase, parts.fixed, parts.key_calls
    window = parts.window
    # each link's total occupancy over the step
    nvl = sum(t for t, _ in per_phase) + ring[0]
    net = sum(t for _, t in per_phase) + ring[1]
    key_i, key_n = per_phase[0]  # A2A_PHASES[0] is the key phase
    # with the links running at once, each carries up to a window of keys during the
    # dense compute
    nvl_step = nvl - min(key_i, window)
    net_step = net - min(key_n, window)
    if judge.links == "pipelined":
        return max(hbm, nvl_step, net_step) + fixed
    if judge.keys_hidden:
        chain = hbm + nvl + net - key_i - key_n
        # the key calls hide as well
        return max(chain, nvl_step, net_step) + fixed - key_calls
    # the key phase (first) counts only beyond the dense compute window
    times = _phase_times(judge, parts)
    comm = max(0.0, times[0] - window) + sum(times[1:])
    return hbm + comm + ring[0] + ring[1] + fixed


def synchronized_seconds(
    plan: Any, per_rank: list[Any], ring: tuple[float, float], judge: Judge, window: float
) -> float:
    """The step time under a judge whose collectives wait for every rank (`judge.sync`
    "forward" or "phases"), from every rank's counts."""
    parts = [_parts(plan, rc, judge, window) for rc in per_rank]
    phases = [_phase_times(judge, p) for p in parts]  # distributor, forward, backward, dp
    # the key phase is a collective: its slowest rank's time beyond the window
    keys = max(0.0, max(t[0] for t in phases) - parts[0].window)
    fwd = max(t[1] for t in phases)
    if judge.sync == "phases":
        rest = max(p.hbm for p in parts) + max(t[2] for t in phases) + max(t[3] for t in phases)
    else:
        rest = max(p.hbm + t[2] + t[3] for p, t in zip(parts, phases, strict=True))
    # latencies and launches are the same on every rank
    return rest + keys + fwd + ring[0] + ring[1] + parts[0].fixed


def ring_seconds(plan: Any, per_rank: list[Any], judge: Judge) -> tuple[float, float]:
    """(NVLink, NIC) seconds of the dp dense all-reduce on its slowest rank."""
    from embarkc.planner import constants as C

    topo = plan.topology
    bw_i = topo.intra_node_bandwidth * C.NVLINK_EFFICIENCY * judge.nvlink
    bw_n = topo.inter_node_bandwidth * C.NETWORK_EFFICIENCY * judge.network
    best = (0.0, 0.0)
    for rc in per_rank:
        ring = rc.sent.get("ring", {})
        t = (ring.get("intra", 0.0) / bw_i, ring.get("inter", 0.0) / bw_n)
        if sum(t) > sum(best):
            best = t
    return best


def step_seconds(plan: Any, result: Any, judge: Judge) -> float:
    """The plan's step time under `judge`: its slowest rank's."""
    from embarkc.simulate import key_window

    ring = ring_seconds(plan, result.per_rank, judge)
    window = key_window(plan)
    if judge.sync != "none":
        return synchronized_seconds(plan, result.per_rank, ring, judge, window)
    return max(rank_seconds(plan, rc, ring, judge, window) for rc in result.per_rank)


@functools.cache
def _plan_quality() -> Any:
    """bench/plan_quality.py as a module (its planning helpers), loaded once."""
    spec = importlib.util.spec_from_file_location(
        "plan_quality", ROOT / "bench" / "plan_quality.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def judge_spec(spec: str, topology: str, batches: int, time_limit: float) -> dict[str, Any]:
    """label -> {judge name: step seconds} (or the reason the strategy has no plan)."""
    from embarkc.frontend import load_program
    from embarkc.simulate import simulate_many

    pq = _plan_quality()
    program = pq.with_topology(load_program(ROOT / "specs" / "paper" / f"{spec}.embark"), topology)
    planned = pq.plans_for(program, time_limit)
    labels = [k for k, v in planned.items() if not isinstance(v, str)]
    plans = [planned[k] for k in labels]
    print(f"  simulating {len(plans)} plans of {spec}", file=sys.stderr)
    results = simulate_many(plans, batches=batches, seed=0)
    out: dict[str, Any] = {k: v for k, v in planned.items() if isinstance(v, str)}
    for label, plan, res in zip(labels, plans, results, strict=True):
        times = {j.name: step_seconds(plan, res, j) for j in JUDGES}
        if abs(times["embarkc"] - res.step_time) > 1e-9 * max(res.step_time, 1e-12):
            raise SystemExit(
                f"{spec} {label}: the embarkc judge gives {times['embarkc']:.9f} s, the "
                f"simulator {res.step_time:.9f} s; rank_seconds no longer mirrors step_time_of"
            )
        out[label] = times
    return out


def summarize(spec: str, topology: str, rows: dict[str, Any]) -> list[str]:
    from embarkc.planner.baselines import FIXED

    labels = ["embark cp-sat", "embark greedy", *FIXED]
    out = [f"#### {spec} at {topology}", ""]
    out.append(
        "| judge | "
        + " | ".join(labels)
        + " | vs table-row-wise | vs best fixed | cp-sat vs greedy |"
    )
    out.append("|---" * (len(labels) + 4) + "|")
    for j in JUDGES:
        cells = []
        for label in labels:
            r = rows.get(label)
            cells.append(
                "does not fit" if isinstance(r, str) or r is None else f"{r[j.name] * 1e3:.3f}"
            )
        ours = rows["embark cp-sat"][j.name]
        greedy = rows["embark greedy"][j.name]
        fixed = [(rows[n][j.name], n) for n in FIXED if isinstance(rows.get(n), dict)]
        trw = rows.get("table-row-wise")
        vs_trw = f"{trw[j.name] / ours:.2f}x" if isinstance(trw, dict) else "n/a"
        best = min(fixed)
        out.append(
            f"| {j.name} | "
            + " | ".join(cells)
            + f" | {vs_trw} | {best[0] / ours:.2f}x ({best[1]}) | {greedy / ours:.3f}x |"
        )
    out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=list(SPECS), choices=SPECS)
    ap.add_argument("--topologies", nargs="+", default=["16x8"], type=_plan_quality().topology_arg)
    ap.add_argument("--batches", type=_plan_quality().positive_arg(int), default=1)
    ap.add_argument("--time-limit", type=_plan_quality().positive_arg(float), default=30.0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results_judges.md"))
    args = ap.parse_args(argv)
    pq = _plan_quality()
    head = pq.report_head(
        "Plan quality under other judges",
        "plan_judges.py",
        argv,
        "Step times in ms of the same plans, counted by `embarkc simulate` on the same "
        f"{args.batches} sampled batch(es) (seed 0), converted to time by each judge (the "
        f"module docstring says what each assumes). CP-SAT time limit {args.time_limit:g} s. "
        "`vs best fixed` divides the best fixed strategy's time under that judge by "
        "embarkc's (cp-sat) under the same judge.",
    )

    def part_of(spec: str) -> list[str]:
        part = [f"### {spec}", ""]
        for topology in args.topologies:
            rows = judge_spec(spec, topology, args.batches, args.time_limit)
            part += summarize(spec, topology, rows)
        return part

    pq.write_report(args.out, head, args.specs, part_of)
    return 0


if __name__ == "__main__":
    sys.exit(main())
