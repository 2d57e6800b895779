"""`embarkc schema plan`: the JSON schema of the plan file (plan.json, format
embark-plan version 1), from the pydantic models the loader validates with
(`embark_runtime.plan.Plan`), so that other tools can validate plans they read or write.

The schema describes the contract's fields and embarkc's own (docs/plan.md); it allows
other fields of a tool's own, as the contract does. Rules across fields (every table in one
cluster, columns that tile a row shard, memory that fits) are not expressible in a JSON
schema: `embarkc check PLAN` checks them.
"""

from __future__ import annotations

import argparse
import json
import sys

from embarkc.diagnostics import EXIT_OK

HELP = "print the JSON schema of a file format (plan: plan.json)"

SCHEMA_ID = "https://embarkc.dev/schema/embark-plan-1.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=("plan",), help="the format: plan (plan.json)")


def plan_schema() -> dict:
    """The plan file's JSON schema (draft 2020-12)."""
    from embark_runtime.plan import Plan, _OwnFields

    schema = Plan.model_json_schema()
    # embarkc's own top-level fields (docs/plan.md, "Fields of our own"), checked on load
    own = _OwnFields.model_json_schema()
    schema.setdefault("$defs", {}).update(own.get("$defs", {}))
    for name, prop in own["properties"].items():
        schema["properties"].setdefault(name, prop)
    # the loader fills `format` and `version` in when absent, the contract asks for them
    schema["required"] = sorted(set(schema.get("required", [])) | {"format", "version"})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "embark-plan version 1 (plan.json)",
        **{k: v for k, v in schema.items() if k != "title"},
    }


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(json.dumps(plan_schema(), indent=2, sort_keys=True) + "\n")
    return EXIT_OK
