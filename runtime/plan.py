"""The plan file, `embark-plan/1`: models, deterministic writer and a validating loader.

This module is the single reader and writer of plan files. The compiler builds `Plan`
objects and writes them with `dumps_plan`; generated trainers, `embarkc diff` and outside
tools read them with `load_plan`, which rejects a plan that breaks a rule of the contract
(shared/contracts/plan-v1.md), naming the rule, or holds a number beyond what is
physically meaningful (the MAX_ and MIN_ bounds below), naming the field. The models'
defaults serve plans of other tools; a plan read as the plan of a spec, or trained, must
give every field its spec determines (`missing_fields`, `check_complete`: rule
`complete`). It imports neither torch nor the compiler.

Fields beyond the contract (all documented in docs/plan.md):
  tables[].optimizer_params (.schedule when set), tables[].init, tables[].bytes
  features[].max_hotness, features[].fixed, features[].weighted
  shards[].tier, shards[].cache_rows (host-tier cells, written only when set),
  topology.{host_memory_bytes, host_bandwidth} (read when present)
  topology.{arch, dense_flops, constants}, model (.optimizer.schedule, .precision when
  set), seed, estimate.{critical_rank, critical_path,
  components, per_rank[].components, per_rank[].memory, per_table, key_window},
  planner.{objective, bound, greedy_step_time, baselines, message}
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from embark_runtime.dtypes import DTYPE_BYTES
from embark_runtime.optimizers import optimizer
from embark_runtime.schedules import Schedule

FORMAT = "embark-plan"
VERSION = 1


# The largest sizes a spec or a plan may hold (the language checks the same bounds,
# embarkc.lower): far beyond any real model, small enough that every count the cost
# model, the simulator and the runtime derive (rows x dim, batch x hotness, ranks x cells)
# stays exact in int64 and float64.
MAX_ROWS = 1 << 48
MAX_DIM = 1 << 16
MAX_HOTNESS = 1 << 20
MAX_BATCH = 1 << 31
MAX_NODES = 1 << 16
MAX_GPUS_PER_NODE = 1 << 10

# Bounds on the other numbers a plan holds: what is physically meaningful, and small
# enough that the commands reading a plan (check, diff, report, simulate) compute only
# finite, exact figures from it. A plan beyond one is rejected naming the field.
MAX_BYTES = (1 << 63) - 1
"""Sizes in bytes (hbm_bytes, memory estimates) and histogram counts: signed 64-bit
integers, as in a spec (embarkc.units.MAX_INT)."""
MAX_SECONDS = 1e6
"""Every time a plan records (step and rank times, their components, bounds, baselines,
the planner's wall time): a step of 11.6 days is no plan anyone trains with."""
MIN_BANDWIDTH = 1.0
MAX_BANDWIDTH = 1e18
"""Bytes per second per GPU per direction: at least 1 B/s (the language's least), at most
an exabyte per second (10^5 x NVLink 4)."""
MIN_DENSE_FLOPS = 1.0
MAX_DENSE_FLOPS = 1e21
"""`dense_flops`: 0 (unknown), else 1 FLOP/s to a zettaFLOP/s per GPU (10^4 x an H100)."""
MAX_LAYER_WIDTH = MAX_DIM
"""Widths of the dense model (dense features, MLP layers, DCN-V2's low rank): vector
widths, bounded as an embedding's dim is."""
MAX_LAYERS = 1 << 10
"""Layers of an MLP, cross layers of DCN-V2."""
MAX_SEED = 2**31 - 1
"""Seeds, of a spec too (embarkc.ir imports it): the CP-SAT solver's seeds are 32-bit
signed integers."""


class PlanError(Exception):
    """A plan file that cannot be used. `rule` names the broken contract rule."""

    def __init__(self, path: str, rule: str, message: str):
        self.path = path
        self.rule = rule
        self.message = message
        super().__init__(f"{path}: error: invalid plan ({rule}): {message}")


class _M(BaseModel):
    # every number of a plan is finite: NaN or infinity is a broken plan, named by its field
    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)


MAX_CONSTANT = 4096.0
"""The largest value of a cost-model constant (`topology.constants`): efficiencies are at
most 1, latencies at most a second, the smallest read at most 4 KiB."""

Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Bandwidth = Annotated[float, Field(ge=MIN_BANDWIDTH, le=MAX_BANDWIDTH)]
LayerWidth = Annotated[int, Field(gt=0, le=MAX_LAYER_WIDTH)]


