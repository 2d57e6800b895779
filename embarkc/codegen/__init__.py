"""Code generation: Plan -> render specs -> {path: text}. Never touches disk (emit does).

`render(program, plan, spec_path)` returns every output of `embarkc compile` except the
manifest: plan.json, the CUDA kernels (embarkc.codegen.cuda.render_kernels) and the
training program (embarkc.codegen.program). `environment()` is the one Jinja environment
all templates render with: StrictUndefined (a missing value is an error, not an empty
string), no autoescaping (the targets are code), trailing newlines kept.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import jinja2

from embark_runtime.plan import Plan, dumps_plan
from embarkc.emit import GeneratedFile
from embarkc.ir import Program


def _template_root() -> Path:
    import embarkc.templates

    return Path(embarkc.templates.__file__).resolve().parent


@cache
def environment() -> jinja2.Environment:
    """The Jinja environment for every template under templates/ (names like `program/x.j2`)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(_template_root())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(program: Program, plan: Plan, spec_path: str) -> list[GeneratedFile]:
    """All outputs of `embarkc compile` for `plan`, in a deterministic order."""
    from embarkc.codegen.cuda import render_kernels, template_of
    from embarkc.codegen.program import render_program

    files = [GeneratedFile("plan.json", dumps_plan(plan), "embark_runtime.plan.dumps_plan")]
    for path, text in sorted(render_kernels(plan).items()):
        files.append(GeneratedFile(path, text, template_of(path)))
    files.extend(render_program(program, plan, spec_path))
    return files
