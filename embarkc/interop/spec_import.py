"""Import a TorchRec or HugeCTR model description as an embark spec.

`read_torchrec(path)` reads a JSON list of TorchRec `EmbeddingBagConfig` fields (or a
Python `module:attribute` holding `EmbeddingBagConfig`s or such dicts);
`read_hugectr(path)` a HugeCTR training JSON (its `layers`, `solver`, `optimizer`) or an
embedding-collection description (`{"tables": [...]}`). Both give an `Imported`:
tables, features and what the source says about the batch, the GPUs and the optimizer,
plus the list of values that had to be assumed. `spec_text(imported)` writes it as a spec
through embarkc's formatter, every assumed value on a line of its own ending in a comment
`# ASSUMED: ...`, so that it is easy to find and change; the text is lowered before it is
returned, so an imported spec always passes `embarkc check` and plans.

Errors name the file and, for JSON, the entry at fault (`model.json: tables[3]
(`user`): embedding_dim must be a positive integer`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embarkc.diagnostics import EmbarkError

ASSUMED_HOTNESS = 1
ASSUMED_ACCESS = "zipf(1.1)"
ASSUMED_PRESET = "dgx_h100"
PRESET_GPUS, PRESET_HBM = 8, 80 * 1024**3
ASSUMED_BATCH_PER_GPU = 1024
FIT_SLACK = 1.5
"""Nodes are assumed so that the tables (weights and state) take at most 1/FIT_SLACK of
the HBM: room for the planner's choices and the dense part."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_KEYWORDS = {
    "table", "tables", "feature", "hardware", "defaults", "model", "plan", "include",
    "true", "false",
}  # fmt: skip


@dataclass
class Feature:
    name: str
    pooling: str = "sum"
    hotness: float | None = None
    """None: not given by the source (ASSUMED_HOTNESS is written)."""
    max_hotness: int | None = None
    assumed: str | None = None
    """Why the hotness written is a guess (a comment `# ASSUMED: ...` on its line)."""


@dataclass
class Table:
    name: str
    rows: int
    dim: int
    dtype: str = "fp32"
    init: tuple[float, float] | None = None
    features: list[Feature] = field(default_factory=list)
    note: str | None = None


@dataclass
class Imported:
    source: str
    kind: str
    tables: list[Table]
    batch: int | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    optimizer: str | None = None
    """The spec text of the sparse optimizer (`adam { lr 0.001 }`), None: not given."""
    dense_features: int | None = None
    notes: list[str] = field(default_factory=list)


def _fail(path: str, message: str, hint: str | None = None) -> EmbarkError:
    return EmbarkError.at(path, message, hint=hint)


