"""What every rank must agree on: the error that stops a run, gathering from all ranks, rank-0-only work."""

from __future__ import annotations

import datetime

import torch.distributed as dist


class RunError(RuntimeError):
    """A run that must stop; the message says why and what to do."""


def all_ranks(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


LONG_WAIT = datetime.timedelta(hours=12)
"""How long the other ranks wait for rank 0's long work (replay generation): hours for a big model on a CPU."""
_long_wait_group = None


def on_main_rank_long(run, fn, *args, **kwargs):
    """on_main_rank for work that can outlast the process group's timeout (DeepSpeed's is 30 minutes): the
    other ranks wait for it in a broadcast on a gloo group of their own whose timeout is LONG_WAIT."""
    global _long_wait_group
    if _long_wait_group is None:  # every rank gets here in the same order, as new_group requires
        _long_wait_group = dist.new_group(backend="gloo", timeout=LONG_WAIT)
    return on_main_rank(run, fn, *args, _wait_group=_long_wait_group, **kwargs)


def on_main_rank(run, fn, *args, _wait_group=None, **kwargs):
    """Run fn on rank 0 (run.is_main) only; an error there becomes a RunError on every rank, so nobody
    waits at a barrier."""
    result, error = None, None
    if run.is_main:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    message = [error]
    dist.broadcast_object_list(message, src=0, group=_wait_group)
    if message[0] is not None:
        raise RunError(f"on rank 0: {message[0]}")
    return result
