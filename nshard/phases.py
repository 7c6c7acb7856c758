"""Where each second of an update goes: one per-process PhaseClock that the training loop starts before an update and
stops after it, and that the code of the update marks with `with phase("optimizer_step"):` (or the `timed` decorator).

The phases (PHASES) do not overlap: a phase entered inside another takes its own time out of the enclosing one (each
frame is charged only the time when it is the innermost), so a collective inside the reducer is collective_wait, not
reducer_compute, and the all-reduce inside DeepSpeed's backward is not forward_backward. `rest` is the update's time
that no phase claims, so the phases of an update sum to its time. A detail (DETAIL) is a named part of one phase:
its time is counted in that phase too, and reported apart.

On CUDA every boundary a running clock crosses first waits for the device (`sync`, set once from the device), so the
kernels a phase queued are charged to it; on the CPU a boundary costs one perf_counter call and a few list
operations. When the clock is not running (benchmarks, unit tests, anything outside train()) a boundary is a flag
test. One process, one clock: DeepSpeed's hooks may run in autograd's device thread, but only while the training
thread waits for that backward, so frames never interleave.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Callable

PHASES = ("forward_backward", "reducer_compute", "collective_wait", "optimizer_step", "parameter_sync")
"""The named phases, in the order metrics.jsonl and the receipts list them; then REST."""
REST = "rest"
DETAIL = {"powersgd_pq": "reducer_compute", "orthogonalize": "reducer_compute", "error_update": "reducer_compute",
          "parameter_collectives": "collective_wait"}
"""Detail -> the phase it is part of. parameter_collectives is never entered by name: a collective_wait entered while
parameter_sync is open is counted as it (the all-gather or delta exchange of the weights)."""
WHAT = {
    "forward_backward": "each microbatch's forward, loss and backward (the ingest seam's gradient sums included)",
    "reducer_compute": "the reducer's own compute: nshard's (flattening, PowerSGD's P/Q products, orthogonalization, "
                       "error update, hand-over to DeepSpeed) or DeepSpeed's own reduction epilogue "
                       "(engine.allreduce_gradients)",
    "collective_wait": "inside collectives: deepspeed.comm's gradient collectives, the reducer's transport, the rings "
                       "and delta exchange of the parameters",
    "optimizer_step": "engine.step(): gradient norm, clipping, AdamW, scheduler",
    "parameter_sync": "the parameters' all-gather or delta sync that ends a partitioned step, less its collectives",
    REST: "the update's time no phase claims (building microbatches, the closing synchronization)"}


class _Frame:
    """A reusable context manager for one phase name (nesting is kept by the clock's stack, not here)."""

    __slots__ = ("clock", "name")

    def __init__(self, clock: "PhaseClock", name: str):
        self.clock, self.name = clock, name

    def __enter__(self):
        if self.clock.running:
            self.clock._enter(self.name)
        return self

    def __exit__(self, *exc):
        if self.clock.running:
            self.clock._exit()
        return False


class _Microbatch:
    """forward_backward for one microbatch, appending its own seconds (its children's taken out) to the clock's list."""

    __slots__ = ("clock", "before")

    def __init__(self, clock: "PhaseClock"):
        self.clock, self.before = clock, 0.0

    def __enter__(self):
        clock = self.clock
        if clock.running:
            self.before = clock.total("forward_backward")
            clock._enter("forward_backward")
        return self

    def __exit__(self, *exc):
        clock = self.clock
        if clock.running:
            clock._exit()
            clock.microbatch_s.append(clock.total("forward_backward") - self.before)
        return False


class PhaseClock:
    """Exclusive seconds per phase over one update, between start() and stop()."""

    def __init__(self, sync: Callable[[], None] | None = None, now: Callable[[], float] = time.perf_counter):
        self.sync, self.now = sync, now
        self.running = False
        self.totals: dict[str, float] = {}
        self.microbatch_s: list[float] = []
        self._stack: list[list] = []  # [name, since, re-entries] per open phase, innermost last
        self._parameter_sync_open = 0
        self._frames: dict[str, _Frame] = {}

    def use_device(self, device) -> None:
        """Wait for the device at every boundary where it runs asynchronously (CUDA); nothing extra elsewhere."""
        import torch

        self.sync = torch.cuda.synchronize if str(device).startswith("cuda") else None

    def phase(self, name: str) -> _Frame:
        frame = self._frames.get(name)
        if frame is None:
            if name not in PHASES and name not in DETAIL:
                raise ValueError(f"phase {name!r}: use one of {', '.join(PHASES + tuple(DETAIL))}")
            frame = self._frames[name] = _Frame(self, name)
        return frame

    def microbatch(self) -> _Microbatch:
        return _Microbatch(self)

    def total(self, name: str) -> float:
        """Seconds charged to `name` itself so far in this update (its children's excluded)."""
        return self.totals.get(name, 0.0)

    def start(self) -> None:
        self.totals, self.microbatch_s, self._stack, self._parameter_sync_open = {}, [], [], 0
        self.running = True

    def stop(self, update_s: float) -> dict:
        """End the update whose time was `update_s`: {"phases": PHASES and REST (summing to update_s), "detail":
        DETAIL's seconds, "microbatch_s": each microbatch's forward_backward}."""
        self.running = False
        self._stack = []
        phases = {name: self.totals.get(name, 0.0) for name in PHASES}
        detail = {name: self.totals.get(name, 0.0) for name in DETAIL}
        for name, parent in DETAIL.items():
            phases[parent] += detail[name]
        phases[REST] = update_s - math.fsum(phases.values())
        return {"phases": phases, "detail": detail, "microbatch_s": self.microbatch_s}

    def _enter(self, name: str) -> None:
        stack = self._stack
        if name == "collective_wait" and self._parameter_sync_open:
            name = "parameter_collectives"
        if stack and stack[-1][0] == name:
            stack[-1][2] += 1  # the same phase inside itself (a collective wrapping a collective): one frame
            return
        if self.sync is not None:
            self.sync()
        now = self.now()
        if stack:
            top = stack[-1]
            self.totals[top[0]] = self.totals.get(top[0], 0.0) + now - top[1]
        if name == "parameter_sync":
            self._parameter_sync_open += 1
        stack.append([name, now, 0])

    def _exit(self) -> None:
        stack = self._stack
        if not stack:
            return
        frame = stack[-1]
        if frame[2]:
            frame[2] -= 1
            return
        stack.pop()
        if self.sync is not None:
            self.sync()
        now = self.now()
        self.totals[frame[0]] = self.totals.get(frame[0], 0.0) + now - frame[1]
        if frame[0] == "parameter_sync":
            self._parameter_sync_open -= 1
        if stack:
            stack[-1][1] = now


CLOCK = PhaseClock()
"""This process's clock (the training loop starts and stops it)."""


def phase(name: str) -> _Frame:
    """`with phase("collective_wait"):` on this process's clock."""
    return CLOCK.phase(name)


def timed(name: str):
    """Decorator: the function's calls are phase `name`."""
    frame = CLOCK.phase(name)

    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with frame:
                return fn(*args, **kwargs)
        return inner
    return wrap