class PlanTopology(_M):
    nodes: int = Field(gt=0, le=MAX_NODES)
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS_PER_NODE)
    hbm_bytes: int = Field(gt=0, le=MAX_BYTES)
    hbm_bandwidth: Bandwidth
    intra_node_bandwidth: Bandwidth
    inter_node_bandwidth: Bandwidth
    dense_flops: float = Field(default=0.0, ge=0, le=MAX_DENSE_FLOPS)
    """Peak fp32 FLOP/s per GPU; 0 (also when absent: plans written before it) credits no
    overlap of the key traffic with the dense compute."""
    arch: str = "sm_90"
    host_memory_bytes: int | None = Field(default=None, gt=0, le=MAX_BYTES)
    """Host memory per node for host-tier cells (the spec's `host_memory`); absent: not
    given. Read when present; the planner does not write it yet (docs/host_tier.md)."""
    host_bandwidth: Bandwidth | None = None
    """Host <-> GPU copy rate per GPU per direction (the spec's `host_bandwidth`); absent:
    not given. Read when present; the planner does not write it yet."""
    constants: dict[str, Annotated[float, Field(gt=0, le=MAX_CONSTANT)]] | None = None
    """The cost model's constants the spec's hardware block set (efficiencies, latencies
    in seconds, the smallest read in bytes; the compiler's embarkc.planner.constants names
    them); absent (None, not written): the defaults. The simulator costs a plan with them."""

    @field_validator("dense_flops")
    @classmethod
    def _known_or_zero(cls, v: float) -> float:
        if 0 < v < MIN_DENSE_FLOPS:
            raise ValueError(f"dense_flops is 0 (unknown) or at least {MIN_DENSE_FLOPS:g} FLOP/s")
        return v

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


