"""The `hardware` block: the topology (a preset, nodes, GPUs, HBM, bandwidths, dense
FLOP/s, the host memory and its bandwidth for host-tier cells) and the cost model's
constants it overrides."""

from __future__ import annotations

import re
from typing import Any

from lark import Token, Tree

from embarkc import ir
from embarkc.diagnostics import Span
from embarkc.lowering.base import Block, LowererBase, _Fail
from embarkc.planner import constants as K
from embarkc.presets import PRESETS
from embarkc.syntax import span_of


class HardwareLowering(LowererBase):
    def topology(self, b: Block | None) -> ir.Topology:
        if b is None:
            first = self.files[0].path
            self.error(
                "the spec has no `hardware` block",
                Span(first, 1, 1, 1, 2),
                "add e.g. `hardware { preset dgx_h100 nodes 2 }`",
            )
            raise _Fail
        values: dict[str, Any] = {}
        preset: str | None = None
        if "preset" in b.fields:
            tok = b.fields["preset"].values[0]
            assert isinstance(tok, Token)
            preset = self.attempt(self.choice, tok, b.file, PRESETS, "hardware preset")
            if preset is None:
                raise _Fail
            values.update(PRESETS[preset])
        ok = True
        spec = {
            "nodes": ("nodes", "count", True),
            "gpus_per_node": ("gpus_per_node", "count", True),
            "hbm": ("hbm_bytes", "bytes", True),
            "hbm_bandwidth": ("hbm_bandwidth", "bandwidth", False),
            "nvlink": ("intra_node_bandwidth", "bandwidth", False),
            "network": ("inter_node_bandwidth", "bandwidth", False),
        }
        optional = {
            "dense_flops": ("dense_flops", "compute", False),
            "host_memory": ("host_memory", "bytes", True),
            "host_bandwidth": ("host_bandwidth", "bandwidth", False),
        }
        for key, (attr, kind, integer) in {**spec, **optional}.items():
            fld = b.fields.get(key)
            if fld is None:
                continue
            node = fld.values[0]
            assert isinstance(node, Tree)
            # dense_flops 0: the dense rate is unknown and no key overlap is credited
            least = 0 if key == "dense_flops" else 1
            v = self.attempt(
                self.num, node, fld.file, kind, integer=integer, what=key, minimum=least
            )
            top = ir.RATE_LIMITS.get(key)
            if v is not None and top is not None and v > top:
                self.error(
                    f"{key} must be at most {top:g} {'FLOP/s' if kind == 'compute' else 'B/s'}"
                    f" per GPU, got {node.children[0]}"
                    f"{' ' + str(node.children[1]) if len(node.children) > 1 else ''}",
                    span_of(node, fld.file),
                    "no GPU comes near this: is the unit right?",
                )
                v = None
            elif v is not None and key == "dense_flops" and 0 < v < 1:
                self.error(
                    f"dense_flops must be 0 (unknown) or at least 1 FLOP/s, got {v:g}",
                    span_of(node, fld.file),
                )
                v = None
            if v is None:
                ok = False
            else:
                values[attr] = v
        constants = self.attempt(self.cost_constants, b)
        if constants is None:
            ok = False
        elif constants:
            values["constants"] = constants
        if "arch" in b.fields:
            tok = b.fields["arch"].values[0]
            if re.fullmatch(r"sm_[0-9]{2,3}a?", str(tok)):
                values["arch"] = str(tok)
            else:
                self.error(
                    f"unknown GPU architecture `{tok}`",
                    span_of(tok, b.fields["arch"].file),
                    "write it as CUDA does: `sm_80`, `sm_90`",
                )
                ok = False
        if preset is None:
            values.setdefault("nodes", 1)
            missing = [k for k, (attr, _, _) in spec.items() if attr not in values]
            if missing and ok:
                self.error(
                    "hardware is missing " + ", ".join(f"`{m}`" for m in missing),
                    b.keyword_span(),
                    "start from a preset (`preset dgx_h100`, `dgx_h200`, `dgx_a100_80gb`) "
                    "or give every field",
                )
                ok = False
        if not ok:
            raise _Fail
        return self.build(
            ir.Topology, b.span, preset=preset, span=ir.SpanModel.of(b.span), **values
        )

    def cost_constants(self, b: Block) -> dict[str, float]:
        """The cost model's constants the hardware block sets ({`Constants` field: value}):
        efficiencies are fractions in (0, 1], latencies times of at most a second, `min_read`
        a size of at most 4 KiB; raises _Fail after reporting every bad one."""
        out: dict[str, float] = {}
        ok = True
        for key, (attr, kind, _) in K.TUNABLE.items():
            fld = b.fields.get(key)
            if fld is None:
                continue
            node = fld.values[0]
            assert isinstance(node, Tree)
            top: float = {"count": 1.0, "time": 1.0, "bytes": 4096.0}[kind]
            v = self.attempt(
                self.num, node, fld.file, kind, integer=kind == "bytes", what=key, minimum=0
            )
            if v is not None and not 0 < v <= top:
                self.error(
                    f"{key} must be above 0 and at most {top:g}"
                    f"{' ' + {'time': 's', 'bytes': 'B'}[kind] if kind != 'count' else ''}"
                    f", got {v:g}",
                    span_of(node, fld.file),
                    "an efficiency is the share of the peak a kernel or collective reaches"
                    if kind == "count"
                    else None,
                )
                v = None
            if v is None:
                ok = False
            else:
                out[attr] = float(v)
        if not ok:
            raise _Fail
        return out
