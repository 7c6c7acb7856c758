"""Where each second of an update goes: one per-process PhaseClock that the training loop starts before an update and
stops after it, and that the code of the update marks with `with phase("optimizer_step"):` (or the `timed` decorator).

The phases (PHASES) do not overlap: a phase entered inside another takes its own time out of the enclosing one (each
frame is charged only the time when it is the innermost), so a collective inside the reducer is collective_wait, not
reducer_compute, and the all-reduce inside DeepSpeed's backward is not forward_backward. `rest` is the update's time
that no phase claims, so the phases of an update sum to its time. A detail (DETAIL) is a named part of one phase:
its time is counted in that phase too, and reported apart.

On CUDA every phase boundary a running clock crosses first waits for the device (`sync`, set once from the device), so
the kernels a phase queued are charged to it. The reducer's detail (EVENT_DETAIL: P/Q products, orthogonalization,
error update, entered once per matrix) is timed there by CUDA events instead, with no wait: each detail boundary
records an event on the current stream, and stop(), after the loop's closing synchronization, charges the device
time between consecutive events to the detail open between them. A detail's seconds stay inside its phase's
synchronized time (they are not taken out of it and added back). On the CPU a boundary costs one perf_counter call
and a few list operations. NSHARD_PHASE_SYNC=0 drops the waits and the events on CUDA, to measure what they cost
(launch/gpu_check.py): the update's time stays exact (the loop synchronizes once at its end) but each phase is then
only the host's time in it. When the clock is not running (benchmarks, unit tests, anything outside train()) a
boundary is a flag test. One process, one clock: DeepSpeed's hooks may run in autograd's device thread, but only
while the training thread waits for that backward, so frames never interleave.
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Callable

PHASES = ("forward_backward", "reducer_compute", "collective_wait", "optimizer_step", "parameter_sync")
"""The named phases, in the order metrics.jsonl and the receipts list them; then REST."""
REST = "rest"
DETAIL = {"powersgd_pq": "reducer_compute", "orthogonalize": "reducer_compute", "error_update": "reducer_compute",
          "parameter_collectives": "collective_wait"}
"""Detail -> the phase it is part of. parameter_collectives is never entered by name: a collective_wait entered while
parameter_sync is open is counted as it (the all-gather or delta exchange of the weights)."""
EVENT_DETAIL = ("powersgd_pq", "orthogonalize", "error_update")
"""The detail timed by CUDA events on a synchronized CUDA clock: entered once per matrix, hundreds of times an update,
where a wait at each would drain the device's queue each time."""
WHAT = {
    "forward_backward": "each microbatch's forward, loss and backward (the ingest seam's gradient sums included)",
    "reducer_compute": "the reducer's own compute: nshard's (flattening, PowerSGD's P/Q products, orthogonalization, "
                       "error update, hand-over to DeepSpeed) or DeepSpeed's own reduction epilogue "
                       "(engine.allreduce_gradients)",
    "collective_wait": "inside collectives: deepspeed.comm's gradient collectives, the reducer's transport, the rings "
                       "and delta exchange of the parameters",
    "optimizer_step": "engine.step(): gradient norm, clipping, AdamW, scheduler (bf16 at stage 0 also the rounding of "
                      "nshard's flat fp32 gradients to the bf16 values the step takes, and their zeroing after it)",
    "parameter_sync": "the parameters' all-gather or delta sync that ends a partitioned step, less its collectives",
    REST: "the update's time no phase claims (building microbatches, the closing synchronization)"}


SYNC_VARIABLE = "NSHARD_PHASE_SYNC"


