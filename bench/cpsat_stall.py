"""CP-SAT's stall rule, old and new: `python bench/cpsat_stall.py [--specs t510 ...]
[--nodes 16 4 1] [--time-limit S] [--rounds N] [--plans DIR]`.

For every paper spec (specs/paper/NAME.embark: its own hardware, 16 x 8 GPUs, or the
same preset on --nodes nodes; its options, cp-sat at 30 s, or --time-limit), the whole
`embarkc plan SPEC -o PLAN` command as a process of its own, with the old rule (the
search stops only after `cpsat.LNS_STALL` neighbourhoods without a better plan:
`LNS_AT_LIMIT` lifted) and the new one, alternately old, new per case and round: the
process's wall and CPU seconds, the plan's step time and CP-SAT's deterministic work
(`planner.wall_time`), its neighbourhoods and why it stopped (`planner.neighbourhoods`,
`planner.stopped`), and the step times' ratio new / old.
Prints a markdown table (what bench/RESULTS.md records).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from plan_speed import timed_process  # noqa: E402

NAMES = ("dcnv2", "t180", "t200", "t510")
RULES = {
    "old": "import embarkc.planner.cpsat as c; c.LNS_AT_LIMIT = 1 << 30; ",
    "new": "",
}
"""What each rule's process runs before the command: the old rule is the new one with
`LNS_AT_LIMIT` out of reach (`LNS_STALL` as before)."""


HARDWARE = 'include "../hardware/dgx_h100_16.embark"'
"""The paper specs' hardware: 16 DGX H100 nodes."""


def spec_on(name: str, nodes: int, folder: Path) -> Path:
    """Paper spec `name` on `nodes` DGX H100 nodes: the spec itself on its own 16, else a
    copy in `folder` with its hardware written out."""
    spec = ROOT / "specs" / "paper" / f"{name}.embark"
    if nodes == 16:
        return spec
    text = spec.read_text()
    assert HARDWARE in text, f"{spec} no longer includes {HARDWARE}"
    out = folder / f"{name}-{nodes}.embark"
    out.write_text(text.replace(HARDWARE, f"hardware {{\n  preset dgx_h100\n  nodes {nodes}\n}}"))
    return out


def plan_command(spec: Path, rule: str, out: Path, limit: float | None) -> dict[str, Any]:
    """One `embarkc plan` process under `rule`: what it planned and what it took."""
    code = RULES[rule] + "import sys; from embarkc.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "plan", str(spec), "-o", str(out)]
    if limit is not None:
        cmd += ["--time-limit", f"{limit:g}"]
    _, wall, usage = timed_process(cmd)
    plan = json.loads(out.read_text())
    info = plan["planner"]
    return {
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "step": plan["estimate"]["step_time"],
        "work": info.get("wall_time", 0.0),
        "neighbourhoods": info.get("neighbourhoods"),
        "stopped": info.get("stopped"),
        "status": info["status"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--specs", nargs="+", default=NAMES, choices=NAMES)
    ap.add_argument("--rounds", type=int, default=1, help="runs of each rule per spec")
    ap.add_argument("--plans", type=Path, help="keep the plan files here (NAME-NODES-RULE.json)")
    ap.add_argument(
        "--nodes", nargs="+", type=int, default=[16], help="DGX H100 nodes (the specs' own: 16)"
    )
    ap.add_argument("--time-limit", type=float, help="the command's (default: the spec's, 30 s)")
    a = ap.parse_args()
    print(
        "| spec | GPUs | rule | wall (s) | CPU (s) | step time (ms) | cp-sat work (s) "
        "| neighbourhoods | stopped | status | new / old step time |"
    )
    print("| --- " * 11 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.plans or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for name in a.specs:
            for nodes in a.nodes:
                spec = spec_on(name, nodes, Path(tmp))
                steps: dict[str, float] = {}
                for _ in range(a.rounds):
                    for rule in RULES:
                        out = folder / f"{name}-{nodes}-{rule}.json"
                        r = plan_command(spec, rule, out, a.time_limit)
                        steps[rule] = r["step"]
                        ratio = f"{steps['new'] / steps['old']:.5f}" if rule == "new" else ""
                        print(
                            f"| {name} | {nodes * 8} | {rule} | {r['wall']:.2f} | {r['cpu']:.2f} "
                            f"| {r['step'] * 1e3:.4f} | {r['work']:.1f} | {r['neighbourhoods']} "
                            f"| {r['stopped']} | {r['status']} | {ratio} |",
                            flush=True,
                        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