class OptimizerParams(_M):
    # the bounds of the language (embarkc.ir.Optimizer): a plan trains what a spec could say
    lr: float = Field(default=0.01, gt=0)
    eps: float = Field(default=1e-8, gt=0)
    initial_accumulator: float = Field(default=0.0, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    schedule: Schedule | None = None
    """The rate's schedule over the steps (embark_runtime.schedules); absent: constant."""


class InitParams(_M):
    kind: Literal["uniform", "normal", "constant"] = "uniform"
    low: float = -0.05
    high: float = 0.05
    mean: float = 0.0
    std: float = 0.01
    value: float = 0.0

    @model_validator(mode="after")
    def _sensible(self) -> InitParams:
        if self.kind == "uniform" and not self.low < self.high:
            raise ValueError("uniform(low, high) needs low < high")
        if self.kind == "normal" and not self.std > 0:
            raise ValueError("normal(mean, std) needs std > 0")
        return self


class PlanTable(_M):
    name: str
    rows: int = Field(gt=0, le=MAX_ROWS)
    dim: int = Field(gt=0, le=MAX_DIM)
    dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    optimizer: Literal["sgd", "adagrad", "rowwise_adagrad", "adam"] = "sgd"
    optimizer_params: OptimizerParams = OptimizerParams()
    init: InitParams = InitParams()

    def state_elements_per_row(self) -> int:
        return optimizer(self.optimizer).elements_per_row(self.dim)

    def bytes_for(self, rows: int, columns: int) -> int:
        """Weights plus optimizer state of `rows` x `columns` of this table.

        Row-wise state (rowwise_adagrad's accumulator, adam's step count) is replicated
        on every column cell of a row, so it is counted per cell.
        """
        weight = rows * columns * DTYPE_BYTES[self.dtype]
        return weight + optimizer(self.optimizer).state_bytes(rows, columns)


class Access(_M):
    kind: Literal["uniform", "zipf", "histogram"]
    alpha: float | None = None
    permuted: bool | None = None
    keys: list[int] | None = None
    counts: list[Annotated[int, Field(le=MAX_BYTES)]] | None = None


class PlanFeature(_M):
    name: str
    table: str
    hotness: float = Field(gt=0, le=MAX_HOTNESS)
    pooling: Literal["sum", "mean", "concat"] = "sum"
    access: Access
    max_hotness: int | None = Field(default=None, le=MAX_HOTNESS)
    fixed: bool = True
    weighted: bool = False
    column: str | None = None
    """the input data's column of this feature (the spec's `column`); absent: its name"""

    @property
    def bag_max(self) -> int:
        return self.max_hotness if self.max_hotness is not None else int(math.ceil(self.hotness))


def feature_problem(f: PlanFeature, rows: int) -> str | None:
    """What makes feature `f` (reading a table of `rows` rows) impossible to draw batches
    for, or None. The loader rejects such a plan; `SyntheticData` checks in-memory ones."""
    a = f.access
    if a.kind == "histogram":
        keys, counts = a.keys or [], a.counts or []
        if not keys or len(keys) != len(counts) or sum(counts) <= 0:
            return (
                f"feature `{f.name}`: a histogram access needs keys and positive counts "
                f"of the same length (got {len(keys)} keys, {len(counts)} counts)"
            )
        if min(keys) < 0 or max(keys) >= rows or min(counts) < 0:
            return (
                f"feature `{f.name}`: histogram keys must lie in [0, {rows}) and counts "
                "must be >= 0"
            )
        if sum(counts) > MAX_BYTES:
            return (
                f"feature `{f.name}`: histogram counts sum to more than {MAX_BYTES:.3e} "
                "(they are 64-bit counts)"
            )
    if a.kind == "zipf" and a.alpha is None:
        return f"feature `{f.name}`: zipf access needs alpha > 0, and `alpha` is missing"
    if a.kind == "zipf" and a.alpha is not None and a.alpha <= 0:
        return f"feature `{f.name}`: zipf access needs alpha > 0"
    if f.max_hotness is not None:
        if f.max_hotness < 1 or f.max_hotness < f.hotness:
            return (
                f"feature `{f.name}`: max_hotness {f.max_hotness} is below its hotness "
                f"{f.hotness:g} (a bag holds 1 to max_hotness ids, hotness on average)"
            )
        if f.fixed and f.max_hotness != f.hotness and "fixed" not in f.model_fields_set:
            return (
                f"feature `{f.name}`: `fixed` is missing, and a bag of hotness {f.hotness:g} "
                f'and max_hotness {f.max_hotness} is not fixed (`"fixed": false`)'
            )
        if f.fixed and f.max_hotness != f.hotness:
            return (
                f"feature `{f.name}`: a fixed bag has exactly hotness ids, but hotness is "
                f'{f.hotness:g} and max_hotness {f.max_hotness} (`"fixed": false` makes '
                "bags of 1 to max_hotness ids, hotness on average)"
            )
    return None


class Cluster(_M):
    name: str
    kind: Literal["dp", "rb", "ub"]
    tables: list[str]
    communication: Literal["flat", "hierarchical"] | None = None
    gradient_exchange: Literal["dense", "sparse"] | None = None
    """dp only (our field): all-reduce of the dense gradient or all-gather of touched rows."""


class Shard(_M):
    table: str
    row_shard: int = Field(ge=0)
    row_shards: int = Field(gt=0, le=MAX_ROWS)
    columns: tuple[int, int]
    rank: int
    tier: Literal["hbm", "host"] | None = None
    """Our field, written only when not HBM: "host" keeps the cell's rows (with their
    optimizer state) in the host memory of the rank's node (docs/host_tier.md)."""
    cache_rows: int | None = Field(default=None, ge=0, le=MAX_ROWS)
    """Our field, host tier only: rows of the cell cached in HBM (absent or 0: uncached)."""

    @property
    def on_host(self) -> bool:
        return self.tier == "host"

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]


class RankEstimate(_M):
    rank: int
    memory_bytes: Bytes
    time: Seconds


class Estimate(_M):
    step_time: Seconds
    per_rank: list[RankEstimate]


class PlannerInfo(_M):
    strategy: str
    solver: str
    status: str
    seed: int = Field(default=0, ge=-(1 << 63), lt=1 << 63)
    """Any 64-bit integer: another tool's seed need not be one of a spec."""
    wall_time: Seconds = 0.0


class Source(_M):
    spec: str
    sha256: str


# ------------------------------------------------------------------ fields of our own
# The contract lets a plan carry fields of its own; embarkc's (docs/plan.md, "Fields of our
# own") are read by diff, report, simulate and check, so their shape is checked on load:
# a hand-edited `"bound": "x"` is a broken plan named by its field, not a crash later.


class _OwnRank(_M):
    components: dict[str, Seconds] | None = None
    memory: dict[str, Bytes] | None = None


class _OwnTableRow(_M):
    table: str
    cluster: str | None = None
    time: Seconds | None = None
    memory_bytes: Bytes | None = None
    ranks: int | None = Field(default=None, ge=0, le=MAX_NODES * MAX_GPUS_PER_NODE)


