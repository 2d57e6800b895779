"""Many errors cost about what a valid spec costs (issue 35, item 6): a spec of 10,000
tables without `hotness` (18 s at 2,500 tables, 338 s at 20,000 before the source was
split once per file) renders 40 diagnostics and counts the rest; the source is split into
lines once, and only the shown diagnostics are rendered."""

from __future__ import annotations

from pathlib import Path

import pytest

import embarkc.diagnostics as diagnostics
from embarkc.cli import main

N = 10_000


def _spec(tmp_path: Path) -> Path:
    lines = [
        "hardware { nodes 1 gpus_per_node 8 hbm 80 GiB hbm_bandwidth 3 TB/s nvlink 450 GB/s "
        "network 400 Gb/s }",
        *(f"table t{i} {{ rows 1000 dim 16 }}" for i in range(N)),
        "model { batch 1024 dense_features 13 bottom_mlp [32, 16] interaction dot top_mlp [32, 1] }",
    ]
    path = tmp_path / "many.embark"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_ten_thousand_errors_render_the_first_few_dozen_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _spec(tmp_path)
    rendered = 0
    render = diagnostics.Diagnostic.render

    def counting(self, sources=None):  # type: ignore[no-untyped-def]
        nonlocal rendered
        rendered += 1
        return render(self, sources)

    monkeypatch.setattr(diagnostics.Diagnostic, "render", counting)
    diagnostics._lines.cache_clear()
    assert main(["check", str(spec)]) == 2
    err = capsys.readouterr().err
    assert diagnostics._lines.cache_info().misses == 1  # the one source file, split once
    assert rendered == diagnostics.MAX_SHOWN
    assert err.count("has no `hotness`") == diagnostics.MAX_SHOWN
    assert err.rstrip().endswith(
        f"{N:,} errors; the first {diagnostics.MAX_SHOWN} diagnostics are shown and "
        f"{N - diagnostics.MAX_SHOWN:,} more are not: fix these and run again"
    )
    assert "Traceback" not in err