def sync_wanted() -> bool:
    """NSHARD_PHASE_SYNC: 1 (default) synchronizes a CUDA device at every phase boundary, 0 does not."""
    value = os.environ.get(SYNC_VARIABLE, "1")
    if value not in ("1", "0"):
        raise ValueError(f"{SYNC_VARIABLE}={value!r}: set it to 1 (phases wait for the device) or 0 (they do not: "
                         f"the host's time only), or unset it for 1")
    return value == "1"


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
        self.on_cuda = False
        self.event: Callable[[], object] | None = None
        """Makes a timing event (torch.cuda.Event(enable_timing=True)) when EVENT_DETAIL is timed by events."""
        self._events: list = []  # reused from update to update
        self._marks: list = []  # [(event, the detail open after it or None)], in order
        self._detail_stack: list[list] = []  # [detail, re-entries], or [None, 0] for a host frame; innermost last
        self.running = False
        self.totals: dict[str, float] = {}
        self.microbatch_s: list[float] = []
        self._stack: list[list] = []  # [name, since, re-entries] per open phase, innermost last
        self._parameter_sync_open = 0
        self._frames: dict[str, _Frame] = {}

    def use_device(self, device) -> None:
        """Wait for the device at every boundary where it runs asynchronously (CUDA), unless NSHARD_PHASE_SYNC=0;
        nothing extra elsewhere."""
        import torch

        self.on_cuda = str(device).startswith("cuda")
        synchronized = self.on_cuda and sync_wanted()
        self.sync = torch.cuda.synchronize if synchronized else None
        self.event = (lambda: torch.cuda.Event(enable_timing=True)) if synchronized else None

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
        self._marks, self._detail_stack = [], []
        self.running = True

    def stop(self, update_s: float) -> dict:
        """End the update whose time was `update_s`: {"phases": PHASES and REST (summing to update_s), "detail":
        DETAIL's seconds, "microbatch_s": each microbatch's forward_backward}."""
        self.running = False
        self._stack = []
        phases = {name: self.totals.get(name, 0.0) for name in PHASES}
        detail = {name: self.totals.get(name, 0.0) for name in DETAIL}
        for name, parent in DETAIL.items():
            phases[parent] += detail[name]  # what the host timed; event-timed detail never left its phase
        marks, self._marks, self._detail_stack = self._marks, [], []
        for (event, name), (after, _) in zip(marks, marks[1:]):
            if name is not None:  # the device's milliseconds between the two events (the loop has synchronized)
                detail[name] += event.elapsed_time(after) / 1000
        phases[REST] = update_s - math.fsum(phases.values())
        return {"phases": phases, "detail": detail, "microbatch_s": self.microbatch_s}

    def _mark(self, name: str | None) -> None:
        """Record an event now on the device's stream; the time until the next one is `name`'s (None: nobody's)."""
        count = len(self._marks)
        if count == len(self._events):
            self._events.append(self.event())
        event = self._events[count]
        event.record()
        self._marks.append((event, name))

    def _target(self) -> str | None:
        """The event-timed detail the device's time now goes to (None: none is innermost)."""
        return self._detail_stack[-1][0] if self._detail_stack else None

    def _enter_events(self, name: str) -> bool:
        """On a clock with events: True when `name` is an event-timed detail and was entered here; else the host
        frame about to open is pushed as a placeholder, which stops the open detail's time until it closes."""
        stack, top = self._detail_stack, self._target()
        # A detail is timed by events only directly inside its own phase (or inside another detail there); elsewhere
        # (inside a collective, outside any phase) it takes the host's path, as on the CPU, so both count it alike.
        if name in EVENT_DETAIL and self._stack and self._stack[-1][0] == DETAIL[name]:
            if top == name:
                stack[-1][1] += 1  # a detail inside itself: one
            else:
                stack.append([name, 0])
                self._mark(name)
            return True
        stack.append([None, 0])
        if top is not None:
            self._mark(None)
        return False

    def _exit_events(self) -> bool:
        """On a clock with events: True when an event-timed detail was closed here; else the placeholder of the
        host frame about to close is popped, and the caller closes the frame."""
        stack = self._detail_stack
        if not stack:
            return False
        top = stack[-1]
        if top[0] is None:
            stack.pop()
            return False
        if top[1]:
            top[1] -= 1
        else:
            stack.pop()
            self._mark(self._target())
        return True

    def _enter(self, name: str) -> None:
        if self.event is not None and self._enter_events(name):
            return
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
        if self.event is None:
            self._exit_host()
        elif not self._exit_events():
            self._exit_host()
            if self._target() is not None:  # back inside the detail the host frame interrupted
                self._mark(self._target())

    def _exit_host(self) -> None:
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