class _OwnEstimate(_M):
    per_rank: list[_OwnRank] = []
    critical_rank: int | None = Field(default=None, ge=0)
    critical_path: Seconds | None = None
    components: dict[str, Seconds] | None = None
    per_table: list[_OwnTableRow] | None = None
    key_window: Seconds | None = None
    dense_allreduce_time: Seconds | None = None
    layout_sha256: str | None = None
    figures_sha256: str | None = None


class _OwnConstraint(_M):
    rule: str
    table: str | None = None
    message: str


class _OwnPlanner(_M):
    objective: Seconds | None = None
    bound: Seconds | None = None
    lower_bound: Seconds | None = None
    greedy_step_time: Seconds | None = None
    baselines: dict[str, Seconds] | None = None
    message: str | None = None
    ignored_constraints: list[_OwnConstraint] | None = None


class _OwnInteraction(_M):
    kind: Literal["dot", "dcnv2"] = "dot"
    layers: int = Field(default=3, gt=0, le=MAX_LAYERS)
    low_rank: LayerWidth = 512


class _OwnDenseOptimizer(_M):
    # the bounds of the language (embarkc.ir.DenseOptimizer)
    kind: Literal["sgd", "adagrad", "adam"] = "sgd"
    lr: float = Field(default=0.01, gt=0)
    eps: float = Field(default=1e-8, gt=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    schedule: Schedule | None = None
    """The dense rate's schedule (embark_runtime.schedules); absent: constant."""


PRECISIONS = ("fp32", "bf16", "fp16")
"""How the dense model computes: fp32, or autocast to bf16 or fp16 (fp32 master weights)."""


class _OwnModel(_M):
    """`model`: the dense part as embarkc.ir.DenseModel dumps it (simulate reads it)."""

    batch_size: int | None = Field(default=None, gt=0, le=MAX_BATCH)
    dense_features: int = Field(default=0, ge=0, le=MAX_LAYER_WIDTH)
    bottom_mlp: list[LayerWidth] = Field(default=[], max_length=MAX_LAYERS)
    interaction: _OwnInteraction | Literal["dot", "dcnv2"] = _OwnInteraction()
    top_mlp: list[LayerWidth] = Field(default=[1], max_length=MAX_LAYERS)
    optimizer: _OwnDenseOptimizer = _OwnDenseOptimizer()
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Absent in plans of fp32 specs."""

    @field_validator("top_mlp")
    @classmethod
    def _ends_in_the_logit(cls, v: list[int]) -> list[int]:
        if v and v[-1] != 1:
            raise ValueError(f"the top MLP ends in the model's one logit: 1, not {v[-1]}")
        return v


class _OwnFields(_M):
    estimate: _OwnEstimate
    planner: _OwnPlanner
    model: _OwnModel | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)


class Plan(_M):
    format: Literal["embark-plan"] = FORMAT
    version: Literal[1] = VERSION
    source: Source
    topology: PlanTopology
    batch_size: int = Field(gt=0, le=MAX_BATCH)
    tables: list[PlanTable]
    features: list[PlanFeature]
    row_partition: Literal["mod", "range"] = "mod"
    """A plan file must give it (`parse_plan`): where a table's rows live follows from it."""
    clusters: list[Cluster]
    shards: list[Shard]
    estimate: Estimate
    planner: PlannerInfo

    # ------------------------------------------------------------------ helpers
    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def _index(self, field: str) -> dict[str, Any]:
        """A lookup by table name over `field` (tables, clusters or shards), built once per
        list: kept beside the fields, keyed by the list it was built from, so a copy with
        another list (`model_copy(update=...)`) builds its own. Lookups by scanning cost
        O(tables x cells) on a plan of 5,000 tables."""
        items = getattr(self, field)
        cache = self.__dict__.setdefault("_lookup", {})
        hit = cache.get(field)
        if hit is None or hit[0] is not items:
            index: dict[str, Any] = {}
            if field == "tables":
                for t in items:
                    index.setdefault(t.name, t)
            elif field == "clusters":
                for c in items:
                    for name in c.tables:
                        index.setdefault(name, c)
            else:
                for sh in items:
                    index.setdefault(sh.table, []).append(sh)
            hit = cache[field] = (items, index)
        return hit[1]

    def table(self, name: str) -> PlanTable:
        got = self._index("tables").get(name)
        if got is None:
            raise KeyError(name)
        return got

    def cluster_of(self, table: str) -> Cluster:
        got = self._index("clusters").get(table)
        if got is None:
            raise KeyError(table)
        return got

    def shards_of(self, table: str) -> list[Shard]:
        return list(self._index("shards").get(table, ()))

    def row_count(self, table: str, row_shard: int, row_shards: int) -> int:
        """Rows of `table` held by row shard `row_shard` of `row_shards`."""
        rows = self.table(table).rows
        if self.row_partition == "mod":
            return len(range(row_shard, rows, row_shards))
        block = -(-rows // row_shards)
        return max(0, min(rows, (row_shard + 1) * block) - row_shard * block)

    def cell_hbm_rows(self, s: Shard) -> int:
        """Rows of shard `s` held in HBM: all of them, or a host-tier cell's cache (at most
        the cell's rows: a larger cache is refused by its own rule, `tier_problem`)."""
        rows = self.row_count(s.table, s.row_shard, s.row_shards)
        return min(rows, s.cache_rows or 0) if s.on_host else rows

    def host_memory_by_rank(self) -> list[int]:
        """Weights plus optimizer state of every rank's host-tier cells (host memory)."""
        mem = [0] * self.world_size
        for s in self.shards:
            if s.on_host:
                rows = self.row_count(s.table, s.row_shard, s.row_shards)
                mem[s.rank] += self.table(s.table).bytes_for(rows, s.width)
        return mem

    def memory_by_rank(self) -> list[int]:
        """Weights plus optimizer state placed in every rank's HBM (dp tables replicated;
        a host-tier cell counts its cache)."""
        mem = [0] * self.world_size
        for c in self.clusters:
            if c.kind == "dp":
                for name in c.tables:
                    t = self.table(name)
                    b = t.bytes_for(t.rows, t.dim)
                    mem = [m + b for m in mem]
        for s in self.shards:
            t = self.table(s.table)
            mem[s.rank] += t.bytes_for(self.cell_hbm_rows(s), s.width)
        return mem


def dense_schedule(plan: Plan) -> Schedule | None:
    """The dense optimizer's schedule the plan's `model` gives (None: a constant rate)."""
    model = (plan.model_extra or {}).get("model") or {}
    optimizer = model.get("optimizer") if isinstance(model, dict) else None
    data = optimizer.get("schedule") if isinstance(optimizer, dict) else None
    return None if data is None else Schedule.model_validate(data)


def dense_precision(plan: Plan) -> str:
    """The dense model's precision the plan's `model` gives (fp32 when absent)."""
    model = (plan.model_extra or {}).get("model") or {}
    return str(model.get("precision", "fp32")) if isinstance(model, dict) else "fp32"


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return plan.model_dump(mode="json", exclude_none=True)


def dumps_plan(plan: Plan | dict[str, Any]) -> str:
    """Deterministic text of a plan: sorted keys, 2-space indent, newline at the end."""
    data = plan_to_dict(plan) if isinstance(plan, Plan) else plan
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


GENERATED_NOTE = "//"
"""The key of the "generated by embarkc, do not edit" sentence that `embarkc compile`
writes into plan.json (embarkc.emit): no part of the plan."""


def plan_digest(plan: Plan) -> str:
    """sha256 of the plan's canonical text (`dumps_plan`) without the generated-file note.

    The one identity of a plan: a generated train.py carries the digest of the plan it was
    compiled from (and refuses a plan.json with another), a checkpoint the digest of the
    plan it was written under. Canonical, so re-indenting or reordering the keys of a plan
    file changes nothing; any change of a value, the estimate's included, does.
    """
    data = plan_to_dict(plan)
    data.pop(GENERATED_NOTE, None)
    return sha256_text(dumps_plan(data))


def validate_rules(plan: Plan, path: str = "<plan>") -> None:
    """Check rules 1-4 of plan-v1; raise PlanError naming the first broken rule."""
    names = [t.name for t in plan.tables]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})[0]
        raise PlanError(path, "rule 1", f"table `{dup}` is declared twice")
    known = set(names)
    seen: dict[str, str] = {}
    for c in plan.clusters:
        for name in c.tables:
            if name not in known:
                raise PlanError(path, "rule 1", f"cluster `{c.name}` names unknown table `{name}`")
            if name in seen:
                raise PlanError(
                    path, "rule 1", f"table `{name}` is in clusters `{seen[name]}` and `{c.name}`"
                )
            seen[name] = c.name
        if c.kind == "rb" and c.communication is None:
            raise PlanError(path, "rule 1", f"rb cluster `{c.name}` has no `communication`")
    missing = [n for n in names if n not in seen]
    if missing:
        raise PlanError(path, "rule 1", f"table `{missing[0]}` is in no cluster")
    for f in plan.features:
        if f.table not in known:
            raise PlanError(path, "rule 1", f"feature `{f.name}` reads unknown table `{f.table}`")

    world = plan.world_size
    by_table: dict[str, list[Shard]] = {}
    for s in plan.shards:
        if s.table not in known:
            raise PlanError(path, "rule 2", f"a shard names unknown table `{s.table}`")
        by_table.setdefault(s.table, []).append(s)
        if not 0 <= s.rank < world:
            raise PlanError(
                path, "rule 3", f"shard of `{s.table}` is on rank {s.rank}, outside [0, {world})"
            )
    for c in plan.clusters:
        for name in c.tables:
            cells = by_table.get(name, [])
            if c.kind == "dp":
                if cells:
                    raise PlanError(path, "rule 2", f"dp table `{name}` must have no shards")
                continue
            if not cells:
                raise PlanError(path, "rule 2", f"{c.kind} table `{name}` has no shards")
            dim = plan.table(name).dim
            rs = {s.row_shards for s in cells}
            if len(rs) != 1:
                raise PlanError(
                    path, "rule 2", f"shards of `{name}` disagree on row_shards: {sorted(rs)}"
                )
            r = rs.pop()
            if r > len(cells):
                # every row shard needs a cell of its own (checked before looping over them)
                raise PlanError(
                    path,
                    "rule 2",
                    f"`{name}` has row_shards {r} but {len(cells)} cell(s): some row shards "
                    "have no columns",
                )
            if any(s.row_shard >= r for s in cells):
                raise PlanError(path, "rule 2", f"`{name}` has a row_shard outside [0, {r})")
            for j in range(r):
                cols = sorted(s.columns for s in cells if s.row_shard == j)
                pos = 0
                for lo, hi in cols:
                    if lo != pos or hi <= lo:
                        raise PlanError(
                            path,
                            "rule 2",
                            f"columns of `{name}` row shard {j} do not tile [0, {dim}) "
                            f"exactly once (at column {pos}: got [{lo}, {hi}))",
                        )
                    pos = hi
                if pos != dim:
                    raise PlanError(
                        path,
                        "rule 2",
                        f"columns of `{name}` row shard {j} cover [0, {pos}), not [0, {dim})",
                    )
    if not plan.model_extra or not plan.model_extra.get("offload"):
        for rank, used in enumerate(plan.memory_by_rank()):
            if used > plan.topology.hbm_bytes:
                raise PlanError(
                    path,
                    "rule 4",
                    f"rank {rank} holds {used} bytes of weights and optimizer state, more than "
                    f"hbm_bytes {plan.topology.hbm_bytes}",
                )


