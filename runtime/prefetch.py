"""Reading off the critical path: a thread that reads the batches of the coming steps.

`Prefetcher(fetch, start, stop, depth)` calls `fetch(step)` for steps `start, start+1,
..., stop-1` in order, in one background thread, into a queue of at most `depth` batches;
the training loop takes them with `get(step)` in the same order and learns how long it
waited. The batch of a step is whatever `fetch(step)` returns, so a prefetching run sees
exactly the batches of a run without it, and a run resumed at step s (a new Prefetcher
from s) sees the batches the interrupted one would have.

Errors: an exception of `fetch(step)` is raised by `get(step)`, in the consumer's thread,
at the step where the synchronous read would have raised it (the thread stops reading
after it). `depth=0` reads synchronously in `get` (no thread): the old critical path.

Shutdown: `close()` (or leaving the `with` block) stops the thread after its current read
and joins it, also when the loop ends early on an error; the thread is a daemon, so an
interpreter that exits without `close()` (SIGTERM's default action ends the process at
once anyway) never waits on it. numpy and pyarrow release the GIL while they parse, so the
thread's reading overlaps the step's compute.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["Prefetcher"]

_T = TypeVar("_T")
_POLL_S = 0.1
"""How often a blocked producer or consumer looks whether the other side went away."""


class Prefetcher(Generic[_T]):
    """The results of `fetch(step)` for steps [start, stop), read ahead by a thread."""

    def __init__(
        self,
        fetch: Callable[[int], _T],
        start: int,
        stop: int,
        depth: int = 2,
        *,
        name: str = "embark-prefetch",
    ):
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._fetch = fetch
        self._next = start
        self._stop_step = stop
        self.depth = depth
        self._queue: queue.Queue[tuple[int, _T | None, BaseException | None]] = queue.Queue(
            maxsize=max(depth, 1)
        )
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0 and start < stop:
            self._thread = threading.Thread(
                target=self._produce, args=(start,), name=name, daemon=True
            )
            self._thread.start()

    def _produce(self, start: int) -> None:
        for step in range(start, self._stop_step):
            if self._closing.is_set():
                return
            item: tuple[int, _T | None, BaseException | None]
            try:
                item = (step, self._fetch(step), None)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                item = (step, None, e)
            while not self._closing.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def get(self, step: int) -> tuple[_T, float]:
        """(the batch of `step`, seconds waited for it); steps are taken in order."""
        if step != self._next or step >= self._stop_step:
            raise ValueError(
                f"step {step} asked for, the prefetcher's next step is {self._next} "
                f"(of [.., {self._stop_step}))"
            )
        self._next += 1
        t0 = time.perf_counter()
        if self._thread is None:
            return self._fetch(step), time.perf_counter() - t0
        while True:
            try:
                got, value, error = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(f"the reader thread stopped before step {step}") from None
        waited = time.perf_counter() - t0
        assert got == step, (got, step)
        if error is not None:
            raise error
        return value, waited  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the thread after its current read and wait for it."""
        self._closing.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        while thread.is_alive():
            try:  # a producer blocked on a full queue sees _closing within _POLL_S
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            thread.join(timeout=_POLL_S)

    def __enter__(self) -> Prefetcher[_T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
