"""Plan review: what `embarkc diff` and `embarkc report` show of a plan.

    views.py     view_of(plan, program) -> PlanView     the figures of one plan, torch-free
    compare.py   diff_views(...) -> PlanDiff            two views compared; the CI gates
    render.py    render_markdown / render_json          a PlanDiff as a PR comment or JSON
    terminal.py  render_terminal                        a PlanDiff as rich tables
    text.py      fmt_time, fmt_bytes, ranks_text ...    how review figures are written

`embarkc.diff` loads the two sides (a plan file, or a spec planned on the fly) and finds
their programs; `embarkc.report` draws one view.
"""