def tier_problem(plan: Plan, s: Shard) -> str | None:
    """What is wrong with a shard's storage tier, or None: a cache is a host-tier cell's
    and holds at most the cell's rows."""
    if s.cache_rows is None:
        return None
    if not s.on_host:
        return (
            f"cache_rows {s.cache_rows} is given but the cell is in HBM; "
            'add "tier": "host" or remove cache_rows'
        )
    rows = plan.row_count(s.table, s.row_shard, s.row_shards)
    if s.cache_rows > rows:
        return (
            f"cache_rows {s.cache_rows} is more than the cell's {rows} rows; "
            f"give at most {rows} (or put the cell in HBM)"
        )
    return None


def _own_rules(plan: Plan, path: str) -> None:
    """What embarkc's readers need of a plan beyond the contract's rules (docs/plan.md,
    "Checking a plan"): a cache belongs to a host-tier cell and holds at most its rows;
    the global batch splits evenly over the ranks (the trainer and
    the simulator give every rank the same number of samples), and the estimate speaks of
    every rank of the plan once (or of none: a plan that gives no per-rank estimate)."""
    for i, s in enumerate(plan.shards):
        problem = tier_problem(plan, s)
        if problem:
            raise PlanError(path, "tier", f"shards[{i}] (`{s.table}`): {problem}")
    world = plan.world_size
    if plan.batch_size % world:
        raise PlanError(
            path,
            "batch",
            f"batch_size {plan.batch_size} does not split evenly over the {world} ranks "
            "(every rank trains the same number of samples); re-plan the spec",
        )
    seen: set[int] = set()
    for r in plan.estimate.per_rank:
        if not 0 <= r.rank < world or r.rank in seen:
            what = "twice" if r.rank in seen else f"outside [0, {world})"
            raise PlanError(
                path, "estimate", f"estimate.per_rank has rank {r.rank} {what}; re-plan the spec"
            )
        seen.add(r.rank)
    if seen and len(seen) != world:
        missing = min(set(range(world)) - seen)
        raise PlanError(
            path,
            "estimate",
            f"estimate.per_rank lists {len(seen)} of the {world} ranks (rank {missing} is "
            "missing): it lists every rank once, or none; re-plan the spec",
        )
    critical = plan.estimate.model_extra.get("critical_rank") if plan.estimate.model_extra else None
    if critical is not None and not 0 <= critical < world:
        raise PlanError(
            path,
            "estimate",
            f"estimate.critical_rank is {critical}, outside [0, {world}); re-plan the spec",
        )


