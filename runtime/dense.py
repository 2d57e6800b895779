"""The DLRM dense model and its data-parallel training.

Model (Naumov et al. 2019, DLRM; Wang et al. 2021, DCN-V2):

    bottom MLP:   x = relu(... relu(W1 dense + b1) ...)          width d (or no bottom)
    interaction:  dot    z = [x, pairwise dots <v_i, v_j> (i > j) of (x, e_1..e_F)]
                  dcnv2  x0 = [x, e_1..e_F];  x_{l+1} = x0 * (U_l (V_l x_l) + c_l) + x_l
    top MLP:      logit = W_L relu(... relu(W1 z + b1) ...)      one output, no activation

`e_f` is the pooled (or concatenated) embedding output of feature f. The dot interaction
needs every vector at width d; a feature of another width is first mapped to d by a
bias-free linear projection (part of the model, trained like the MLPs).

Data parallelism: every rank holds the same replica (built from the same seed) and runs
its slice of the global batch. `local_loss` is the sum of the per-sample losses of the
slice divided by the GLOBAL batch size, so that `allreduce_gradients` (a SUM over ranks)
leaves on every rank exactly the gradient of the mean loss over the whole global batch:
training matches the unsharded reference run on one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from embark_runtime.schedules import Schedule, rate_at


@dataclass(frozen=True)
class DenseConfig:
    """Architecture of the dense part; `feature_widths` in the order features are fed."""

    dense_features: int
    bottom_mlp: tuple[int, ...]
    interaction: str
    top_mlp: tuple[int, ...]
    feature_widths: tuple[int, ...]
    cross_layers: int = 3
    low_rank: int = 512

    def __post_init__(self) -> None:
        if self.interaction not in ("dot", "dcnv2"):
            raise ValueError(f"unknown interaction {self.interaction!r} (dot or dcnv2)")
        if self.dense_features < 0 or any(w <= 0 for w in self.feature_widths):
            raise ValueError("widths must be positive")
        if self.bottom_mlp and self.dense_features == 0:
            raise ValueError("a bottom MLP needs dense features")
        if not self.feature_widths and self.dense_features == 0:
            raise ValueError("the model has no input: no dense features and no embeddings")
        if not self.top_mlp or self.top_mlp[-1] != 1:
            # the language refuses such a spec; an older one's train.py is refused here
            # rather than given an output layer it did not ask for
            raise ValueError(
                f"top_mlp {list(self.top_mlp)} does not end in 1, the model's one logit "
                "per sample: add the output layer to the spec and recompile it"
            )


@dataclass(frozen=True)
class DenseOptimizerConfig:
    kind: str = "sgd"
    lr: float = 0.01
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    """L2 penalty: `weight_decay * w` added to every gradient before the step."""


def _mlp(width_in: int, widths: Sequence[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, w in enumerate(widths):
        layers.append(nn.Linear(width_in, w))
        if last_activation or i < len(widths) - 1:
            layers.append(nn.ReLU())
        width_in = w
    return nn.Sequential(*layers)


class CrossNetV2(nn.Module):
    """DCN-V2 cross layers with low-rank weights: x_{l+1} = x0 * (U (V x_l) + c) + x_l."""

    def __init__(self, width: int, layers: int, low_rank: int):
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(width, low_rank, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(low_rank, width) for _ in range(layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for down, up in zip(self.down, self.up, strict=True):
            x = x0 * up(down(x)) + x
        return x


class DLRMDense(nn.Module):
    """Bottom MLP, dot or DCN-V2 interaction, top MLP; `forward` returns one logit per sample.

    Parameters are initialised by torch's default initialisers under `torch.manual_seed(seed)`
    (the global RNG state is restored afterwards), so every rank and the reference build
    identical replicas.
    """

    def __init__(self, config: DenseConfig, seed: int = 0):
        super().__init__()
        self.config = config
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self._build(config)

    def _build(self, c: DenseConfig) -> None:
        self.bottom = _mlp(c.dense_features, c.bottom_mlp, last_activation=True)
        d = c.bottom_mlp[-1] if c.bottom_mlp else c.dense_features
        has_x = c.dense_features > 0
        if c.interaction == "dot":
            if not has_x:
                d = c.feature_widths[0]
            self.project = nn.ModuleList(
                nn.Identity() if w == d else nn.Linear(w, d, bias=False) for w in c.feature_widths
            )
            n = len(c.feature_widths) + int(has_x)
            top_in = (d if has_x else 0) + n * (n - 1) // 2
            self.cross = None
        else:
            self.project = nn.ModuleList()
            top_in = (d if has_x else 0) + sum(c.feature_widths)
            self.cross = CrossNetV2(top_in, c.cross_layers, c.low_rank)
        self.top = _mlp(top_in, c.top_mlp, last_activation=False)
        self.has_x = has_x

    def bottom_forward(self, dense: torch.Tensor) -> torch.Tensor | None:
        """The bottom MLP's output (None without dense features), to pass to `forward`."""
        return self.bottom(dense) if self.has_x else None

    def forward(
        self,
        dense: torch.Tensor,
        embedded: Sequence[torch.Tensor],
        *,
        bottom: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`bottom`: the bottom MLP's output when the caller ran it already (the trainer
        runs it before the embedding lookup, see trainer._Sharded._step)."""
        if len(embedded) != len(self.config.feature_widths):
            raise ValueError(
                f"expected {len(self.config.feature_widths)} embedding outputs, got {len(embedded)}"
            )
        x = bottom if bottom is not None else self.bottom_forward(dense)
        if self.cross is None:
            vectors = [p(e) for p, e in zip(self.project, embedded, strict=True)]
            if x is not None:
                vectors.insert(0, x)
            t = torch.stack(vectors, dim=1)  # [b, n, d]
            z = torch.bmm(t, t.transpose(1, 2))
            i, j = torch.tril_indices(t.shape[1], t.shape[1], offset=-1, device=t.device)
            pairs = z[:, i, j]
            top_in = torch.cat([x, pairs], dim=1) if x is not None else pairs
        else:
            parts = ([x] if x is not None else []) + list(embedded)
            top_in = self.cross(torch.cat(parts, dim=1))
        return self.top(top_in).squeeze(1)


def local_loss(logits: torch.Tensor, labels: torch.Tensor, global_batch: int) -> torch.Tensor:
    """Sum of this slice's binary cross-entropies divided by the global batch size."""
    return nn.functional.binary_cross_entropy_with_logits(
        logits, labels.to(logits.dtype), reduction="sum"
    ) / float(global_batch)


