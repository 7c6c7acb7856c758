"""Plain gradient averaging: one flat all-reduce over the concatenation of all gradients in sorted-name order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from nshard.comm.agree import agree_on_shapes
from nshard.comm.layout import check_same_shapes
from nshard.comm.ledger import ByteLedger
from nshard.comm.transport import AsyncTransport, Transport
from nshard.phases import timed


def all_reduce_mean_(tensors: Sequence[torch.Tensor], transport: Transport) -> int:
    """Average `tensors` over ranks in place through one flat buffer; return the bytes sent.

    PowerSGD's warm-up and its dense 1-D remainder call this same function, which is what makes
    warm-up updates bit-identical to the dense reducer.
    """
    if not tensors:
        return 0
    flat = torch.cat([t.reshape(-1) for t in tensors])
    sent = transport.all_reduce_sum_(flat)
    flat.div_(transport.world_size)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return sent


@dataclass
class InFlight:
    """One bucket's all-reduce, started and not yet waited for: `averaged` then `summed` tensors, flattened."""

    flat: torch.Tensor
    handle: Any
    averaged: list[torch.Tensor]
    summed: list[torch.Tensor]
    averaged_bytes: int
    summed_bytes: int


def start_sum_(averaged: Sequence[torch.Tensor], summed: Sequence[torch.Tensor], transport: AsyncTransport) -> InFlight:
    """Start one flat all-reduce of `averaged` (to be divided by the world size, as all_reduce_mean_ does) and
    `summed` (kept a sum) tensors; land() waits and writes the results back into them."""
    tensors = [*averaged, *summed]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    handle, sent = transport.start_all_reduce_sum_(flat)
    averaged_numel = sum(t.numel() for t in averaged)
    averaged_bytes = averaged_numel * flat.element_size()
    return InFlight(flat, handle, list(averaged), list(summed), averaged_bytes, sent - averaged_bytes)


