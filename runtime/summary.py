"""The end-of-run summary: what a run did, beside what its plan predicted.

Rank 0 (or the reference run) prints it after the last step and writes it as the last
record of `--log-json` (`{"summary": true, ...}`). The measured step is the whole
iteration as the trainer runs it (data, embeddings, dense model, all-reduce, updates);
the plan's `estimate.step_time` is the embedding part on the plan's hardware, and
`estimate.critical_path` the same if every phase waited for its slowest rank
(docs/plan.md). On a CPU run of a GPU plan the two differ by orders of magnitude: the
ratio is printed so that a run on the plan's hardware can be judged at a glance
(docs/measure.md calibrates the constants so that they meet). Torch-free.
"""

from __future__ import annotations

import math
from typing import Any

from embark_runtime.formatting import format_ms, format_seconds


def run_summary(
    step_seconds: list[float],
    wall_seconds: float,
    global_batch: int,
    final_loss: float | None,
    final_eval: dict[str, float] | None,
    plan: Any,
    first_step: int = 0,
) -> dict[str, Any]:
    """The summary record of a run: `step_seconds` of the steps it trained (from step
    `first_step`), its wall time from start to end, the last loss and evaluation."""
    n = len(step_seconds)
    train = float(sum(step_seconds))
    ordered = sorted(step_seconds)
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2 if n else None
    est = plan.estimate
    extra = est.model_extra or {}
    predicted = float(est.step_time)
    record: dict[str, Any] = {
        "summary": True,
        "steps": n,
        "first_step": first_step,
        "wall_s": wall_seconds,
        "train_s": train,
        "samples": n * global_batch,
        "samples_per_s": n * global_batch / train if train > 0 else None,
        "loss": final_loss,
        "auc": (final_eval or {}).get("auc"),
        "logloss": (final_eval or {}).get("logloss"),
        "step_s_mean": train / n if n else None,
        "step_s_median": median,
        "plan_step_s": predicted,
        "plan_critical_path_s": extra.get("critical_path"),
        "measured_over_plan": median / predicted if median and predicted > 0 else None,
    }
    return record


def summary_lines(r: dict[str, Any]) -> list[str]:
    """The summary as the trainer prints it."""
    if not r["steps"]:
        return [f"summary: no step trained (wall {format_seconds(r['wall_s'])})"]
    loss = "n/a" if r["loss"] is None else f"{r['loss']:.5f}"
    auc = r["auc"]
    ev = (
        f"AUC {auc:.4f}, log loss {r['logloss']:.5f}"
        if auc is not None and not math.isnan(auc)
        else f"log loss {r['logloss']:.5f}"
        if r["logloss"] is not None
        else "no evaluation"
    )
    rate = r["samples_per_s"]
    lines = [
        f"summary: {r['steps']} step{'s' if r['steps'] != 1 else ''} in "
        f"{format_seconds(r['train_s'])} (wall "
        f"{format_seconds(r['wall_s'])}), mean {rate:,.0f} samples/s; "
        f"final loss {loss}, {ev}",
    ]
    crit = r["plan_critical_path_s"]
    plan = f"the plan predicts {format_ms(r['plan_step_s'])} for the embedding step" + (
        f" ({format_ms(crit)} if every phase waits for the slowest rank)" if crit else ""
    )
    ratio = r["measured_over_plan"]
    lines.append(
        f"step time: measured {format_ms(r['step_s_median'])} median, "
        f"{format_ms(r['step_s_mean'])} mean (the whole iteration); {plan}"
        + (f"; measured / predicted {ratio:,.1f}x" if ratio is not None else "")
    )
    return lines


__all__ = ["run_summary", "summary_lines"]
