"""nshard/comm/ring.py: a two-rank ring sends each direction on its own gloo connection, on real gloo ranks."""

import pytest
import torch

from spawn import run_ranks


def _directions(rank, world, lanes):
    """Which (group, sender -> receiver) each send and receive of one ring step used, and what arrived."""
    import os

    import torch.distributed as dist

    os.environ["NSHARD_RING_LANES"] = lanes
    from nshard.comm import ring

    opened = ring.open_second_lane(dist.group.WORLD)
    names = {dist.group.WORLD: "group"}
    if opened:
        names[ring._SECOND_LANE[dist.group.WORLD]] = "lane"
    used = []

    def isend(tensor, peer, group):
        used.append((names[group], rank, peer))
        return dist.isend(tensor, peer, group)

    def irecv(tensor, peer, group):
        used.append((names[group], peer, rank))
        return dist.irecv(tensor, peer, group)

    outgoing, incoming = torch.full((1000,), float(rank)), torch.full((1000,), float("nan"))
    ring.ring_step(outgoing, incoming, dist.group.WORLD, isend, irecv)
    return opened, used, incoming


def test_a_two_rank_ring_step_sends_each_direction_on_its_own_connection():
    results = run_ranks(_directions, world_size=2, args=("two",))
    by_connection = {}
    for rank, (opened, used, incoming) in enumerate(results):
        assert opened
        assert torch.equal(incoming, torch.full((1000,), float(1 - rank)))
        for group, sender, receiver in used:
            by_connection.setdefault(group, set()).add((sender, receiver))
    # Both ranks' records of one connection name the same single direction, and the two directions differ.
    assert by_connection == {"group": {(0, 1)}, "lane": {(1, 0)}}


@pytest.mark.parametrize("world, lanes", [(2, "one"), (3, "two")])
def test_without_a_lane_the_ring_stays_on_the_group(world, lanes):
    """NSHARD_RING_LANES=one (the path the lane replaced) and rings of three (neighbours differ) keep one group."""
    results = run_ranks(_directions, world_size=world, args=(lanes,))
    for rank, (opened, used, incoming) in enumerate(results):
        assert not opened
        assert {g for g, _, _ in used} == {"group"}
        assert torch.equal(incoming, torch.full((1000,), float((rank - 1) % world)))


def _lanes_refused(rank, world):
    import os

    os.environ["NSHARD_RING_LANES"] = "three"
    from nshard.comm import ring

    try:
        ring.open_second_lane()
    except ValueError as exc:
        return str(exc)


def test_a_misspelt_lane_switch_is_refused_naming_it():
    assert all("NSHARD_RING_LANES='three'" in msg for msg in run_ranks(_lanes_refused, world_size=2))
