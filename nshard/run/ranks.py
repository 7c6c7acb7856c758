"""What every rank must agree on: the error that stops a run, gathering from all ranks, rank-0-only work."""

from __future__ import annotations

import torch.distributed as dist


class RunError(RuntimeError):
    """A run that must stop; the message says why and what to do."""


def all_ranks(obj) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def on_main_rank(run, fn, *args, **kwargs):
    """Run fn on rank 0 (run.is_main) only; an error there becomes a RunError on every rank, so nobody
    waits at a barrier."""
    result, error = None, None
    if run.is_main:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- re-raised on every rank below
            error = f"{type(exc).__name__}: {exc}"
    message = [error]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None:
        raise RunError(f"on rank 0: {message[0]}")
    return result
