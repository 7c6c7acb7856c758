"""One step of a ring of point-to-point sends, with every TCP connection carrying one direction only.

On gloo, torch's isend/irecv between two ranks of one process group share that pair's single TCP connection.
When both directions carry a large buffer at once, that connection often serves them in turn rather than
together. Measured on the two emulated hosts, 100 Mbit/s, one core each (launch/bench_duplex.py), 30 MiB each
way after a few seconds of compute:
- one group: 5.2 s in most repeats (the two directions one after the other), 2.7 s in the others;
- each direction on its own group: 2.7 s every time, the link's rate in both directions at once.
(gloo's own all_reduce reaches the full rate on one group; only the paired isend/irecv is affected.)

In a ring of three or more ranks, a rank's right and left neighbours differ, so every connection already
carries one direction. In a ring of two they are the same rank. So a two-rank group gets a second gloo group
over the same ranks (its second lane): rank 0 sends on the group, rank 1 on the lane. The bytes and where they
land are unchanged; only the connection they travel on differs.

The lane is made by open_second_lane() at engine set-up, never inside a step: new_group is a collective of
the whole world, so it is made only for a group that spans the world, on every rank at the same point.
NSHARD_RING_LANES=one keeps the single group (the path this replaced, for the benchmark's comparison).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from nshard.phases import timed

LANES_VARIABLE = "NSHARD_RING_LANES"
_SECOND_LANE: dict = {}
"""group (None: the default group) -> its second lane, for the two-rank groups open_second_lane() was given."""


def lanes_wanted() -> bool:
    value = os.environ.get(LANES_VARIABLE, "two")
    if value not in ("two", "one"):
        raise ValueError(f"{LANES_VARIABLE}={value!r}: set it to two or one (or unset it for two)")
    return value == "two"


def open_second_lane(group=None) -> bool:
    """Give a two-rank gloo `group` that spans the world its second lane (a collective: call it on every rank,
    in the same order). Returns whether the group has one now. Other groups, other backends and
    NSHARD_RING_LANES=one leave the ring on the group alone."""
    if group in _SECOND_LANE:
        return True
    if not (lanes_wanted() and dist.get_backend(group) == "gloo" and dist.get_world_size(group) == 2
            and dist.get_world_size() == 2):
        return False
    _SECOND_LANE[group] = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD), backend="gloo")
    return True


def lanes_opened() -> int:
    """How many groups of this process send their two-rank rings one direction per connection."""
    return len(_SECOND_LANE)


def neighbours(group=None) -> tuple[int, int]:
    """This rank's right and left neighbours in `group`'s ring, as global ranks."""
    n, me = dist.get_world_size(group=group), dist.get_rank(group=group)
    if group is None:
        return (me + 1) % n, (me - 1) % n
    return dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)


@timed("collective_wait")
def ring_step(outgoing: torch.Tensor, incoming: torch.Tensor, group=None, isend: Callable = dist.isend,
              irecv: Callable = dist.irecv) -> None:
    """Send `outgoing` to this rank's right neighbour in `group` while receiving `incoming` from its left one,
    and wait for both. isend/irecv take (tensor, peer global rank, group)."""
    me = dist.get_rank(group=group)
    right, left = neighbours(group)
    send_on = receive_on = group
    lane = _SECOND_LANE.get(group)
    if lane is not None:  # two ranks: the connection on `group` carries 0 -> 1 only, the lane's 1 -> 0 only
        send_on, receive_on = (group, lane) if me == 0 else (lane, group)
    for request in [isend(outgoing, right, send_on), irecv(incoming, left, receive_on)]:
        request.wait()
