"""`embarkc plan SPEC --target torchrec|hugectr`: plan within what another system runs.

The planner is not changed: the PROGRAM is restricted before planning, with the spec
language's own placement constraints (embarkc.ir.TableConstraint) and plan options, so a
plan made here is a plan of the spec (`embarkc check` accepts it against the spec) whose
every table `embarkc.interop.plan_export.export_plan` expresses.

TorchRec (its sharding types, docs/interop.md):
* flat communication (TorchRec's exchanges are its own; a spec asking for hierarchical is
  refused), row shards only with the spec's `row_partition range` (TorchRec's contiguous
  blocks; under `mod` every table keeps its rows whole);
* no ub cluster, and row shards either over every rank (row_wise) or over the GPUs of one
  node (table_row_wise, grid_shard). The constraint language bounds a kind or a count but
  cannot say "not ub" or "1, gpus_per_node or world", so this is done by rounds: plan,
  find the tables TorchRec cannot run, pin each to the nearest layout it can (`cluster
  rb`, `row_shards N` with `within_node`, `column_shards 1`), plan again. Pins only grow,
  so the rounds end; at most MAX_ROUNDS.

HugeCTR: no column shards (`column_shards 1` on every table), row shards only with
`row_partition mod` (its key-mod-n row sharding), flat communication unless the spec asks
for hierarchical (HugeCTR's strategy is one for the whole collection).

The unrestricted plan is made too, with the same options, so that the plan can say what
the restriction costs: `planner.target` = {system, unrestricted_step_time, slowdown,
rounds, pinned}.
"""

from __future__ import annotations

from typing import Any

from embarkc.diagnostics import EmbarkError
from embarkc.interop.plan_export import _Inexpressible, _tables, _torchrec_sharded, export_plan
from embarkc.ir import Program, TableConstraint

TARGETS = ("torchrec", "hugectr")
MAX_ROUNDS = 6
"""Planning rounds of `--target torchrec` before giving up (each pins at least one table
further; real specs settle in one or two)."""


def restrict(program: Program, target: str) -> Program:
    """`program` with the plan options and constraints every `target` plan needs."""
    spec = program.sources[0].path
    opts = program.options
    if target == "torchrec":
        if opts.communication == "hierarchical":
            raise EmbarkError.at(
                spec,
                "--target torchrec: the spec asks for hierarchical communication, which "
                "TorchRec does not run (its exchanges are all-to-all over the world)",
                hint="set `communication auto` or `flat` in the plan block",
            )
        for c in program.constraints:
            if c.cluster == "ub":
                raise _pinned(program, c, "ub", "TorchRec has no unique-based (ub) cluster")
        program = program.model_copy(
            update={"options": opts.model_copy(update={"communication": "flat"})}
        )
        if opts.row_partition == "mod":
            program = _bound_all(
                program,
                "row",
                1,
                "TorchRec cuts rows in range blocks",
                "set `row_partition range` in the spec's plan block",
            )
        return program
    if target == "hugectr":
        if opts.communication == "auto":
            program = program.model_copy(
                update={"options": opts.model_copy(update={"communication": "flat"})}
            )
        program = _bound_all(program, "column", 1, "HugeCTR does not cut columns")
        if opts.row_partition == "range":
            program = _bound_all(
                program,
                "row",
                1,
                "HugeCTR cuts rows by key mod n",
                "set `row_partition mod` in the spec's plan block",
            )
        return program
    raise EmbarkError.at(spec, f"unknown target `{target}`", hint="targets: torchrec, hugectr")


def _pinned(
    program: Program,
    c: TableConstraint,
    what: str,
    why: str,
    hint: str = "drop this constraint or plan without --target",
) -> EmbarkError:
    from embarkc.diagnostics import Diagnostic, Span

    span = c.span.to_span() if c.span else Span.of_file(program.sources[0].path)
    return EmbarkError(
        Diagnostic(
            f"--target: table `{c.table}` is constrained to {what}, but {why}",
            span,
            hint,
        )
    )


def _bound_all(
    program: Program, axis: str, most: int, why: str, hint: str | None = None
) -> Program:
    """Every table's `axis` ("row" or "column") shards bounded to at most `most`."""
    cons = dict(program.constraint_of)
    for t in program.tables:
        c = cons.get(t.name) or TableConstraint(table=t.name)
        low = getattr(c, f"min_{axis}_shards")
        if low > most:
            raise _pinned(
                program, c, f"at least {low} {axis} shards", why, *([hint] if hint else [])
            )
        high = getattr(c, f"max_{axis}_shards")
        cons[t.name] = c.model_copy(
            update={f"max_{axis}_shards": most if high is None else min(high, most)}
        )
    return _with_constraints(program, cons)


def _with_constraints(program: Program, cons: dict[str, TableConstraint]) -> Program:
    order = [t.name for t in program.tables if t.name in cons]
    new = program.model_copy(update={"constraints": tuple(cons[n] for n in order)})
    new.__dict__.pop("constraint_of", None)  # the cached property of the copy's source
    return new


