"""Shared fixtures and the hypothesis profile."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"

# CI explores the same examples on every run (a red CI run is then reproducible by
# anyone with CI=1); local runs keep drawing fresh ones.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def root() -> Path:
    return ROOT


def load_module(path: Path, name: str | None = None) -> ModuleType:
    """The Python file `path` (a bench script: bench/ is no package) as module `name`
    (its stem by default), registered in sys.modules: dataclasses look their module up
    there."""
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def small_hardware(gpus_per_node: int, hbm: str) -> str:
    """The hardware line of one node of small made-up GPUs, for specs tests write inline."""
    return (
        f"hardware {{ nodes 1 gpus_per_node {gpus_per_node} hbm {hbm} hbm_bandwidth 100 GB/s"
        " nvlink 50 GB/s network 10 Gb/s arch sm_80 }\n"
    )


def keys_in_full(program):  # type: ignore[no-untyped-def]
    """`program` on hardware without a dense rate (`dense_flops 0`): no key time hides
    under the dense compute, the cost model the planner had before the window. Tests of
    mechanisms whose figures were measured so use it."""
    topo = program.topology.model_copy(update={"dense_flops": 0.0})
    return program.model_copy(update={"topology": topo})
