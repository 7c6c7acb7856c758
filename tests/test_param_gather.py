"""nshard/seam/param_gather.py: the in-place ring all-gather equals torch's all_gather, on real gloo ranks."""

import pytest
import torch

from spawn import run_ranks


def _gather(rank, world, part, dtype, lane):
    import torch.distributed as dist

    from nshard.comm.ring import open_second_lane
    from nshard.seam.param_gather import ring_all_gather_

    assert open_second_lane(dist.group.WORLD) == lane

    flat = torch.full((part * world,), float("nan"), dtype=dtype)
    views = [flat.narrow(0, i * part, part) for i in range(world)]
    torch.manual_seed(100 + rank)
    views[rank].copy_(torch.randn(part).to(dtype))
    sent = ring_all_gather_(views, group=dist.group.WORLD)
    expected = [torch.empty(part, dtype=dtype) for _ in range(world)]
    dist.all_gather(expected, views[rank].clone())
    return flat, torch.cat(expected), sent


@pytest.mark.parametrize("world, dtype, lane", [(2, torch.float32, True), (3, torch.float32, False),
                                               (3, torch.bfloat16, False)])
def test_ring_all_gather_fills_every_partition_in_place_like_all_gather(world, dtype, lane):
    """Two ranks on two connections (nshard/comm/ring.py), three on one group: the same bits as all_gather."""
    part = 1000
    results = run_ranks(_gather, world_size=world, args=(part, dtype, lane))
    for flat, expected, sent in results:
        assert torch.equal(flat, expected)  # bit for bit, and no partition left unfilled (NaN)
        assert sent == (world - 1) * part * flat.element_size()
    assert all(torch.equal(results[0][0], r[0]) for r in results)


def _refuse(rank, world):
    import torch.distributed as dist

    from nshard.seam.param_gather import ring_all_gather_

    try:
        ring_all_gather_([torch.zeros(2)], group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)


def test_ring_all_gather_refuses_a_partition_list_of_the_wrong_length():
    assert all("1 partitions for a group of 2 ranks" in msg for msg in run_ranks(_refuse, world_size=2))
