"""What the search makes fit: a spec that some plan fits is planned, not refused."""

from __future__ import annotations

from embarkc.frontend import load_program_text
from embarkc.planner import plan_program
from embarkc.planner.check import validate_plan

# one GPU of 4 MiB; a table read 100,000 times per sample: sharded (rb or ub), its owner
# holds every id of the batch as keys (8 x 100,000 x 8 bytes = 6.1 MiB), more than the GPU;
# replicated (dp), it holds its 1.6 KiB and no communication buffers
HOT = """
hardware { nodes 1 gpus_per_node 1 hbm 4 MiB hbm_bandwidth 100 GB/s nvlink 50 GB/s
           network 10 Gb/s arch sm_80 }
model { batch 8 }
table a { rows 100 dim 4 hotness 100000 }
"""


def test_a_table_whose_buffers_fill_the_gpu_is_replicated_where_no_row_split_helps() -> None:
    program = load_program_text(HOT, "hot.embark")
    for solver in ("greedy", "cp-sat"):
        plan = plan_program(program, solver=solver, time_limit=2)
        assert [(c.kind, c.tables) for c in plan.clusters] == [("dp", ["a"])]
        assert not plan.shards
        assert validate_plan(program, plan) == []
