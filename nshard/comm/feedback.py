"""PowerSGD's fp32 error-feedback memory, keyed by parameter name, kept with the gradients or in host memory."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from nshard.comm.layout import MatrixSlot
from nshard.comm.numerics import ERROR_MEMORY_DTYPE


class ErrorMemory:
    """Per-name fp32 (n, m) error matrices; subclasses decide where they live and how M = grad + error is formed.

    Both placements form M and the new error with the same tensor operations on the gradients'
    device, so "device" and "host" give bit-identical outputs and errors.
    """

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.blocks: dict[str, torch.Tensor] = {}
        """A stacked parameter's errors in one (E, n, m) tensor, whose [e] views are its units' `tensors`, so the
        parameter-shaped error that gradients are summed into (PowerSGDReducer.error_sums) is one tensor."""

    def home(self, device: torch.device) -> tuple[torch.device, bool]:
        """(device, pinned) where the memory lives when gradients are on `device`."""
        raise NotImplementedError

    def ensure(self, matrices: Iterable[MatrixSlot], device: torch.device) -> None:
        """Zero-fill missing errors and move loaded ones home, before the first compressed update uses them."""
        home, pinned = self.home(device)
        stacks: dict[str, list[MatrixSlot]] = {}
        for slot in matrices:
            if slot.index is not None:
                stacks.setdefault(slot.param, []).append(slot)
                continue
            error = self.tensors.get(slot.name)
            if error is None:
                self.tensors[slot.name] = torch.zeros(slot.n, slot.m, dtype=ERROR_MEMORY_DTYPE, device=home,
                                                      pin_memory=pinned)
            elif error.device != home or (pinned and not error.is_pinned()):
                moved = error.to(home, ERROR_MEMORY_DTYPE)
                self.tensors[slot.name] = moved.pin_memory() if pinned else moved
        for param, slots in stacks.items():
            self._ensure_block(param, slots, home, pinned)

    def _ensure_block(self, param: str, slots: list[MatrixSlot], home: torch.device, pinned: bool) -> None:
        block = self.blocks.get(param)
        if block is not None and block.device == home and (block.is_pinned() or not pinned):
            return
        block = torch.zeros(len(slots), slots[0].n, slots[0].m, dtype=ERROR_MEMORY_DTYPE, device=home,
                            pin_memory=pinned)
        for slot in slots:  # a loaded (or moved) error goes into its place in the block
            if slot.name in self.tensors:
                block[slot.index].copy_(self.tensors[slot.name])
        self.blocks[param] = block
        for slot in slots:
            self.tensors[slot.name] = block[slot.index]

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take fp32 copies of saved (n, m) errors; ensure() moves them home once the device is known."""
        self.tensors = {name: t.detach().to(ERROR_MEMORY_DTYPE, copy=True) for name, t in tensors.items()}
        self.blocks = {}

    def accumulate(self, name: str, grad_2d: torch.Tensor) -> None:
        """Fold this update's gradient in, once, before compute_p."""

    def matrix(self, name: str, grad_2d: torch.Tensor) -> torch.Tensor:
        """M = error + grad in fp32 on the gradients' device."""
        raise NotImplementedError

    def settle(self, name: str, m: torch.Tensor, delivered_2d: torch.Tensor) -> None:
        """New error = M - what the gradient now holds: the output as the optimizer receives it, rounded to
        bf16 when the gradient is bf16 or the reducer was told (deliver_as) that bf16 parameters take it,
        so that rounding is fed back too."""
        raise NotImplementedError


class DeviceErrorMemory(ErrorMemory):
    """Errors beside the gradients; M is built in place in the error buffer, so no extra copy is held."""

    def home(self, device):
        return device, False

    def accumulate(self, name, grad_2d):
        self.tensors[name].add_(grad_2d)

    def matrix(self, name, grad_2d):
        return self.tensors[name]

    def settle(self, name, m, delivered_2d):
        m.sub_(delivered_2d)


