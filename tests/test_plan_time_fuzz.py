"""bench/plan_time_fuzz.py writes specs the language accepts, reproducibly."""

from __future__ import annotations

from embarkc.frontend import load_program_text
from tests.conftest import ROOT, load_module


def test_the_random_specs_load_and_fill_their_memory_as_said() -> None:
    bench = load_module(ROOT / "bench" / "plan_time_fuzz.py")
    for seed in range(24):
        text, meta = bench.random_spec(seed)
        assert text == bench.random_spec(seed)[0]
        program = load_program_text(text, f"random{seed}.embark")
        assert len(program.tables) == meta["tables"]
        capacity = program.topology.hbm_bytes * program.topology.world_size
        # weights and state against the cluster: about the fill asked for (the script's
        # own count of optimizer state is within 1 % of the IR's; HBM has a 64 MiB floor)
        assert program.embedding_bytes <= capacity * meta["fill"] * 1.01
        if program.topology.hbm_bytes > 64 << 20:
            assert program.embedding_bytes >= capacity * meta["fill"] * 0.99