def allreduce_gradients(
    params: Iterable[nn.Parameter], reduce: Callable[[torch.Tensor], object] | None = None
) -> int:
    """SUM-all-reduce the gradients of `params` in one flat buffer; returns its bytes.

    `reduce(flat)` sums the buffer in place over the ranks (the trainer passes its Comm's
    `hierarchical_all_reduce`, docs/communication.md's exchange of the dense model, which
    also counts the traffic under cluster `dense`); by default a plain
    torch.distributed.all_reduce on the default group (uncounted), or nothing when
    torch.distributed is not initialised. A parameter
    without a gradient contributes zeros, so every rank reduces the same buffer layout.
    """
    import torch.distributed as dist

    plist = [p for p in params if p.requires_grad]
    if not plist:
        return 0
    flat = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in plist]
    )
    if reduce is not None:
        reduce(flat)
    elif dist.is_available() and dist.is_initialized():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in plist:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n
    return flat.numel() * flat.element_size()


def make_optimizer(
    params: Iterable[nn.Parameter], cfg: DenseOptimizerConfig
) -> torch.optim.Optimizer:
    """The spec's dense optimizer over `params`."""
    plist = list(params)
    decay = float(getattr(cfg, "weight_decay", 0.0))
    if cfg.kind == "sgd":
        return torch.optim.SGD(plist, lr=cfg.lr, weight_decay=decay)
    if cfg.kind == "adagrad":
        return torch.optim.Adagrad(plist, lr=cfg.lr, eps=cfg.eps, weight_decay=decay)
    if cfg.kind == "adam":
        return torch.optim.Adam(
            plist, lr=cfg.lr, eps=cfg.eps, betas=(cfg.beta1, cfg.beta2), weight_decay=decay
        )
    raise ValueError(f"unknown dense optimizer {cfg.kind!r} (sgd, adagrad or adam)")


