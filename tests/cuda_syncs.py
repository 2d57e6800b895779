"""Count the places where the host would wait for a CUDA device, in code run on the CPU.

On a GPU, reading a device value on the host (`.item()`, `.tolist()`, `bool(t)`, `int(t)`,
a copy to the CPU) or an op whose result size depends on device values (`nonzero`,
`unique`, boolean masks, `repeat_interleave` without `output_size`) makes the host wait
until the device has finished everything queued before it. The emulated kernels
(tests/cuda_emulator.py) run on CPU tensors, where none of these wait; `HostWaits` counts
them as the same code would meet them on a GPU, through torch's function override hook,
so a test can hold a step of the CUDA path to a number of waits without a GPU.

What it cannot see: waits inside torch's own C++ (none among the ops the runtime's CUDA
path uses: sort, cumsum, scatter, index_put with integer indices, searchsorted, aminmax)
and `torch.cuda.synchronize`, which the runtime does not call.
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
"""Tensor methods that hand a device value to the host."""
SIZED_BY_VALUES = {"nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"}
"""Ops whose result size the host learns from the device."""


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostWaits(TorchFunctionMode):
    """`with HostWaits() as w: ...`; then `w.waits` lists (what, where) per wait, where is
    the innermost frame of embark_runtime (or of the caller when none)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        why = None
        if name in READS or name in SIZED_BY_VALUES:
            why = name
        elif name in ("__getitem__", "__setitem__", "index_put", "index_put_") and len(args) > 1:
            if _bool_index(args[1]):
                why = f"{name} with a boolean mask"
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) or len(args) == 1:
                why = "repeat_interleave without output_size"
        elif name == "where" and len(args) == 1 and not kwargs:
            why = "where(condition)"
        if why is not None:
            self.waits.append((why, _where()))
        return func(*args, **kwargs)


def _where() -> str:
    frames = traceback.extract_stack()[:-2]
    mine = [f for f in frames if "embark_runtime" in f.filename or "/runtime/" in f.filename]
    f = (mine or frames)[-1]
    return f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}"