def _non_finite(value: Any, where: str = "") -> str | None:
    """The dotted path of the first NaN or infinity in JSON data, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return where
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        got = _non_finite(item, f"{where}.{key}" if where else str(key))
        if got is not None:
            return got
    return None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise _DuplicateKey(dup)
    return dict(pairs)


class _DuplicateKey(ValueError):
    pass


def _first_error(e: ValidationError) -> tuple[str, str]:
    """(dotted field path, message) of a validation's first error."""
    err = e.errors()[0]
    return ".".join(str(p) for p in err["loc"]), err["msg"]


def parse_plan(text: str, path: str = "<plan>") -> Plan:
    """Parse and validate plan text; raise PlanError with the broken rule."""
    try:
        # a key given twice would be read as its last value by one reader and its first
        # by another: the plan is ambiguous
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except _DuplicateKey as e:
        raise PlanError(path, "json", f"key `{e}` appears twice in one object") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise PlanError(path, "json", f"not valid JSON ({e})") from None
    except ValueError as e:
        # Python's limit on the digits of an integer (a number no plan can hold)
        raise PlanError(path, "json", f"not a plan's JSON ({e})") from None
    if not isinstance(data, dict):
        raise PlanError(path, "format", "a plan is a JSON object")
    if data.get("format") != FORMAT:
        raise PlanError(path, "format", f"`format` is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise PlanError(
            path,
            "version",
            f"plan version {data.get('version')!r} is not supported (this embarkc reads "
            f"version {VERSION}); re-plan the spec with this embarkc",
        )
    if "row_partition" not in data:
        # the contract lists it, and where every row lives follows from it: no default
        raise PlanError(
            path, "schema", "field `row_partition`: missing (`mod` or `range`); re-plan the spec"
        )
    # strict: a JSON string, boolean or float where the contract has an integer is a broken
    # plan (`"rank": true` would otherwise be read as rank 1), not something to coerce
    try:
        plan = Plan.model_validate_json(text, strict=True)
    except ValidationError as e:
        where, msg = _first_error(e)
        raise PlanError(path, "schema", f"field `{where}`: {msg}") from None
    try:
        own = {k: data[k] for k in ("estimate", "planner", "model", "seed") if k in data}
        _OwnFields.model_validate_json(json.dumps(own), strict=True)
    except ValidationError as e:
        where, msg = _first_error(e)
        raise PlanError(
            path,
            "schema",
            f"field `{where}` (a field of embarkc's own, docs/plan.md): {msg}; "
            "re-plan the spec, or delete the field",
        ) from None
    where = _non_finite(data)
    if where is not None:
        # a field no model above declares (one of another tool, or a newer embarkc's)
        raise PlanError(path, "schema", f"field `{where}`: not a finite number")
    validate_rules(plan, path)
    _own_rules(plan, path)
    rows = {t.name: t.rows for t in plan.tables}
    for f in plan.features:
        problem = feature_problem(f, rows[f.table])
        if problem is not None:
            raise PlanError(path, "features", problem)
    return plan


