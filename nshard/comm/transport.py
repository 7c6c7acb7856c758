"""Sum-all-reduce over torch.distributed or mpi4py behind one tiny interface, each call reporting its payload bytes."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist

from nshard.phases import timed

# numpy has no bfloat16 and MPI no half type: these are summed in fp32, as DeepSpeed's old MpiBackend did.
_MPI_WIDENED = (torch.bfloat16, torch.float16)


class Transport(Protocol):
    """What a reducer needs from the wire: an in-place sum across ranks, and who is on it."""

    world_size: int
    rank: int

    def all_reduce_sum_(self, tensor: torch.Tensor) -> int:
        """Sum `tensor` in place over all ranks; return the bytes this rank handed to the collective."""
        ...

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's picklable `obj`, by rank (small agreement checks only; not counted as gradient bytes)."""
        ...


class AsyncTransport(Transport, Protocol):
    """A transport that can leave a sum running while the caller computes (nshard.overlap_backward)."""

    def start_all_reduce_sum_(self, tensor: torch.Tensor) -> tuple[Any, int]:
        """Start summing `tensor` in place over all ranks and return at once: (a handle for wait(), the bytes
        this rank hands to the collective). `tensor` must not be touched until wait(handle) returns."""
        ...

    def wait(self, handle: Any) -> None:
        """Block until the collective behind `handle` is done."""
        ...


def payload_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class TorchTransport:
    """torch.distributed on `group` (None: the default group); gloo on CPU, NCCL on GPU.

    `all_reduce` may stand in for torch.distributed.all_reduce with the same signature (the engine
    passes deepspeed.comm.all_reduce, so DeepSpeed's comms logger sees the reducer's traffic too).
    """

    def __init__(self, group: Any = None, all_reduce: Callable | None = None):
        if not dist.is_initialized():
            raise RuntimeError(
                'nshard.transport "torch" needs torch.distributed initialised '
                "(deepspeed.init_distributed() or dist.init_process_group()) before build_reducer"
            )
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._all_reduce = all_reduce or dist.all_reduce

    @timed("collective_wait")
    def all_reduce_sum_(self, tensor: torch.Tensor) -> int:
        self._all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return payload_bytes(tensor)

    @timed("collective_wait")  # the launch only; the wait is timed in wait()
    def start_all_reduce_sum_(self, tensor: torch.Tensor) -> tuple[Any, int]:
        """all_reduce_sum_ with async_op=True: on gloo the sum runs in the process group's own threads (on NCCL
        on its stream), so the caller's backward goes on while the bytes travel."""
        work = self._all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return work, payload_bytes(tensor)

    @timed("collective_wait")
    def wait(self, handle: Any) -> None:
        handle.wait()

    @timed("collective_wait")
    def all_gather_object(self, obj: Any) -> list:
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered


class MpiTransport:
    """mpi4py Allreduce on numpy views of host tensors; `comm` defaults to COMM_WORLD. Blocking only (no
    AsyncTransport), so nshard.overlap_backward is refused with it (nshard/comm/config.py)."""

    def __init__(self, comm: Any = None):
        # Imported here: importing mpi4py.MPI initialises MPI, which must not happen under torchrun.
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.world_size = self.comm.Get_size()
        self.rank = self.comm.Get_rank()

    @timed("collective_wait")  # the copies to and from the host included
    def all_reduce_sum_(self, tensor: torch.Tensor) -> int:
        sent = tensor.detach()
        if sent.device.type != "cpu" or sent.dtype in _MPI_WIDENED or not sent.is_contiguous():
            sent = sent.to("cpu", torch.float32 if sent.dtype in _MPI_WIDENED else sent.dtype).contiguous()
        array = sent.numpy()
        self.comm.Allreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM)
        if sent is not tensor:
            tensor.copy_(sent)
        return array.nbytes

    @timed("collective_wait")
    def all_gather_object(self, obj: Any) -> list:
        return self.comm.allgather(obj)


def build_transport(name: str, group: Any = None, all_reduce: Callable | None = None) -> Transport:
    """The transport named by nshard.transport; for "mpi", `group` may be an mpi4py communicator."""
    if name == "torch":
        return TorchTransport(group, all_reduce)
    if name == "mpi":
        if group is not None and not hasattr(group, "Allreduce"):
            raise ValueError(
                'nshard.transport "mpi" takes no torch process group; pass group=None '
                "(COMM_WORLD) or an mpi4py communicator"
            )
        return MpiTransport(group)
    raise ValueError(f'nshard.transport is {name!r}; set it to "torch" or "mpi"')
