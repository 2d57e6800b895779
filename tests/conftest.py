"""Shared fixtures and the hypothesis profile."""

from __future__ import annotations

import os
from pathlib import Path

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