# ------------------------------------------------------------------ completeness
# The models above give defaults to fields that a plan of another tool may leave out.
# A plan read as the plan of a spec (`embarkc check` against its spec, `compile --plan`)
# or trained (the generated trainer) must not fall back on them: a deleted `"lr": 0.05`
# would train with 0.01. `missing_fields` names every field the spec determines that a
# plan lacks; docs/plan.md ("Fields a plan may leave out") lists the ones it may.

_TABLE_FIELDS = ("dtype", "optimizer", "optimizer_params", "init")
_OPTIONAL_PARAMS = ("schedule",)
"""Optimizer parameters written only when the spec sets them (absent: a constant rate);
`check` compares a plan's schedules with its spec's, so a deleted one is still found."""
_FEATURE_FIELDS = ("pooling", "max_hotness", "fixed", "weighted")
_ACCESS_FIELDS = {"uniform": (), "zipf": ("alpha", "permuted"), "histogram": ("keys", "counts")}
_MODEL_FIELDS: dict[str, tuple[str, ...]] = {
    "": ("batch_size", "dense_features", "bottom_mlp", "interaction", "top_mlp", "optimizer"),
    "interaction": ("kind", "layers", "low_rank"),
    "optimizer": ("kind", "lr", "eps", "beta1", "beta2"),
}