def _load_json(path: str) -> Any:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot read: {getattr(e, 'strerror', None) or e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise EmbarkError.at(f"{path}:{e.lineno}:{e.colno}", f"invalid JSON: {e.msg}") from None


def _int(path: str, where: str, key: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(path, f"{where}: {key} must be an integer of at least {low}, got {value!r}")
    return value


def _ident(name: Any, path: str, where: str, taken: set[str]) -> tuple[str, str | None]:
    """A spec identifier for `name` (unique among `taken`), and a note when it differs."""
    if not isinstance(name, str) or not name:
        raise _fail(path, f"{where}: a name must be a non-empty string, got {name!r}")
    ident = re.sub(r"[^A-Za-z0-9_]", "_", name)
    if not _NAME.match(ident) or ident in _KEYWORDS:
        ident = f"t_{ident}"
    base, n = ident, 2
    while ident in taken:
        ident, n = f"{base}_{n}", n + 1
    taken.add(ident)
    return ident, (None if ident == name else f"`{name}` in the source")


# --------------------------------------------------------------------------- torchrec

TORCHREC_KEYS = {
    "name", "num_embeddings", "embedding_dim", "feature_names", "pooling", "data_type",
    "weight_init_min", "weight_init_max", "need_pos", "num_embeddings_post_pruning",
    "init_fn", "total_num_buckets", "use_virtual_table", "virtual_table_eviction_policy",
    "enable_embedding_update", "input_dim", "embedding_names",
}  # fmt: skip
"""EmbeddingBagConfig fields read (the first eight) or accepted and ignored."""

_POOLING = {"SUM": "sum", "MEAN": "mean", "NONE": "concat"}
_DTYPE = {"FP32": "fp32", "FP16": "fp16", "BF16": "bf16"}


def read_torchrec(path: str) -> Imported:
    """The TorchRec tables of `path`: a JSON file, or `module:attribute` (a Python list of
    EmbeddingBagConfig or dicts of its fields; importing it may import torchrec)."""
    if not Path(path).exists() and re.fullmatch(r"[\w.]+:[\w.]+", path):
        configs = _python_configs(path)
    else:
        configs = _load_json(path)
        if isinstance(configs, dict) and "tables" in configs:
            configs = configs["tables"]
    if not isinstance(configs, list) or not configs:
        raise _fail(
            path,
            'expected a non-empty list of EmbeddingBagConfig fields (or {"tables": [...]})',
        )
    tables: list[Table] = []
    taken: set[str] = set()
    feature_names: set[str] = set()
    for i, c in enumerate(configs):
        where = f"tables[{i}]"
        if not isinstance(c, dict):
            raise _fail(path, f"{where}: expected an object, got {type(c).__name__}")
        unknown = sorted(set(c) - TORCHREC_KEYS)
        if unknown:
            raise _fail(
                path,
                f"{where}: unknown field{'s' if len(unknown) > 1 else ''} "
                + ", ".join(f"`{k}`" for k in unknown),
                hint="EmbeddingBagConfig fields read: name, num_embeddings, embedding_dim, "
                "feature_names, pooling, data_type, weight_init_min, weight_init_max",
            )
        for key in ("name", "num_embeddings", "embedding_dim"):
            if key not in c:
                raise _fail(path, f"{where}: missing `{key}`")
        where = f"{where} (`{c['name']}`)"
        name, note = _ident(c["name"], path, where, taken)
        t = Table(
            name=name,
            rows=_int(path, where, "num_embeddings", c["num_embeddings"]),
            dim=_int(path, where, "embedding_dim", c["embedding_dim"]),
            note=note,
        )
        pooling = _enum(c.get("pooling", "SUM"))
        if pooling not in _POOLING:
            raise _fail(path, f"{where}: pooling {c.get('pooling')!r}: expected SUM, MEAN or NONE")
        dtype = _enum(c.get("data_type", "FP32"))
        if dtype not in _DTYPE:
            raise _fail(
                path,
                f"{where}: data_type {c.get('data_type')!r}: embarkc's tables are FP32, FP16 "
                "or BF16",
                hint="quantized tables (INT8, INT4) are an inference format; import the "
                "training dtype",
            )
        t.dtype = _DTYPE[dtype]
        lo, hi = c.get("weight_init_min"), c.get("weight_init_max")
        if lo is not None or hi is not None:
            if not all(isinstance(x, int | float) and math.isfinite(x) for x in (lo, hi)):
                raise _fail(path, f"{where}: weight_init_min and weight_init_max: two numbers")
            if not lo < hi:  # type: ignore[operator]
                raise _fail(path, f"{where}: weight_init_min {lo} is not below max {hi}")
            t.init = (float(lo), float(hi))  # type: ignore[arg-type]
        names = c.get("feature_names") or [c["name"]]
        if not isinstance(names, list):
            raise _fail(path, f"{where}: feature_names must be a list of strings")
        for fname in names:
            if fname in feature_names:
                raise _fail(
                    path,
                    f"{where}: feature `{fname}` is read by two tables",
                    hint="TorchRec and embarkc both give a feature one table",
                )
            feature_names.add(fname)
            t.features.append(Feature(name=str(fname), pooling=_POOLING[pooling]))
        tables.append(t)
    _name_features(tables, path)
    return Imported(source=path, kind="TorchRec EmbeddingBagConfig", tables=tables)


def _enum(value: Any) -> str:
    """`SUM`, `PoolingType.SUM` or the enum itself -> `SUM`."""
    text = getattr(value, "name", None) or str(value)
    return text.rsplit(".", 1)[-1].upper()


def _python_configs(ref: str) -> list[dict[str, Any]]:
    import importlib
    import sys

    module, attribute = ref.split(":", 1)
    sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        hint = (
            "install torchrec (bench/peer_torchrec_setup.sh shows how) or export the configs "
            "as JSON"
            if e.name and e.name.split(".")[0] in ("torchrec", "fbgemm_gpu", "torch")
            else "run embarkc from the folder that holds the module, or give a JSON file"
        )
        raise _fail(ref, f"cannot import `{module}`: {e}", hint=hint) from None
    finally:
        sys.path.pop(0)
    value: Any = mod
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise _fail(ref, f"`{module}` has no attribute `{attribute}`")
        value = getattr(value, part)
    if not isinstance(value, list | tuple):
        raise _fail(ref, f"`{attribute}` is a {type(value).__name__}, expected a list")
    out = []
    for c in value:
        if isinstance(c, dict):
            out.append(c)
            continue
        out.append(
            {
                k: getattr(c, k)
                for k in (
                    "name",
                    "num_embeddings",
                    "embedding_dim",
                    "feature_names",
                    "pooling",
                    "data_type",
                    "weight_init_min",
                    "weight_init_max",
                )  # fmt: skip
                if getattr(c, k, None) is not None
            }
        )
    return out


def _name_features(tables: list[Table], path: str) -> None:
    """Feature names as spec identifiers, distinct from every table's but their own."""
    taken = {t.name for t in tables}
    for t in tables:
        for f in t.features:
            if f.name == t.name:
                continue
            ident = re.sub(r"[^A-Za-z0-9_]", "_", f.name)
            if not _NAME.match(ident) or ident in _KEYWORDS:
                ident = f"f_{ident}"
            base, n = ident, 2
            while ident in taken and not (len(t.features) == 1 and ident == t.name):
                ident, n = f"{base}_{n}", n + 1
            taken.add(ident)
            f.name = ident


# --------------------------------------------------------------------------- hugectr

HUGECTR_EMBEDDINGS = ("DistributedSlotSparseEmbeddingHash", "LocalizedSlotSparseEmbeddingHash")
_OPTIMIZERS = {
    "sgd": "sgd", "momentumsgd": "sgd", "nesterov": "sgd", "adam": "adam",
    "adagrad": "adagrad", "lazy_adam": "adam",
}  # fmt: skip
COLLECTION_KEYS = {
    "name", "table_name", "vocabulary_size", "max_vocabulary_size", "dim", "ev_size",
    "embedding_vec_size", "combiner", "hotness", "max_hotness", "features",
}  # fmt: skip


def read_hugectr(path: str) -> Imported:
    """The embedding tables of a HugeCTR training JSON or embedding-collection JSON."""
    data = _load_json(path)
    if not isinstance(data, dict):
        raise _fail(path, 'expected a JSON object (a HugeCTR training JSON or {"tables": ...})')
    if "layers" in data:
        return _hugectr_training(path, data)
    if "tables" in data:
        return _hugectr_collection(path, data)
    raise _fail(
        path,
        "neither a HugeCTR training JSON (no `layers`) nor an embedding-collection "
        "description (no `tables`)",
    )


def _combiner(path: str, where: str, value: Any) -> str:
    text = str(value).lower()
    pooling = {"0": "sum", "sum": "sum", "1": "mean", "mean": "mean", "concat": "concat"}.get(text)
    if pooling is None:
        raise _fail(path, f"{where}: combiner {value!r}: expected sum (0), mean (1) or concat")
    return pooling


def _hugectr_training(path: str, data: dict[str, Any]) -> Imported:
    layers = data["layers"]
    if not isinstance(layers, list):
        raise _fail(path, "`layers` must be a list")
    solver = data.get("solver") or {}
    out = Imported(source=path, kind="HugeCTR training JSON", tables=[])
    batch = solver.get("batchsize")
    if batch is not None:
        out.batch = _int(path, "solver", "batchsize", batch)
    gpus = solver.get("gpu")
    if isinstance(gpus, list) and gpus:
        per_node = gpus if all(isinstance(g, list) for g in gpus) else [gpus]
        out.nodes, out.gpus_per_node = len(per_node), max(len(g) for g in per_node)
    out.optimizer = _hugectr_optimizer(path, data.get("optimizer") or solver.get("optimizer"))
    hotness_of: dict[str, tuple[float, int]] = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict):
            raise _fail(path, f"layers[{i}]: expected an object")
        if layer.get("type") == "Data":
            dense = layer.get("dense") or {}
            if "dense_dim" in dense:
                out.dense_features = _int(
                    path, f"layers[{i}].dense", "dense_dim", dense["dense_dim"], 0
                )
            sparse = layer.get("sparse") or []
            for s in sparse if isinstance(sparse, list) else [sparse]:
                slots = s.get("slot_num")
                most = s.get("max_feature_num_per_sample")
                if isinstance(slots, int) and slots > 0 and isinstance(most, int) and most > 0:
                    hotness_of[str(s.get("top"))] = (most / slots, most)
    taken: set[str] = set()
    for i, layer in enumerate(layers):
        if layer.get("type") not in HUGECTR_EMBEDDINGS:
            continue
        where = f"layers[{i}] (`{layer.get('name', layer.get('type'))}`)"
        hp = layer.get("sparse_embedding_hparam")
        if not isinstance(hp, dict):
            raise _fail(path, f"{where}: missing `sparse_embedding_hparam`")
        sizes = hp.get("slot_size_array")
        if not isinstance(sizes, list) or not sizes:
            raise _fail(
                path,
                f"{where}: `slot_size_array` missing or empty",
                hint="embarkc needs each slot's vocabulary size (max_vocabulary_size_per_gpu "
                "alone does not say how rows split over slots)",
            )
        dim = _int(path, where, "embedding_vec_size", hp.get("embedding_vec_size"))
        pooling = _combiner(path, where, hp.get("combiner", "sum"))
        hot = hotness_of.get(str(layer.get("bottom")))
        for j, rows in enumerate(sizes):
            base = re.sub(r"[^A-Za-z0-9_]", "_", str(layer.get("name", "emb")))
            name, _ = _ident(f"{base}_slot{j}", path, where, taken)
            t = Table(
                name=name, rows=_int(path, f"{where}: slot_size_array[{j}]", "size", rows), dim=dim
            )
            f = Feature(name=name, pooling=pooling)
            if hot is not None and hot[0] == 1:
                f.hotness = 1
            elif hot is not None:
                # the data layer bounds all slots together: a bag of 1..max of mean `mean`
                f.hotness, f.max_hotness = max(1.0, hot[0]), hot[1]
                f.assumed = (
                    "hotness from the data layer: max_feature_num_per_sample "
                    "over slot_num, for all slots together"
                )
            t.features.append(f)
            out.tables.append(t)
    if not out.tables:
        raise _fail(
            path,
            "no embedding layer: expected a layer of type "
            + " or ".join(f"`{t}`" for t in HUGECTR_EMBEDDINGS),
        )
    return out


def _hugectr_optimizer(path: str, opt: Any) -> str | None:
    if not isinstance(opt, dict) or "type" not in opt:
        return None
    kind = _OPTIMIZERS.get(str(opt["type"]).lower())
    if kind is None:
        raise _fail(
            path,
            f"optimizer type {opt['type']!r}: embarkc trains SGD, Adam or AdaGrad",
        )
    hp = {}
    for key in (
        "sgd_hparam",
        "adam_hparam",
        "adagrad_hparam",
        "momentum_sgd_hparam",
        "nesterov_hparam",
    ):
        if isinstance(opt.get(key), dict):
            hp = opt[key]
    lr = hp.get("learning_rate", opt.get("learning_rate"))
    fields = []
    if isinstance(lr, int | float) and lr > 0:
        fields.append(f"lr {lr:g}")
    if kind == "adam":
        for src, dst in (("beta1", "beta1"), ("beta2", "beta2"), ("epsilon", "eps")):
            if isinstance(hp.get(src), int | float):
                fields.append(f"{dst} {hp[src]:g}")
    if kind == "adagrad" and isinstance(hp.get("initial_accu_value"), int | float):
        fields.append(f"initial_accumulator {hp['initial_accu_value']:g}")
    return f"{kind} {{ {' '.join(fields)} }}" if fields else kind


def _hugectr_collection(path: str, data: dict[str, Any]) -> Imported:
    tables_in = data["tables"]
    if not isinstance(tables_in, list) or not tables_in:
        raise _fail(path, "`tables` must be a non-empty list")
    out = Imported(source=path, kind="HugeCTR embedding collection", tables=[])
    if "batch_size" in data:
        out.batch = _int(path, "batch_size", "batch_size", data["batch_size"])
    if "num_gpus" in data:
        out.gpus_per_node = _int(path, "num_gpus", "num_gpus", data["num_gpus"])
        out.nodes = 1
    out.optimizer = _hugectr_optimizer(path, data.get("optimizer"))
    taken: set[str] = set()
    for i, c in enumerate(tables_in):
        where = f"tables[{i}]"
        if not isinstance(c, dict):
            raise _fail(path, f"{where}: expected an object")
        unknown = sorted(set(c) - COLLECTION_KEYS)
        if unknown:
            raise _fail(
                path,
                f"{where}: unknown field " + ", ".join(f"`{k}`" for k in unknown),
                hint="fields: " + ", ".join(sorted(COLLECTION_KEYS)),
            )
        raw = c.get("table_name", c.get("name"))
        where = f"{where} (`{raw}`)"
        name, note = _ident(raw, path, where, taken)
        rows = c.get("max_vocabulary_size", c.get("vocabulary_size"))
        dim = c.get("ev_size", c.get("dim", c.get("embedding_vec_size")))
        t = Table(
            name=name,
            rows=_int(path, where, "vocabulary_size", rows),
            dim=_int(path, where, "ev_size", dim),
            note=note,
        )
        pooling = _combiner(path, where, c.get("combiner", "sum"))
        f = Feature(name=name, pooling=pooling)
        hot = c.get("hotness", c.get("max_hotness"))
        if hot is not None:
            f.hotness = _int(path, where, "hotness", hot)
        t.features.append(f)
        out.tables.append(t)
    return out


# --------------------------------------------------------------------------- writing


def spec_text(imp: Imported, filename: str = "<imported>") -> str:
    """`imp` as a formatted spec (embarkc.format); lowered before it is returned."""
    from embarkc.format import format_text
    from embarkc.frontend import load_program_text
    from embarkc.ir import Optimizer
    from embarkc.ir import Table as IRTable

    A = "# ASSUMED:"
    lines = [
        f"# Imported from {imp.source} ({imp.kind}) by `embarkc import`.",
        "# Values the source does not give are marked ASSUMED: change them to your model's.",
        "# `embarkc profile DATA --spec THIS --write` measures hotness and access from data.",
    ]
    lines += [f"# note: {n}" for n in imp.notes]
    optimizer = imp.optimizer or "sgd { lr 0.01 }"
    kind = optimizer.split()[0]
    total = sum(
        IRTable(
            name=t.name, rows=t.rows, dim=t.dim, dtype=t.dtype, optimizer=Optimizer(kind=kind)
        ).bytes  # type: ignore[arg-type]
        for t in imp.tables
    )
    gpus_per_node = imp.gpus_per_node or PRESET_GPUS
    if imp.nodes is not None:
        nodes = imp.nodes
    else:
        nodes = max(1, math.ceil(total * FIT_SLACK / (gpus_per_node * PRESET_HBM)))
    hw = ["hardware {", f"  preset {ASSUMED_PRESET}  {A} the GPU model (HBM, bandwidths)"]
    hw.append(
        f"  nodes {nodes}" + ("" if imp.nodes is not None else f"  {A} enough to hold the tables")
    )
    if imp.gpus_per_node is not None:
        hw.append(f"  gpus_per_node {imp.gpus_per_node}")
    hw.append("}")
    lines += [""] + hw
    defaults = [
        "defaults {",
        f"  optimizer {optimizer}" + ("" if imp.optimizer else f"  {A} the sparse optimizer"),
    ]
    defaults.append(f"  access {ASSUMED_ACCESS}  {A} how ids are drawn (skew)")
    defaults.append(
        f"  hotness {ASSUMED_HOTNESS}  {A} ids per sample, for features that do not say"
    )
    defaults.append("}")
    lines += [""] + defaults
    world = nodes * gpus_per_node
    batch = imp.batch if imp.batch is not None else ASSUMED_BATCH_PER_GPU * world
    if batch % world:
        raise EmbarkError.at(
            imp.source,
            f"the batch {batch} does not split over the {world} GPUs",
            hint="embarkc splits the global batch evenly over the GPUs",
        )
    model = [
        "model {",
        f"  batch {batch}" + ("" if imp.batch is not None else f"  {A} global batch"),
    ]
    if imp.dense_features:
        model.append(f"  dense_features {imp.dense_features}")
    model.append("}")
    lines += [""] + model
    for t in imp.tables:
        lines.append("")
        if t.note:
            lines.append(f"# {t.name}: {t.note}")
        fields = [f"rows {t.rows}", f"dim {t.dim}"]
        if t.dtype != "fp32":
            fields.append(f"dtype {t.dtype}")
        if t.init is not None:
            fields.append(f"init uniform({t.init[0]:g}, {t.init[1]:g})")
        own = len(t.features) == 1 and t.features[0].name == t.name
        if own:
            fields += _feature_fields(t.features[0])
        lines.append(f"table {t.name} {{ {' '.join(fields)} }}" + _assumed(t.features[0], own))
        if not own:
            for f in t.features:
                body = " ".join([f"table {t.name}"] + _feature_fields(f))
                lines.append(f"feature {f.name} {{ {body} }}" + _assumed(f, True))
    text = "\n".join(lines) + "\n"
    text = format_text(text, filename)
    load_program_text(text, filename)  # every imported spec checks
    return text


def _assumed(f: Feature, here: bool) -> str:
    return f"  # ASSUMED: {f.assumed}" if here and f.assumed else ""


def _feature_fields(f: Feature) -> list[str]:
    out = []
    if f.hotness is not None:
        if f.max_hotness is not None and f.max_hotness > f.hotness:
            out.append(f"hotness mean {f.hotness:g} max {f.max_hotness}")
        else:
            out.append(f"hotness {f.hotness:g}")
    if f.pooling != "sum":
        out.append(f"pooling {f.pooling}")
    return out