class HostErrorMemory(ErrorMemory):
    """Errors in CPU memory (pinned when gradients are on CUDA), so the device holds no error buffer.

    M is rebuilt from the host copy each time a phase needs it (three transfers per update) so that
    at most one matrix's M is on the device at a time.
    """

    def home(self, device):
        return torch.device("cpu"), device.type == "cuda"

    def matrix(self, name, grad_2d):
        # Out-of-place add: on CPU .to() returns the stored tensor itself, which must not change here.
        return torch.add(self.tensors[name].to(grad_2d.device, non_blocking=True), grad_2d)

    def settle(self, name, m, delivered_2d):
        self.tensors[name].copy_(m.sub_(delivered_2d))


def build_error_memory(place: str) -> ErrorMemory:
    return {"device": DeviceErrorMemory, "host": HostErrorMemory}[place]()


ERROR_RULE = ("every new rank's error = the mean of the saved ranks' errors (summed in fp64, stored in fp32); the "
              "mean over ranks, which the averaging reducer adds to the next update, is conserved: exactly when one "
              "rank saved the state (every new rank gets a copy of its error), else to one rounding of the fp64 "
              "mean to fp32, the error memory's precision (at most half a unit in the last place of each element)")
"""How an elastic resume (nshard/run/elastic.py) carries PowerSGD's error memory from W saved ranks to W' new ones.

Rank r's update sends the compression of M_r = grad_r + e_r, and the reducer averages: what the saved errors still
owe the model is mean_r e_r. Giving every new rank that mean keeps mean_r' e'_r' equal to it, whatever W'."""


def mean_errors(errors_by_rank: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The fp64 mean over ranks of each name's error, one rank's errors at a time (so a caller may load them one by
    one); ValueError when the ranks hold errors for different names or shapes."""
    total: dict[str, torch.Tensor] = {}
    count = 0
    for count, errors in enumerate(errors_by_rank, start=1):
        if count > 1 and sorted(errors) != sorted(total):
            raise ValueError(f"rank {count - 1} holds error memory for {sorted(set(errors) ^ set(total))[:3]} "
                             "where rank 0 does not (or the reverse): the saved states are not of one run")
        for name, e in errors.items():
            wide = e.detach().to("cpu", torch.float64)
            if name in total:
                if total[name].shape != wide.shape:
                    raise ValueError(f"the error memory of {name} has shape {tuple(wide.shape)} on rank {count - 1}, "
                                     f"{tuple(total[name].shape)} on rank 0")
                total[name] += wide
            else:
                total[name] = wide.clone()
    return {name: t / count for name, t in total.items()} if count else {}


def spread_errors(mean: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp32 error every new rank starts from (ERROR_RULE): the fp64 mean, rounded once."""
    return {name: t.to(torch.float32) for name, t in mean.items()}


def conservation_record(before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]) -> dict:
    """The error-feedback total before (the fp64 mean over the saved ranks) and after (the fp64 mean over the new
    ranks of what they hold): their element sums, SHA-256s, the largest difference, and whether they are equal."""
    if sorted(before) != sorted(after):
        raise ValueError(f"the error memory after an elastic resume covers {sorted(after)}, before {sorted(before)}")
    differences = [(after[n].double() - before[n].double()).abs().max().item() for n in before if before[n].numel()]
    return {"rule": ERROR_RULE, "before": total_record(before), "after": total_record(after),
            "max_abs_difference": max(differences, default=0.0), "exact": max(differences, default=0.0) == 0.0}


def total_record(mean: Mapping[str, torch.Tensor]) -> dict:
    """One error-feedback total, as the receipts carry it: its sum over every element and its SHA-256 (fp64, by
    name)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(mean):
        t = mean[name].detach().to("cpu", torch.float64).contiguous()
        h.update(f"{name}:{list(t.shape)}\n".encode())
        h.update(t.reshape(-1).numpy().tobytes())
    return {"sum": float(sum(t.double().sum().item() for t in mean.values())), "sha256": h.hexdigest()}