def _unset(model: BaseModel, names: tuple[str, ...] | list[str], where: str) -> list[str]:
    return [f"{where}.{n}" for n in names if n not in model.model_fields_set]


def missing_training_fields(plan: Plan) -> list[str]:
    """Dotted paths (`tables.1.optimizer_params.lr`, as the schema errors name fields) of
    the fields of tables and features that training reads and `plan` does not give, in
    file order: each table's dtype, optimizer, every optimizer and init parameter; each
    feature's pooling, bag bounds (max_hotness, fixed), weighted and the parameters of
    its access distribution."""
    out: list[str] = []
    for i, t in enumerate(plan.tables):
        out += _unset(t, _TABLE_FIELDS, f"tables.{i}")
        if "optimizer_params" in t.model_fields_set:
            names = [n for n in OptimizerParams.model_fields if n not in _OPTIONAL_PARAMS]
            out += _unset(t.optimizer_params, names, f"tables.{i}.optimizer_params")
        if "init" in t.model_fields_set:
            out += _unset(t.init, list(InitParams.model_fields), f"tables.{i}.init")
    for i, f in enumerate(plan.features):
        out += _unset(f, _FEATURE_FIELDS, f"features.{i}")
        out += _unset(f.access, _ACCESS_FIELDS[f.access.kind], f"features.{i}.access")
    return out


def missing_fields(plan: Plan) -> list[str]:
    """Dotted paths of every field that the spec of `plan` determines and `plan` does not
    give (`missing_training_fields`, the topology's arch and dense_flops, the dense
    `model` and every field of it, the `seed`), and of the contract's planner fields
    (`seed`, `wall_time`), in file order. An empty list for a plan embarkc wrote."""
    out = _unset(plan.topology, ("arch", "dense_flops"), "topology")
    out += missing_training_fields(plan)
    own = plan.model_extra or {}
    model = own.get("model")
    if not isinstance(model, dict):
        out.append("model")
    else:
        for part, names in _MODEL_FIELDS.items():
            node = model.get(part) if part else model
            where = f"model.{part}" if part else "model"
            if isinstance(node, dict):
                out += [f"{where}.{n}" for n in names if n not in node]
    if own.get("seed") is None:
        out.append("seed")
    out += _unset(plan.planner, ("seed", "wall_time"), "planner")
    return out


def _missing_error(path: str, missing: list[str], why: str) -> PlanError:
    shown = ", ".join(f"`{m}`" for m in missing[:8])
    more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    return PlanError(
        path,
        "complete",
        f"field{'s' if len(missing) > 1 else ''} {shown}{more} missing: {why}; re-plan the "
        "spec (`embarkc plan SPEC -o plan.json`) or restore the field",
    )


def check_complete(
    plan: Plan, path: str, *, training: bool = False, unwritten: Sequence[str] = ()
) -> None:
    """Raise PlanError (rule `complete`) naming the fields `plan` lacks: with `training`
    those training reads (the generated trainer), else every field its spec determines
    (a plan read against its spec), and the `unwritten` ones: fields written only when
    the spec sets them, which the caller found the spec sets (a feature's `column`)."""
    if training:
        missing = missing_training_fields(plan)
        why = "training reads it and would fall back on a default the spec may not say"
    else:
        missing = missing_fields(plan)
        why = "the spec determines it, and a reader would fall back on a default"
    missing += unwritten
    if missing:
        raise _missing_error(path, missing, why)


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise PlanError(str(path), "file", "no such file") from None
    except OSError as e:
        raise PlanError(str(path), "file", f"cannot read ({e.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise PlanError(str(path), "json", "not a UTF-8 text file") from None
    return parse_plan(text, str(path))
