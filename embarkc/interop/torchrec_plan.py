"""Turn an exported `torchrec-sharding-plan` document (embarkc.interop.plan_export) into
TorchRec objects: a `torchrec.distributed.types.ShardingPlan` for DistributedModelParallel
and the `EmbeddingBagConfig`s of its tables.

This module imports without torchrec; torchrec is imported when a function is called.

    import json
    from embarkc.interop.torchrec_plan import embedding_bag_configs, to_sharding_plan

    doc = json.load(open("plan.torchrec.json"))
    ebc = EmbeddingBagCollection(tables=embedding_bag_configs(doc), device=torch.device("meta"))
    model = DistributedModelParallel(ebc, plan=to_sharding_plan(doc, "cuda"), ...)
"""

from __future__ import annotations

from typing import Any

FORMAT = "torchrec-sharding-plan"


def _check(doc: dict[str, Any]) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(
            f"not a {FORMAT} document (format {got!r}); make one with "
            "`embarkc export PLAN --format torchrec`"
        )


def placement(rank: int, device_type: str, local_world_size: int) -> str:
    """TorchRec's placement string of a shard on `rank`: `rank:3/cuda:1` (the device of the
    rank's local index) or `rank:3/cpu`, as torchrec.distributed.sharding_plan.placement."""
    if device_type in ("cuda", "mtia"):
        return f"rank:{rank}/{device_type}:{rank % local_world_size}"
    return f"rank:{rank}/{device_type}"


def to_sharding_plan(doc: dict[str, Any], device_type: str = "cuda", module_path: str = "") -> Any:
    """The `ShardingPlan` of the document for an EmbeddingBagCollection at `module_path`
    of the model given to DistributedModelParallel ("" when the collection is the model),
    its shards placed on `device_type` ("cuda" or "cpu")."""
    _check(doc)
    from torch.distributed._shard.metadata import ShardMetadata
    from torchrec.distributed.types import (
        EnumerableShardingSpec,
        ParameterSharding,
        ShardingPlan,
    )

    local = int(doc["local_world_size"])
    module_plan: dict[str, Any] = {}
    for name, rec in doc["plan"].items():
        spec = None
        if rec["shards"] is not None:
            spec = EnumerableShardingSpec(
                [
                    ShardMetadata(
                        shard_offsets=list(s["shard_offsets"]),
                        shard_sizes=list(s["shard_sizes"]),
                        placement=placement(int(s["rank"]), device_type, local),
                    )
                    for s in rec["shards"]
                ]
            )
        module_plan[name] = ParameterSharding(
            sharding_type=rec["sharding_type"],
            compute_kernel=rec["compute_kernel"],
            ranks=list(rec["ranks"]),
            sharding_spec=spec,
        )
    try:
        from torchrec.distributed.types import EmbeddingModuleShardingPlan

        return ShardingPlan({module_path: EmbeddingModuleShardingPlan(module_plan)})
    except ImportError:  # torchrec before EmbeddingModuleShardingPlan: a plain dict
        return ShardingPlan({module_path: module_plan})


def embedding_bag_configs(doc: dict[str, Any]) -> list[Any]:
    """The `EmbeddingBagConfig` of every table of the document (rows, dim, features,
    pooling, data type and uniform init bounds as the plan gives them)."""
    _check(doc)
    from torchrec import EmbeddingBagConfig, PoolingType
    from torchrec.types import DataType

    out = []
    for t in doc["tables"]:
        kwargs: dict[str, Any] = {}
        if "weight_init_min" in t:
            kwargs.update(
                weight_init_min=t["weight_init_min"], weight_init_max=t["weight_init_max"]
            )
        out.append(
            EmbeddingBagConfig(
                name=t["name"],
                num_embeddings=t["num_embeddings"],
                embedding_dim=t["embedding_dim"],
                feature_names=list(t["feature_names"]),
                pooling=PoolingType[t["pooling"]],
                data_type=DataType[t["data_type"]],
                **kwargs,
            )
        )
    return out
