"""Learning-rate schedules: the rate an optimizer uses at each training step.

One schedule shape serves the embedding optimizers (`tables[].optimizer_params.schedule`
in plan.json) and the dense optimizer (`model.optimizer.schedule`), as the spec's
`schedule { ... }` field writes it (docs/language.md, "Learning-rate schedules"). Steps
count from 0: step t is the (t + 1)-th update, the one a run logs as `"step": t`, so a
resumed run continues the schedule where the checkpoint left it.

With the optimizer's rate `lr`, a warm-up of W steps and a decay from step S:

    t < W                     lr * (t + 1) / W                         linear warm-up
    decay poly, S <= t < E    end + (lr - end) * (1 - (t - S) / (E - S)) ** power
    decay poly, t >= E        end
    decay step, t >= S        lr * factor ** floor((t - S) / every)
    otherwise                 lr                                       constant

The MLPerf DLRM-DCNv2 reference's schedule is `warmup W` then `decay poly` with power 2 and
end 0 (its floor of 1e-7 aside). The sharded trainer and the reference (`--reference`)
both take their rates from `rate`, so a scheduled run stays bit-exact with its reference.
This module imports neither torch nor the compiler.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STEPS = 1 << 40
"""The largest step a schedule names (far beyond any run: 10^12 steps)."""

DECAYS = ("none", "poly", "step")
"""The decay kinds: `none` keeps the rate after the warm-up."""


class Schedule(BaseModel):
    """A warm-up and a decay of an optimizer's rate (the module docstring's formulas).

    `start` is S (the first step of the decay; at least `warmup`), `end` is E (poly only,
    above `start`), `end_lr` the rate from E on; `every` and `factor` are the step decay's.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)
    warmup: int = Field(default=0, ge=0, le=MAX_STEPS)
    decay: Literal["none", "poly", "step"] = "none"
    start: int = Field(default=0, ge=0, le=MAX_STEPS)
    end: int = Field(default=0, ge=0, le=MAX_STEPS)
    power: float = Field(default=1.0, gt=0, le=1e3)
    end_lr: float = Field(default=0.0, ge=0)
    every: int = Field(default=1, gt=0, le=MAX_STEPS)
    factor: float = Field(default=0.1, gt=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> Schedule:
        if self.decay != "none" and self.start < self.warmup:
            raise ValueError(
                f"the decay starts at step {self.start}, inside the warm-up of {self.warmup} steps"
            )
        if self.decay == "poly" and not self.end > self.start:
            raise ValueError(f"a poly decay ends after it starts ({self.start}), got {self.end}")
        return self

    def rate(self, lr: float, step: int) -> float:
        """The rate at `step` (0-based) of an optimizer whose own rate is `lr`."""
        if step < 0:
            raise ValueError(f"steps count from 0, got {step}")
        if step < self.warmup:
            return lr * (step + 1) / self.warmup
        if self.decay == "poly" and step >= self.start:
            if step >= self.end:
                return self.end_lr
            left = 1.0 - (step - self.start) / (self.end - self.start)
            return self.end_lr + (lr - self.end_lr) * left**self.power
        if self.decay == "step" and step >= self.start:
            return lr * self.factor ** math.floor((step - self.start) / self.every)
        return lr

    def describe(self) -> str:
        """One line for logs: `warm-up 100 steps, poly decay (power 2) from 200 to 1000 to 0`."""
        parts = [f"warm-up {self.warmup} steps"] if self.warmup else []
        if self.decay == "poly":
            parts.append(
                f"poly decay (power {self.power:g}) from step {self.start} to {self.end}, "
                f"down to {self.end_lr:g}"
            )
        elif self.decay == "step":
            parts.append(f"x{self.factor:g} every {self.every} steps from step {self.start}")
        return ", ".join(parts) or "constant"


def rate_at(lr: float, schedule: Schedule | None, step: int) -> float:
    """`lr` as `schedule` sets it at `step`; `lr` itself without a schedule."""
    return lr if schedule is None else schedule.rate(lr, step)
