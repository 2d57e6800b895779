"""The planner at scale, as a user runs it:
`python bench/plan_scale.py [--time-limit S] [--cases NAME,...] [--keep DIR]`.

Each case writes a generated spec (`embarkc.workload.generated_program`, written by
`generated_spec`) and runs, each as a process of its own from Python's start to its exit,
`embarkc plan SPEC -o plan.json --time-limit S`, then `embarkc check SPEC` and
`embarkc check plan.json`. Per command: the exit code, wall seconds, CPU
seconds (user + system of the child) and peak RSS of the child (`os.wait4`), and for
`plan` the margin over its limit (wall - limit; the command must end within the limit
plus a small margin at any size the language accepts).

Cases: tables 1k / 10k / 100k on 128 x 8 GPUs (100,000 generated tables need more than
16 nodes); GPUs 128 / 1k / 10k (16, 128 and 1,250 nodes of 8) with 1,000 tables (a batch
of 1,280,000 on 10,000 GPUs); one table of 10^12 rows on 64 x 8 GPUs.
Prints a markdown table (what bench/RESULTS.md records).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embarkc.workload import generated_program, generated_spec

EMBARKC = [sys.executable, "-m", "embarkc.cli"]


def huge_table_spec() -> str:
    """One table of 10^12 rows (dim 4, hotness 20: 16 TB of fp32 weights) and a small
    one, on 64 x 8 GPUs (40 TB of HBM)."""
    return (
        "# one table of 10^12 rows\n"
        "hardware { preset dgx_h100 nodes 64 gpus_per_node 8 }\n"
        "model { batch 65536 dense_features 13 bottom_mlp [512, 256, 128] }\n"
        "table huge { rows 1000000000000 dim 4 hotness 20 optimizer sgd "
        "access zipf(1.1) }\n"
        "table small { rows 1000 dim 128 hotness 1 optimizer sgd access zipf(1.1) }\n"
    )


def with_batch(spec: str, batch: int) -> str:
    """`spec` with its global batch set to `batch` (the generated 65,536 does not divide
    over 10,000 GPUs)."""
    return spec.replace("model { batch 65536 ", f"model {{ batch {batch} ", 1)


CASES: dict[str, tuple[str, object]] = {
    "tables-1k": ("1,000 tables, 128 x 8", lambda: generated_spec(generated_program(1000, 128))),
    "tables-10k": (
        "10,000 tables, 128 x 8",
        lambda: generated_spec(generated_program(10_000, 128)),
    ),
    "tables-100k": (
        "100,000 tables, 128 x 8",
        lambda: generated_spec(generated_program(100_000, 128)),
    ),
    "gpus-128": ("1,000 tables, 16 x 8", lambda: generated_spec(generated_program(1000, 16))),
    "gpus-1k": ("1,000 tables, 128 x 8", lambda: generated_spec(generated_program(1000, 128))),
    "gpus-10k": (
        "1,000 tables, 1,250 x 8",
        lambda: with_batch(generated_spec(generated_program(1000, 1250)), 1_280_000),
    ),
    "rows-1e12": ("one table of 10^12 rows, 64 x 8", huge_table_spec),
}


def run(cmd: list[str]) -> tuple[int, float, float, float, str]:
    """(exit code, wall s, CPU s, peak RSS MiB, last line of output) of `cmd` as a child."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    lines = [ln for ln in out.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return (
        proc.returncode,
        wall,
        usage.ru_utime + usage.ru_stime,
        usage.ru_maxrss / 1024,
        last,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    ap.add_argument("--keep", type=Path, help="write specs and plans here (default: a tmp dir)")
    a = ap.parse_args()
    names = [n for n in a.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    print(f"`embarkc plan --time-limit {a.time_limit:g}`; wall and CPU in s, peak RSS in MiB")
    print()
    print(
        "| case | spec (MB) | plan exit | plan wall | over limit | plan CPU | plan RSS "
        "| check spec wall | check spec RSS | check plan wall | check plan RSS | plan says |"
    )
    print("| --- " * 12 + "|")
    with tempfile.TemporaryDirectory() as tmp:
        root = a.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for name in names:
            label, make = CASES[name]
            spec = root / f"{name}.embark"
            spec.write_text(make())  # type: ignore[operator]
            plan = root / f"{name}.plan.json"
            plan.unlink(missing_ok=True)
            rc, wall, cpu, rss, last = run(
                [*EMBARKC, "plan", str(spec), "-o", str(plan), "--time-limit", str(a.time_limit)]
            )
            crc, cwall, _, crss, _ = run([*EMBARKC, "check", str(spec)])
            if plan.exists():
                prc, pwall, _, prss, _ = run([*EMBARKC, "check", str(plan)])
                pcheck = f"{pwall:.1f} (exit {prc}) | {prss:.0f}"
            else:
                pcheck = "no plan | -"
            size = spec.stat().st_size / 1e6
            print(
                f"| {label} | {size:.1f} | {rc} | {wall:.1f} | {wall - a.time_limit:+.1f} "
                f"| {cpu:.1f} | {rss:.0f} | {cwall:.1f} (exit {crc}) | {crss:.0f} | {pcheck} "
                f"| {last[:80].replace('|', '/')} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
