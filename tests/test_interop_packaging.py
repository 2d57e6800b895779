"""`pip install embarkc` plans, checks, diffs and reports without torch: those commands run
with torch (and safetensors, tensorboard, pyarrow) unimportable, and pyproject puts them in
the `train` extra that scripts/setup.sh installs."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib

from tests.conftest import ROOT

RUNNER = textwrap.dedent(
    """
    import importlib.abc, json, sys

    TRAIN = ("torch", "safetensors", "tensorboard", "pyarrow", "torchrec")

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in TRAIN:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Refuse())
    for name in list(sys.modules):
        if name.split(".")[0] in TRAIN:
            del sys.modules[name]
    from embarkc.cli import main

    spec = sys.argv[1]
    runs = [
        ["check", spec],
        ["plan", spec, "--solver", "greedy", "-o", "a.json", "-q"],
        ["plan", spec, "--strategy", "row-wise", "-o", "b.json", "-q"],
        ["check", "a.json", "--format", "json"],
        ["diff", "a.json", "b.json"],
        ["report", "a.json", "-o", "r.html"],
        ["schema", "plan"],
    ]
    codes = [main(argv) for argv in runs]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in TRAIN)
    print(json.dumps({"codes": codes, "loaded": loaded}), file=sys.stderr)
    """
)


def test_check_plan_diff_report_run_without_torch(tmp_path):
    (tmp_path / "run.py").write_text(RUNNER)
    r = subprocess.run(
        [sys.executable, "run.py", str(ROOT / "specs" / "tiny.embark")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    last = r.stderr.strip().splitlines()[-1]
    assert '"codes": [0, 0, 0, 0, 0, 0, 0]' in last, r.stderr[-3000:]
    assert '"loaded": []' in last
    assert (tmp_path / "r.html").stat().st_size > 0
    assert "No module named" not in r.stderr


def test_pyproject_puts_the_trainer_needs_in_the_train_extra():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    deps = " ".join(meta["project"]["dependencies"])
    for name in ("torch", "safetensors", "tensorboard", "pyarrow"):
        assert name not in deps
        assert any(d.startswith(name) for d in meta["project"]["optional-dependencies"]["train"])
    assert "embarkc.interop" in meta["tool"]["setuptools"]["packages"]
    assert '".[test,train]"' in (ROOT / "scripts" / "setup.sh").read_text()
