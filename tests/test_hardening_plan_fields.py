"""A plan read against its spec holds every field the spec determines (issue 35, item 1).

Deleting one key of a plan embarkc wrote must either be refused, naming the key, or
delete a field that docs/plan.md ("Fields a plan may leave out") lists as optional: a
deleted `optimizer_params.lr` trained with the model's default lr before.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from embark_runtime.plan import PlanError, check_complete, parse_plan
from embarkc.diagnostics import EmbarkError
from embarkc.frontend import load_program, load_program_text
from embarkc.planner import check_against_spec

ROOT = Path(__file__).resolve().parent.parent
TINY_PLAN = ROOT / "tests/snapshots/compile/tiny/plan.json"

# The optional fields of docs/plan.md as patterns over dotted paths (list indices as
# numbers): the estimate's and the planner's fields of our own (the cost model's and the
# search's figures, not the spec's), communication where the contract does not require it.
OPTIONAL = [
    r"//",  # the generated-file notice compile writes
    r"estimate\.(critical_path|critical_rank|components|dense_allreduce_time|key_window"
    r"|layout_sha256|figures_sha256|per_table)(\..*)?",
    r"estimate\.per_rank\.\d+\.(components|memory)(\..*)?",
    r"planner\.(objective|bound|lower_bound|greedy_step_time|baselines|message"
    r"|ignored_constraints|fixed_strategy|kicked_from|fixed_start|neighbourhoods|stopped)"
    r"(\..*)?",
    r"clusters\.\d+\.gradient_exchange",
]


def _paths(value, prefix=()):
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*prefix, i))


def _without(data, path):
    out = copy.deepcopy(data)
    node = out
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return out


def _refusal(program, data) -> str | None:
    """The message that refuses `data` read against `program`, or None when accepted."""
    try:
        plan = parse_plan(json.dumps(data), "plan.json")
        with contextlib.redirect_stderr(io.StringIO()):
            check_against_spec(program, plan, "plan.json")
    except PlanError as e:
        return str(e)
    except EmbarkError as e:
        return "\n".join(d.message for d in e.diagnostics)
    return None


def test_every_deleted_key_is_refused_by_name_or_optional() -> None:
    program = load_program(str(ROOT / "specs/tiny.embark"))
    data = json.loads(TINY_PLAN.read_text())
    assert _refusal(program, data) is None
    accepted, unnamed = [], []
    paths = list(_paths(data))
    assert len(paths) > 150
    for path in paths:
        dotted = ".".join(map(str, path))
        message = _refusal(program, _without(data, path))
        if message is None:
            if not any(re.fullmatch(p, dotted) for p in OPTIONAL):
                accepted.append(dotted)
        elif dotted not in message and f"`{path[-1]}`" not in message:
            unnamed.append((dotted, message))
    assert accepted == [], f"deleted and still accepted: {accepted}"
    assert unnamed == [], f"refused without naming the key: {unnamed[:5]}"


def _check_and_compile(folder: Path, spec: str) -> list[str]:
    """The stderr of `embarkc check plan.json` and `compile SPEC --plan plan.json` in
    `folder`, each of which must refuse the plan (exit 2, no traceback, nothing written)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    errors = []
    for argv in (["check", "plan.json"], ["compile", spec, "--plan", "plan.json", "-o", "out"]):
        run = subprocess.run(
            [sys.executable, "-m", "embarkc.cli", *argv],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 2, run.stderr
        assert "Traceback" not in run.stderr
        errors.append(run.stderr)
    assert not (folder / "out").exists()
    return errors


def _columned() -> tuple[str, dict]:
    """tiny's spec with `column "bb"` in its last feature, and tiny's plan carrying it, as
    `embarkc plan` writes it (features[].column only where the spec sets it)."""
    text = (ROOT / "specs/tiny.embark").read_text()
    text = text.replace("feature brand_bought {", 'feature brand_bought {\n  column "bb"', 1)
    data = json.loads(TINY_PLAN.read_text())
    assert data["features"][6]["name"] == "brand_bought"
    data["features"][6]["column"] = "bb"
    return text, data


def test_a_spec_column_missing_from_or_differing_in_its_plan_is_refused_by_name() -> None:
    text, data = _columned()
    program = load_program_text(text, str(ROOT / "specs/columned.embark"))
    assert _refusal(program, data) is None
    message = _refusal(program, _without(data, ("features", 6, "column")))
    assert message is not None
    assert "`features.6.column`" in message and "missing" in message
    other = copy.deepcopy(data)
    other["features"][6]["column"] = "brand_bought"
    message = _refusal(program, other)
    assert message is not None
    assert "`features.6.column`" in message and '"brand_bought"' in message
    assert 'the spec says "bb"' in message


def test_a_spec_without_columns_keeps_plans_without_them_and_refuses_one_given() -> None:
    program = load_program(str(ROOT / "specs/tiny.embark"))
    data = json.loads(TINY_PLAN.read_text())
    assert all("column" not in f for f in data["features"])
    assert _refusal(program, data) is None
    data["features"][2]["column"] = "cat"
    message = _refusal(program, data)
    assert message is not None
    assert "`features.2.column`" in message and "the spec says none" in message


def test_check_and_compile_refuse_a_plan_lacking_the_spec_column(tmp_path: Path) -> None:
    text, data = _columned()
    spec = tmp_path / "columned.embark"
    spec.write_text(text)
    data["source"] = {"spec": spec.name, "sha256": hashlib.sha256(spec.read_bytes()).hexdigest()}
    del data["features"][6]["column"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    for err in _check_and_compile(tmp_path, spec.name):
        assert "invalid plan (complete)" in err and "`features.6.column`" in err


def test_the_message_names_the_field_and_what_to_do() -> None:
    program = load_program(str(ROOT / "specs/tiny.embark"))
    data = json.loads(TINY_PLAN.read_text())
    message = _refusal(program, _without(data, ("tables", 1, "optimizer_params", "lr")))
    assert message is not None
    assert "`tables.1.optimizer_params.lr`" in message
    assert "re-plan the spec" in message


def test_training_fields_are_checked_without_the_spec() -> None:
    data = json.loads(TINY_PLAN.read_text())
    check_complete(parse_plan(json.dumps(data)), "plan.json", training=True)
    for path in (("features", 3, "weighted"), ("tables", 0, "init", "high")):
        plan = parse_plan(json.dumps(_without(data, path)))
        try:
            check_complete(plan, "plan.json", training=True)
        except PlanError as e:
            assert ".".join(map(str, path)) in str(e)
        else:
            raise AssertionError(f"{path} deleted and accepted")
    # the dense model and the seed are the spec's business, not the trainer's
    check_complete(parse_plan(json.dumps(_without(data, ("seed",)))), "p", training=True)


def test_check_and_compile_refuse_a_plan_with_a_deleted_key(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.embark"
    spec.write_text((ROOT / "specs/tiny.embark").read_text())
    data = json.loads(TINY_PLAN.read_text())
    data["source"]["spec"] = "tiny.embark"
    del data["topology"]["arch"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    for err in _check_and_compile(tmp_path, "tiny.embark"):
        assert "`topology.arch`" in err
