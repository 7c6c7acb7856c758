"""PowerSGD's fp32 error-feedback memory, keyed by parameter name, kept with the gradients or in host memory."""

from __future__ import annotations

from typing import Iterable, Mapping

import torch

from nshard.comm.layout import MatrixSlot


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
                self.tensors[slot.name] = torch.zeros(slot.n, slot.m, device=home, pin_memory=pinned)
            elif error.device != home or (pinned and not error.is_pinned()):
                moved = error.to(home, torch.float32)
                self.tensors[slot.name] = moved.pin_memory() if pinned else moved
        for param, slots in stacks.items():
            self._ensure_block(param, slots, home, pinned)

    def _ensure_block(self, param: str, slots: list[MatrixSlot], home: torch.device, pinned: bool) -> None:
        block = self.blocks.get(param)
        if block is not None and block.device == home and (block.is_pinned() or not pinned):
            return
        block = torch.zeros(len(slots), slots[0].n, slots[0].m, device=home, pin_memory=pinned)
        for slot in slots:  # a loaded (or moved) error goes into its place in the block
            if slot.name in self.tensors:
                block[slot.index].copy_(self.tensors[slot.name])
        self.blocks[param] = block
        for slot in slots:
            self.tensors[slot.name] = block[slot.index]

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take fp32 copies of saved (n, m) errors; ensure() moves them home once the device is known."""
        self.tensors = {name: t.detach().to(torch.float32, copy=True) for name, t in tensors.items()}
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