def set_rate(opt: torch.optim.Optimizer, lr: float, schedule: Schedule | None, step: int) -> float:
    """Give every parameter group of `opt` the rate of `step` under `schedule` (the
    optimizer's own `lr` without one); returns it."""
    rate = rate_at(lr, schedule, step)
    for group in opt.param_groups:
        group["lr"] = rate
    return rate


PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dense model's precisions: the dtype autocast computes in (None: no autocast)."""


class _Unscale(torch.autograd.Function):
    """Identity forward; backward divides the gradient by the loss scale, so that the
    embeddings (updated inside the backward) see the gradient of the unscaled loss. A
    gradient that overflowed is zeroed: the dense step of that step is skipped by the
    scaler, and the embedding rows of this rank's samples are left as they are."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        out = g / ctx.scale.to(g.dtype)
        if not bool(torch.isfinite(out).all()):
            out = torch.zeros_like(out)
        return out, None


class MixedPrecision:
    """How the dense model computes: fp32, or autocast to bf16 or fp16 over fp32 weights.

    The weights, their gradients, the all-reduce and the optimizer stay fp32 (the master
    weights); autocast runs the matrix products in the low precision. fp16 adds dynamic
    loss scaling (torch.amp.GradScaler): the loss is multiplied by a scale before the
    backward, the dense gradients are divided by it before the step, a step whose
    gradients overflowed is skipped and the scale halved, and it doubles after 2000
    clean steps. The embedding outputs pass through `embedded`, which unscales their
    gradients, since the embeddings update themselves during the backward.
    """

    def __init__(self, name: str, device: torch.device):
        if name not in PRECISIONS:
            raise ValueError(f"unknown precision {name!r} (fp32, bf16 or fp16)")
        if name == "fp16" and device.type != "cuda":
            raise ValueError("fp16 trains on CUDA only; on the CPU use bf16 (or fp32)")
        self.name = name
        self.device_type = device.type
        self.dtype = PRECISIONS[name]
        self.scaler = torch.amp.GradScaler(device.type) if name == "fp16" else None

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def output(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits the loss is computed from: fp32 after autocast (a bf16 or fp16
        cross-entropy would round the loss itself), as they are otherwise."""
        return logits if self.dtype is None else logits.float()

    def embedded(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The embedding outputs to feed the dense model (unscaled in the backward)."""
        if self.scaler is None:
            return list(outputs)
        scale = self.scaler.get_scale()
        s = torch.tensor(float(scale), device=outputs[0].device) if outputs else None
        return [_Unscale.apply(o, s) for o in outputs]

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, opt: torch.optim.Optimizer) -> None:
        """The optimizer's step (skipped when a scaled gradient overflowed)."""
        if self.scaler is None:
            opt.step()
            return
        self.scaler.step(opt)
        self.scaler.update()

    def state(self) -> Iterator[tuple[str, float]]:
        """The loss scale, for logs (fp16 only)."""
        if self.scaler is not None:
            yield "loss_scale", float(self.scaler.get_scale())

    def scaler_state(self) -> dict[str, torch.Tensor]:
        """The loss scaler's dynamic state as named tensors, for checkpoints: `scale`
        (float64) and `growth_tracker` (the clean steps since the scale last moved,
        int64); empty without a scaler (fp32, bf16), so their checkpoints hold nothing
        more. Its fixed settings (factors, interval) are the program's, not saved."""
        if self.scaler is None:
            return {}
        s = self.scaler.state_dict()
        return {
            "scale": torch.tensor(float(s["scale"]), dtype=torch.float64),
            "growth_tracker": torch.tensor(int(s["_growth_tracker"]), dtype=torch.int64),
        }

    def load_scaler_state(self, state: Mapping[str, torch.Tensor]) -> bool:
        """Continue from a `scaler_state`; False (nothing changed) without a scaler or
        without a saved state (a checkpoint of an fp32 or bf16 run, or of before the
        scale was saved: the scale starts afresh)."""
        if self.scaler is None or not state:
            return False
        missing = sorted(set(SCALER_STATE) - set(state))
        if missing:
            raise DenseStateError(f"the loss scaler's state has no {', '.join(missing)}")
        s = self.scaler.state_dict()
        s["scale"] = float(state["scale"])
        s["_growth_tracker"] = int(state["growth_tracker"])
        self.scaler.load_state_dict(s)
        return True


SCALER_STATE = ("scale", "growth_tracker")
"""The names of `MixedPrecision.scaler_state`."""


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as flat named tensors (for checkpoints)."""
    out: dict[str, torch.Tensor] = {}
    for index, state in opt.state_dict()["state"].items():
        for key, value in state.items():
            t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            out[f"{index}.{key}"] = t.detach().cpu().clone()
    return out


DENSE_OPTIMIZER_STATE: dict[str, frozenset[str]] = {
    "sgd": frozenset(),
    "adagrad": frozenset({"step", "sum"}),
    "adam": frozenset({"step", "exp_avg", "exp_avg_sq"}),
}
"""The state torch keeps per parameter for each dense optimizer (`step` a scalar, the
others the parameter's shape), once it has taken a step."""


class DenseStateError(ValueError):
    """A checkpoint's dense model or optimizer state is not this program's."""


def check_dense_state(
    model: nn.Module, weights: dict[str, torch.Tensor], opt_kind: str, opt: dict[str, torch.Tensor]
) -> None:
    """Raise DenseStateError, naming the first difference, when `weights` (a state dict)
    and `opt` (`optimizer_state_tensors`) were not saved from a model of `model`'s
    parameters trained by the dense optimizer `opt_kind`."""
    own = model.state_dict()
    for name in [*own, *(k for k in weights if k not in own)]:  # the model's order
        if name not in weights:
            raise DenseStateError(f"the dense model has `{name}`, which the checkpoint lacks")
        if name not in own:
            raise DenseStateError(f"the checkpoint has `{name}`, which the dense model lacks")
        if tuple(weights[name].shape) != tuple(own[name].shape):
            raise DenseStateError(
                f"`{name}` is {list(weights[name].shape)} in the checkpoint and "
                f"{list(own[name].shape)} in the dense model"
            )
    params = list(model.parameters())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in opt.items():
        index, _, key = name.partition(".")
        if not index.isdigit() or int(index) >= len(params):
            raise DenseStateError(f"optimizer state `{name}` is of no parameter of the model")
        state.setdefault(int(index), {})[key] = value
    want = DENSE_OPTIMIZER_STATE[opt_kind]
    for i, p in enumerate(params):
        got = frozenset(state.get(i, {}))
        if got != want:
            saved = next((k for k, v in DENSE_OPTIMIZER_STATE.items() if v == got), None)
            by = f"{saved}'s" if saved else f"unknown optimizer state {sorted(got)}"
            raise DenseStateError(
                f"the checkpoint holds {by} state for the dense parameters; the dense "
                f"optimizer is now {opt_kind}"
            )
        for key, value in state.get(i, {}).items():
            shape = () if key == "step" else tuple(p.shape)
            if tuple(value.shape) != shape:
                raise DenseStateError(
                    f"optimizer state `{i}.{key}` is {list(value.shape)}, not {list(shape)}"
                )


def load_optimizer_state_tensors(
    opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]
) -> None:
    """Inverse of `optimizer_state_tensors` (param groups come from `opt` itself)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        index, _, key = name.partition(".")
        state.setdefault(int(index), {})[key] = value
    sd = opt.state_dict()
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