def land(flight: InFlight, transport: AsyncTransport) -> tuple[int, int]:
    """Wait for a started bucket and write its results back: each element is the same sum as in the one flat
    all_reduce_mean_ (on two ranks the same two addends, so the same bits), the averaged part divided the same
    way. Returns the (averaged, summed) bytes sent."""
    transport.wait(flight.handle)
    averaged_numel = sum(t.numel() for t in flight.averaged)
    flight.flat[:averaged_numel].div_(transport.world_size)
    offset = 0
    for t in [*flight.averaged, *flight.summed]:
        t.copy_(flight.flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return flight.averaged_bytes, flight.summed_bytes


def sorted_grads(named_grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sorted by name: every rank must issue the same collectives over the same concatenation."""
    for name, grad in named_grads.items():
        if not isinstance(grad, torch.Tensor):
            # A rank that skips a parameter would desynchronise every later collective: refuse loudly.
            raise ValueError(f"gradient of parameter {name!r} is {grad!r}; pass a tensor (zeros if unused)")
    return {name: named_grads[name] for name in sorted(named_grads)}


class ShapeRegistry:
    """Parameter names and shapes a reducer was registered with, learned on first use or via register()."""

    def __init__(self):
        self.shapes: dict[str, torch.Size] | None = None

    def register(self, named_shapes: Mapping[str, Sequence[int]], source: str = "register()") -> bool:
        """Learn the shapes (True) or check them against the learned ones (False)."""
        if self.shapes is None:
            self.shapes = {name: torch.Size(named_shapes[name]) for name in sorted(named_shapes)}
            return True
        check_same_shapes(self.shapes, named_shapes, source)
        return False


class DenseBuckets:
    """One dense update reduced bucket by bucket (nshard/comm/overlap.py): each bucket's all-reduce starts
    as its gradients are final, and finish() waits for them all."""

    def __init__(self, reducer: "DenseReducer"):
        self.reducer = reducer
        self.flights: list[InFlight] = []
        self.names: list[str] = []

    @timed("reducer_compute")
    def launch(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Start averaging one bucket's final gradients (every rank launches the same buckets in the same order)."""
        self.names += list(grads)
        self.flights.append(start_sum_(list(grads.values()), [], self.reducer.transport))

    @timed("reducer_compute")
    def finish(self, named_grads: Mapping[str, torch.Tensor]) -> None:
        """Wait for every bucket; `named_grads` (all of the update's, each in one launched bucket) are averaged."""
        reducer = self.reducer
        grads = sorted_grads(named_grads)
        reducer.register({n: g.shape for n, g in grads.items()}, "bucketed gradients")
        check_buckets_cover(self.names, grads)
        sent = sum(land(flight, reducer.transport)[0] for flight in self.flights)
        reducer.ledger.record(reducer.updates, False, dense=sent)
        reducer.updates += 1

    def abandon(self) -> None:
        """The update's backward failed: wait for the buckets started, write nothing back, record nothing."""
        abandon(self.flights, self.reducer.transport)


def abandon(flights: Sequence[InFlight], transport: AsyncTransport) -> None:
    """Wait for every started bucket, so that no all-reduce is left in flight when an update fails."""
    for flight in flights:
        transport.wait(flight.handle)


def check_buckets_cover(launched: Sequence[str], grads: Mapping[str, torch.Tensor]) -> None:
    """Each gradient in exactly one launched bucket (a bucketing fault would leave one unreduced or reduce it twice)."""
    if sorted(launched) != sorted(grads):
        twice = sorted({n for n in launched if launched.count(n) > 1})
        missing = sorted(set(grads) - set(launched))
        raise RuntimeError(f"an update's buckets launched {twice} twice and {missing} never; every gradient "
                           "must be in exactly one bucket")


class DenseReducer:
    """Exact averaging, the reference every compressed reducer is tested against. With `skip_one_rank`, on a world of
    one rank reduce() leaves the gradients as they are (the average of one gradient is itself: flattening, summing
    with nothing, dividing by 1 and copying back change no bit) and records the update as sending nothing."""

    def __init__(self, transport: Transport, skip_one_rank: bool = False):
        self.transport = transport
        self.skips = skip_one_rank and transport.world_size == 1
        self.registry = ShapeRegistry()
        self.ledger = ByteLedger()
        self.updates = 0

    def register(self, named_shapes: Mapping[str, Sequence[int]], source: str = "register()") -> None:
        """The first call checks that every rank holds the same parameter set (a collective)."""
        if self.registry.shapes is None:
            agree_on_shapes(named_shapes, self.transport)
        self.registry.register(named_shapes, source)

    def deliver_as(self, dtypes: Mapping[str, torch.dtype]) -> None:
        """Nothing to do: dense averaging keeps no error memory, and the rounding to the delivered dtype
        is the same as after DeepSpeed's own all-reduce."""

    def error_sums(self, device: torch.device) -> dict[str, torch.Tensor]:
        """No error memory to sum gradients into (see PowerSGDReducer.error_sums)."""
        return {}

    def reduce_summed(self, dense_grads: Mapping[str, torch.Tensor]):
        """Never called: error_sums() is empty, so every gradient goes through reduce()."""
        raise ValueError("reduce_summed() needs gradients summed into error_sums(); the dense reducer has none: "
                         "call reduce()")

    def start_buckets(self, device: torch.device) -> DenseBuckets:
        """An update whose gradients arrive bucket by bucket (nshard/comm/overlap.py); the same averages as reduce()."""
        return DenseBuckets(self)

    @timed("reducer_compute")
    def reduce(self, named_grads: Mapping[str, torch.Tensor]) -> None:
        grads = sorted_grads(named_grads)
        self.register({n: g.shape for n, g in grads.items()}, "reduce() gradients")
        sent = 0 if self.skips else all_reduce_mean_(list(grads.values()), self.transport)
        self.ledger.record(self.updates, False, dense=sent)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        shapes = self.registry.shapes or {}
        return {
            "updates": self.updates,
            "shapes": {name: tuple(s) for name, s in shapes.items()},
            "ledger": self.ledger.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["shapes"]:  # a state saved before any reduce carries no shapes to check
            self.register(state["shapes"], "state_dict")
        self.updates = int(state["updates"])
        self.ledger.load_state_dict(state["ledger"])
