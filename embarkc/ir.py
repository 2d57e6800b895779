"""The typed, immutable IR of an embark spec.

DATA MODEL
==========
`lower.lower(ast)` produces one `Program` per compiled spec. Its invariants, which every
later stage (planner, simulator, codegen, diff, report) may rely on without checking:

* Names are resolved: every `Feature.table` is the name of a `Table` in the same program;
  table and feature names are unique; every constraint names an existing table.
* Units are normalised: memory in bytes (int), bandwidth in bytes per second per GPU per
  direction (float), time in seconds (float). `10 Gb/s` is already 1.25e9 here.
* Defaults are applied: no field is "unset"; a `Table` always has its optimizer and
  initialiser, a `Feature` its access distribution, the `Program` its plan options.
* Values are valid on their own: sizes are positive, dims are positive, hotness is
  positive and no larger than `max_hotness`, probabilities are in range, a `concat`
  feature has a fixed hotness, the top MLP ends in 1 (the logit). Cross-object feasibility (does it fit in memory? do the
  constraints contradict each other?) is checked by `lower` and reported as diagnostics,
  so a `Program` that exists is one the planner may try to plan.
* Every user-written node keeps its source `span` (None only for nodes built in Python,
  e.g. by tests or by the workload importer).
* Models are frozen pydantic models with unknown keys forbidden: the IR round-trips
  losslessly through `model_dump()` / `model_validate()`.
* Collections are tuples, in source order (tables and features in declaration order).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from embark_runtime.dtypes import DTYPE_BYTES
from embark_runtime.optimizers import STATE_ELEMENT_BYTES, optimizer
from embark_runtime.plan import (
    MAX_BANDWIDTH,
    MAX_BATCH,
    MAX_DENSE_FLOPS,
    MAX_DIM,
    MAX_GPUS_PER_NODE,
    MAX_HOTNESS,
    MAX_LAYER_WIDTH,
    MAX_LAYERS,
    MAX_NODES,
    MAX_ROWS,
    MAX_SEED,
)
from embark_runtime.schedules import MAX_STEPS
from embark_runtime.schedules import Schedule as RuntimeSchedule
from embarkc.diagnostics import Span

LIMITS = {
    "rows": MAX_ROWS,
    "dim": MAX_DIM,
    "hotness": MAX_HOTNESS,
    "max hotness": MAX_HOTNESS,
    "batch": MAX_BATCH,
    "nodes": MAX_NODES,
    "gpus_per_node": MAX_GPUS_PER_NODE,
    "dense_features": MAX_LAYER_WIDTH,
    "bottom_mlp layer width": MAX_LAYER_WIDTH,
    "top_mlp layer width": MAX_LAYER_WIDTH,
    "low_rank": MAX_LAYER_WIDTH,
    "layers": MAX_LAYERS,
}
"""The largest value of each size a spec may give (by the name the language's errors use;
the plan file holds the same bounds, embark_runtime.plan)."""

RATE_LIMITS = {
    "hbm_bandwidth": MAX_BANDWIDTH,
    "nvlink": MAX_BANDWIDTH,
    "network": MAX_BANDWIDTH,
    "host_bandwidth": MAX_BANDWIDTH,
    "dense_flops": MAX_DENSE_FLOPS,
}
"""The largest rate of each hardware field (bytes or FLOP/s per second per GPU)."""

MAX_MLP_LAYERS = MAX_LAYERS
"""Layers of an MLP (and cross layers of DCN-V2: `LIMITS["layers"]`)."""

DType = Literal["fp32", "fp16", "bf16"]
Pooling = Literal["sum", "mean", "concat"]
ClusterKind = Literal["dp", "rb", "ub"]
OptimizerKind = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]
Strategy = Literal[
    "embark",
    "greedy",
    "table-wise",
    "row-wise",
    "column-wise",
    "table-row-wise",
    "data-parallel",
]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
"""Every planning strategy (--strategy, `plan { strategy ... }`); the last five are the
fixed baselines."""


class SpanModel(BaseModel):
    """A source span as stored in the IR (mirrors `diagnostics.Span`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    file: str
    line: int = 0
    col: int = 0
    end_line: int = 0
    end_col: int = 0

    @staticmethod
    def of(span: Span) -> SpanModel:
        return SpanModel(
            file=span.file,
            line=span.line,
            col=span.col,
            end_line=span.end_line,
            end_col=span.end_col,
        )

    def to_span(self) -> Span:
        return Span(self.file, self.line, self.col, self.end_line, self.end_col)


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    span: SpanModel | None = Field(default=None, repr=False)


def without_spans(dumped: Any) -> Any:
    """A node's `model_dump` without the `span` of it and of every node inside: what it
    says, not where (plan files record it so)."""
    if isinstance(dumped, dict):
        return {k: without_spans(v) for k, v in dumped.items() if k != "span"}
    if isinstance(dumped, list | tuple):
        return [without_spans(v) for v in dumped]
    return dumped


# --------------------------------------------------------------------------- hardware


class Topology(Node):
    """The GPU cluster. Bandwidths are per GPU per direction."""

    nodes: int = Field(gt=0, le=MAX_NODES)
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS_PER_NODE)
    hbm_bytes: int = Field(gt=0)
    hbm_bandwidth: float = Field(gt=0)
    intra_node_bandwidth: float = Field(gt=0)
    inter_node_bandwidth: float = Field(gt=0)
    dense_flops: float = Field(default=0.0, ge=0)
    """Peak fp32 FLOP/s per GPU (no tensor cores), the rate of the dense part's math:
    it sets how much of the next batch's key traffic hides under the dense compute
    (dense.prefetch_window). 0: unknown, no overlap is credited."""
    host_memory: int | None = Field(default=None, gt=0)
    """Host memory per node that host-tier cells may use (bytes; None: not given, so no
    cell may be in host memory). docs/host_tier.md."""
    host_bandwidth: float | None = Field(default=None, gt=0)
    """Host <-> GPU copy rate per GPU per direction (PCIe Gen5 x16 ~55 GB/s, Grace
    Hopper's NVLink-C2C ~450 GB/s): the rate of a host-tier cell's fetches and write-backs."""
    arch: str = "sm_90"
    """CUDA architecture the kernels are built for (sm_90 for H100/H200, sm_80 for A100)."""
    preset: str | None = None
    """The named preset the hardware started from, if any (informational)."""
    constants: dict[str, float] = Field(default_factory=dict)
    """The cost model's constants the hardware block sets ({`Constants` field: value},
    embarkc.planner.constants.TUNABLE); the others keep their defaults."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node


# --------------------------------------------------------------------------- tables


class Schedule(Node):
    """A learning-rate schedule (`schedule { warmup W decay poly { ... } }`): the rate
    at step t is `embark_runtime.schedules.Schedule.rate(lr, t)`, which owns the math and
    the rules between the fields (a decay starts after the warm-up, a poly decay ends
    after it starts)."""

    warmup: int = Field(default=0, ge=0, le=MAX_STEPS)
    decay: Literal["none", "poly", "step"] = "none"
    start: int = Field(default=0, ge=0, le=MAX_STEPS)
    end: int = Field(default=0, ge=0, le=MAX_STEPS)
    power: float = Field(default=1.0, gt=0, le=1e3)
    end_lr: float = Field(default=0.0, ge=0)
    every: int = Field(default=1, gt=0, le=MAX_STEPS)
    factor: float = Field(default=0.1, gt=0, le=1)

    @model_validator(mode="after")
    def _runtime_rules(self) -> Schedule:
        self.runtime()
        return self

    def runtime(self) -> RuntimeSchedule:
        """The plan file's and the trainer's form of this schedule."""
        return RuntimeSchedule.model_validate(without_spans(self.model_dump(mode="json")))


def _without_unset(handler: SerializerFunctionWrapHandler, node: BaseModel, **unset: Any) -> Any:
    """`node`'s dump without the fields whose value is their `unset` one: fields added
    since plans were first written are left out until a spec sets them, so that the plan
    of every spec without them stays byte-identical."""
    data = handler(node)
    for name, value in unset.items():
        if name in data and getattr(node, name) == value:
            del data[name]
    return data


class Optimizer(Node):
    """A sparse embedding optimizer and its hyper-parameters.

    Its state is the one table `embark_runtime.optimizers.OPTIMIZERS`.
    """

    kind: OptimizerKind = "sgd"
    lr: float = Field(default=0.01, gt=0)
    eps: float = Field(default=1e-8, gt=0)
    initial_accumulator: float = Field(default=0.0, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    schedule: Schedule | None = None
    """How the rate changes over the steps; None: constant."""

    def state_elements_per_row(self, dim: int) -> int:
        """fp32 optimizer-state elements stored for one row of width `dim`."""
        return optimizer(self.kind).elements_per_row(dim)


class Init(Node):
    """Initial values of a table: uniform(low, high), normal(mean, std) or constant."""

    kind: Literal["uniform", "normal", "constant"] = "uniform"
    low: float = -0.05
    high: float = 0.05
    mean: float = 0.0
    std: float = 0.01
    value: float = 0.0


class Table(Node):
    name: str
    rows: int = Field(gt=0, le=MAX_ROWS)
    dim: int = Field(gt=0, le=MAX_DIM)
    dtype: DType = "fp32"
    optimizer: Optimizer = Optimizer()
    init: Init = Init()

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def parameters(self) -> int:
        return self.rows * self.dim

    @property
    def row_weight_bytes(self) -> int:
        return self.dim * self.element_bytes

    @property
    def row_state_bytes(self) -> int:
        return self.optimizer.state_elements_per_row(self.dim) * STATE_ELEMENT_BYTES

    @property
    def row_bytes(self) -> int:
        """Weights plus optimizer state of one row."""
        return self.row_weight_bytes + self.row_state_bytes

    @property
    def bytes(self) -> int:
        """Weights plus optimizer state of the whole table."""
        return self.rows * self.row_bytes


# --------------------------------------------------------------------------- features


class Access(Node):
    """How ids are drawn for a feature.

    * uniform: every row equally likely.
    * zipf: P(rank r) proportional to 1 / (r + 1) ** alpha over the table's rows.
      permuted=True: rank r is stored at a pseudo-random key (hashed ids, hot keys spread
      over the key space); permuted=False: key r is the r-th most frequent (sorted ids).
    * histogram: measured counts; `keys[i]` was seen `counts[i]` times, other keys never.
      `path` is where they were read from (relative to the spec).
    """

    kind: Literal["uniform", "zipf", "histogram"] = "uniform"
    alpha: float = Field(default=1.1, gt=0)
    permuted: bool = True
    path: str | None = None
    keys: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()


class Feature(Node):
    """A sparse feature: each sample carries a bag of ids into one table.

    hotness is the mean bag length; with `fixed` every bag has exactly `hotness` ids
    (then hotness is an integer and equals max_hotness), otherwise lengths vary in
    [1, max_hotness] with that mean.
    """

    name: str
    table: str
    hotness: float = Field(gt=0, le=MAX_HOTNESS)
    max_hotness: int = Field(gt=0, le=MAX_HOTNESS)
    fixed: bool = True
    pooling: Pooling = "sum"
    weighted: bool = False
    access: Access = Access()
    column: str | None = None
    """the column of the input data (Parquet, Criteo) holding this feature's ids; None:
    the column named as the feature (the trainer's --column-map overrides either)"""


# --------------------------------------------------------------------------- dense model


class Interaction(Node):
    kind: Literal["dot", "dcnv2"] = "dot"
    layers: int = Field(default=3, gt=0)
    low_rank: int = Field(default=512, gt=0)


class DenseOptimizer(Node):
    kind: Literal["sgd", "adagrad", "adam"] = "sgd"
    lr: float = Field(default=0.01, gt=0)
    eps: float = Field(default=1e-8, gt=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.999, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    """L2 penalty added to the gradient (torch's `weight_decay`); not dumped when 0."""
    schedule: Schedule | None = None
    """How the rate changes over the steps; None: constant (not dumped, see
    `_without_unset`)."""

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_unset(handler, self, weight_decay=0.0, schedule=None)


Precision = Literal["fp32", "bf16", "fp16"]


class DenseModel(Node):
    """The DLRM dense part: bottom MLP over dense features, interaction, top MLP."""

    batch_size: int = Field(gt=0, le=MAX_BATCH)
    """Global batch: samples per step over all ranks."""
    dense_features: int = Field(ge=0)
    bottom_mlp: tuple[int, ...] = ()
    interaction: Interaction = Interaction()
    top_mlp: tuple[int, ...] = (1,)
    optimizer: DenseOptimizer = DenseOptimizer()
    precision: Precision = "fp32"
    """The dense model's compute: fp32, or autocast to bf16 or fp16 over fp32 weights
    (fp16 with dynamic loss scaling). Not dumped when fp32 (`_without_unset`)."""

    @model_validator(mode="after")
    def _top_ends_in_the_logit(self) -> DenseModel:
        # the trainer adds no layer: the top MLP's last width is the one logit per sample
        if not self.top_mlp or self.top_mlp[-1] != 1:
            raise ValueError(f"top_mlp {list(self.top_mlp)} must end in 1, the output logit")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> Any:
        return _without_unset(handler, self, precision="fp32")


# --------------------------------------------------------------------------- planning


class TableConstraint(Node):
    """What the user fixed or bounded for one table's placement."""

    table: str
    cluster: ClusterKind | None = None
    min_row_shards: int = Field(default=1, gt=0)
    max_row_shards: int | None = Field(default=None, gt=0)
    min_column_shards: int = Field(default=1, gt=0)
    max_column_shards: int | None = Field(default=None, gt=0)
    """`no_column_split` in the language lowers to max_column_shards == 1."""
    within_node: bool = False
    """All cells of the table live on the GPUs of one node."""


class Colocate(Node):
    """Keep these tables on the same set of GPUs (same ranks for their cells)."""

    tables: tuple[str, ...]


class PlanOptions(Node):
    objective: Literal["step_time", "memory"] = "step_time"
    strategy: Strategy = "embark"
    solver: Literal["greedy", "cp-sat"] = "cp-sat"
    time_limit: float = Field(default=30.0, gt=0)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    row_partition: Literal["mod", "range"] = "mod"
    communication: Literal["auto", "flat", "hierarchical"] = "auto"
    memory_headroom: int = Field(default=0, ge=0)
    """Bytes per GPU kept free of embedding weights and state (for activations etc.)."""


class Source(Node):
    path: str
    sha256: str


class Program(Node):
    """One compiled spec: the cluster, the embeddings, the dense model, how to plan."""

    name: str
    sources: tuple[Source, ...]
    """The root spec first, then every included file in include order."""
    topology: Topology
    tables: tuple[Table, ...]
    features: tuple[Feature, ...]
    model: DenseModel
    options: PlanOptions = PlanOptions()
    constraints: tuple[TableConstraint, ...] = ()
    colocate: tuple[Colocate, ...] = ()

    model_config = ConfigDict(frozen=True, extra="forbid", ignored_types=(cached_property,))

    @cached_property
    def table_by_name(self) -> dict[str, Table]:
        return {t.name: t for t in self.tables}

    @cached_property
    def feature_by_name(self) -> dict[str, Feature]:
        return {f.name: f for f in self.features}

    @cached_property
    def features_of(self) -> dict[str, tuple[Feature, ...]]:
        out: dict[str, list[Feature]] = {t.name: [] for t in self.tables}
        for f in self.features:
            out[f.table].append(f)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def constraint_of(self) -> dict[str, TableConstraint]:
        return {c.table: c for c in self.constraints}

    @property
    def batch_size(self) -> int:
        return self.model.batch_size

    @property
    def parameters(self) -> int:
        return sum(t.parameters for t in self.tables)

    @property
    def embedding_bytes(self) -> int:
        """Weights plus optimizer state of all tables, one copy each."""
        return sum(t.bytes for t in self.tables)

    @property
    def lookups_per_sample(self) -> float:
        return sum(f.hotness for f in self.features)
