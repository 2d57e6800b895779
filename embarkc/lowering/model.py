"""The `model` block: the dense model (batch, MLPs, interaction) and its optimizer."""

from __future__ import annotations

from typing import Any

from lark import Token, Tree

from embarkc import ir
from embarkc.diagnostics import Span
from embarkc.lowering.base import (
    DENSE_OPTIMIZER_PARAMS,
    INTERACTION_PARAMS,
    Block,
    Field_,
    LowererBase,
    _Fail,
)
from embarkc.syntax import parts, span_of


class ModelLowering(LowererBase):
    def model(self, b: Block | None) -> ir.DenseModel:
        if b is None:
            self.error(
                "the spec has no `model` block",
                Span(self.files[0].path, 1, 1, 1, 2),
                "add e.g. `model { batch 65536 dense_features 13 }`",
            )
            raise _Fail
        kw: dict[str, Any] = {}
        ok = True
        if "batch" not in b.fields:
            self.error(
                "`model` has no `batch`",
                b.keyword_span(),
                "add the global batch size: `batch 65536`",
            )
            ok = False
        for key, minimum in (("batch", 1), ("dense_features", 0)):
            if key in b.fields:
                node = b.fields[key].values[0]
                assert isinstance(node, Tree)
                v = self.attempt(self.num, node, b.file, what=key, minimum=minimum)
                if v is None:
                    ok = False
                else:
                    kw["batch_size" if key == "batch" else key] = v
        kw.setdefault("dense_features", 0)
        for key in ("bottom_mlp", "top_mlp"):
            if key in b.fields:
                lst = b.fields[key].values[0]
                assert isinstance(lst, Tree)
                sizes = []
                for n in parts(lst):
                    assert isinstance(n, Tree)
                    v = self.attempt(self.num, n, b.file, what=f"{key} layer width")
                    if v is None:
                        ok = False
                    sizes.append(v)
                if len(sizes) > ir.MAX_MLP_LAYERS:
                    self.error(
                        f"`{key}` has {len(sizes):,} layers; an MLP may have at most "
                        f"{ir.MAX_MLP_LAYERS:,}",
                        b.fields[key].span,
                    )
                    ok = False
                if key == "top_mlp" and not sizes:
                    self.error(
                        "`top_mlp` needs at least its output layer",
                        b.fields[key].span,
                        "e.g. `top_mlp [256, 1]`",
                    )
                    ok = False
                if key == "top_mlp" and not self.top_output(b.fields[key], sizes):
                    ok = False
                kw[key] = tuple(sizes)
        if "interaction" in b.fields:
            fld = b.fields["interaction"]
            got = self.attempt(self.kind_with_params, fld, INTERACTION_PARAMS, "interaction")
            if got is None:
                ok = False
            else:
                kind, params, span = got
                inter = self.attempt(
                    self.build,
                    ir.Interaction,
                    span,
                    kind=kind,
                    span=ir.SpanModel.of(span),
                    **params,
                )
                ok = ok and inter is not None
                kw["interaction"] = inter
        if "optimizer" in b.fields:
            fld = b.fields["optimizer"]
            got = self.attempt(
                self.kind_with_params, fld, DENSE_OPTIMIZER_PARAMS, "dense optimizer"
            )
            if got is None:
                ok = False
            else:
                kind, params, span = got
                opt = self.attempt(
                    self.build,
                    ir.DenseOptimizer,
                    span,
                    kind=kind,
                    span=ir.SpanModel.of(span),
                    **params,
                )
                ok = ok and opt is not None
                kw["optimizer"] = opt
        if "schedule" in b.fields:
            schedule = self.attempt(self.schedule, b.fields["schedule"])
            if schedule is None:
                ok = False
            elif ok:
                base = kw.get("optimizer", ir.DenseOptimizer())
                kw["optimizer"] = base.model_copy(update={"schedule": schedule})
        if "precision" in b.fields:
            tok = b.fields["precision"].values[0]
            assert isinstance(tok, Token)
            v = self.attempt(self.choice, tok, b.file, ("fp32", "bf16", "fp16"), "precision")
            if v is None:
                ok = False
            else:
                kw["precision"] = v
        if not ok:
            raise _Fail
        return self.build(ir.DenseModel, b.span, span=ir.SpanModel.of(b.span), **kw)

    def top_output(self, fld: Field_, sizes: list[Any]) -> bool:
        """Whether the top MLP ends in the model's one logit per sample (its last width
        is 1; the trainer adds no layer); else says so."""
        if sizes and sizes[-1] is not None and sizes[-1] != 1:
            lst = fld.values[0]
            assert isinstance(lst, Tree)
            last = parts(lst)[-1]
            self.error(
                f"`top_mlp` ends in {sizes[-1]}; its last layer is the output, one logit "
                "per sample, so it must be 1",
                span_of(last, fld.file),
                f"add the output layer: `top_mlp [{', '.join(str(x) for x in sizes)}, 1]`",
            )
            return False
        return True