def torchrec_pins(
    plan: Any, pinned: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """For each table of `plan` TorchRec cannot run, the constraint fields that move it to
    the nearest layout TorchRec runs: first its row shards over all ranks or one node's
    GPUs (column cuts dropped where rows and columns are both cut across nodes); a table
    already so `pinned` that still fails (the planner put two of its row shards on one
    GPU, which no constraint forbids) keeps its rows whole (`row_shards 1`)."""
    pinned = pinned or {}
    topo = plan.topology
    world, local = topo.nodes * topo.gpus_per_node, topo.gpus_per_node
    kinds = {t: c.kind for c in plan.clusters for t in c.tables}
    pins: dict[str, dict[str, Any]] = {}
    for name, t in _tables(plan).items():
        pin: dict[str, Any] = {}
        if kinds[name] == "ub":
            pin["cluster"] = "rb"
        if kinds[name] != "dp":
            try:
                _torchrec_sharded(t, world, local, plan.row_partition, [])
            except _Inexpressible:
                R, cuts = t.row_shards, len(t.cuts)
                if "min_row_shards" in pinned.get(name, {}):
                    pin.update(min_row_shards=1, max_row_shards=1, within_node=False)
                elif R > 1 and cuts > 1:
                    pin.update(min_column_shards=1, max_column_shards=1)
                elif world > local and R <= local:
                    pin.update(min_row_shards=local, max_row_shards=local, within_node=True)
                else:
                    pin.update(min_row_shards=world, max_row_shards=world, within_node=False)
        if pin:
            pins[name] = pin
    return pins


def _apply_pins(program: Program, pins: dict[str, dict[str, Any]]) -> Program:
    cons = dict(program.constraint_of)
    for name, pin in pins.items():
        c = cons.get(name) or TableConstraint(table=name)
        merged = c.model_copy(update=pin)
        lo, hi = merged.min_row_shards, merged.max_row_shards
        if (c.max_row_shards is not None and lo > c.max_row_shards) or lo < c.min_row_shards:
            raise _pinned(
                program,
                c,
                f"{c.min_row_shards}..{c.max_row_shards or ''} row shards",
                f"TorchRec needs {lo} here (all ranks, or the GPUs of one node)",
            )
        if hi is not None and hi < lo:
            raise _pinned(program, c, "these row shards", "TorchRec cannot run them")
        if merged.max_column_shards is not None and (
            merged.max_column_shards < c.min_column_shards
        ):
            raise _pinned(
                program,
                c,
                f"at least {c.min_column_shards} column shards",
                "TorchRec cannot cut both its rows and its columns across nodes",
            )
        cons[name] = merged
    return _with_constraints(program, cons)


def plan_for_target(program: Program, target: str, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """The plan of `program` restricted to `target`, and what the restriction did
    ({system, rounds, pinned}); `kwargs` go to `embarkc.planner.plan_program`."""
    from embarkc.planner import plan_program

    restricted = restrict(program, target)
    pinned: dict[str, dict[str, Any]] = {}
    rounds = 0
    while rounds < MAX_ROUNDS:
        rounds += 1
        try:
            plan = plan_program(restricted, **kwargs)
        except EmbarkError as e:
            raise _no_fit(program, target, e) from None
        pins = torchrec_pins(plan, pinned) if target == "torchrec" else {}
        if not pins:
            break
        restricted = _apply_pins(restricted, pins)
        for name, pin in pins.items():
            pinned.setdefault(name, {}).update(pin)
    if pins:
        raise EmbarkError.at(
            program.sources[0].path,
            f"--target {target}: no plan TorchRec runs after {MAX_ROUNDS} rounds of pinning",
            hint="constrain the tables named by `embarkc export` in the spec's plan block",
        )
    # the plan exports (a refusal here is a bug of the restriction, reported as one)
    from embark_runtime.plan import plan_to_dict

    export_plan(plan_to_dict(plan), target)
    return plan, {
        "system": target,
        "rounds": rounds,
        "pinned": {k: _describe(v) for k, v in sorted(pinned.items())},
    }


ROW_PARTITION = {"torchrec": "range", "hugectr": "mod"}
"""The row partition each system's row shards are (TorchRec's blocks, HugeCTR's key mod n)."""


def _no_fit(program: Program, target: str, e: EmbarkError) -> EmbarkError:
    """The planner's refusal of the restricted program, said as the target's."""
    want = ROW_PARTITION[target]
    hint = (
        f"{target} row-shards tables only under `row_partition {want}`: set it in the "
        "spec's plan block, or give more GPUs"
        if program.options.row_partition != want
        else "give more GPUs or plan without --target"
    )
    return EmbarkError.at(
        program.sources[0].path,
        f"--target {target}: no plan within what {target} runs fits:\n" + e.render(),
        hint=hint,
    )


def _describe(pin: dict[str, Any]) -> str:
    parts = []
    if pin.get("cluster"):
        parts.append(f"cluster {pin['cluster']}")
    if "min_row_shards" in pin:
        parts.append(f"row_shards {pin['min_row_shards']}")
    if pin.get("max_column_shards") == 1:
        parts.append("no_column_split")
    if pin.get("within_node"):
        parts.append("within_node")
    return " ".join(parts)


def with_target(plan: Any, info: dict[str, Any], unrestricted: Any) -> Any:
    """`plan` with `planner.target`: `info` and the step time of `unrestricted` (the plan
    without the target's restriction) and the slowdown, `plan / unrestricted`."""
    from embark_runtime.plan import Plan, plan_to_dict
    from embarkc.planner import round9

    data = plan_to_dict(plan)
    base = unrestricted.estimate.step_time
    data["planner"]["target"] = {
        **info,
        "unrestricted_step_time": round9(base),
        "slowdown": round9(plan.estimate.step_time / base) if base else 1.0,
    }
    return Plan.model_validate(data)
