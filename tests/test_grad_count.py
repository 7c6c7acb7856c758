"""DeepSpeed's own gradient collectives counted by nshard (patches.GRAD_COUNT): the receipts' source for DeepSpeed's
gradient bytes where its comms logger is off, as it is on a GPU unless a ds_config asks for it. Two real gloo ranks:
the count equals the tensors' bytes, skips nshard's own logged collectives, and agrees with DeepSpeed's logger."""

from __future__ import annotations

import pytest

from spawn import run_ranks


def _collectives(rank: int, world: int, logger_on: bool):
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch

    from nshard.seam import patches

    import os

    from nshard.seam.launch_env import extensions_dir

    # With these set DeepSpeed skips its MPI discovery and takes the process group the spawn helper made; its CPU
    # collective comes from where set-up compiled it.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1", TORCH_EXTENSIONS_DIR=extensions_dir())
    deepspeed.init_distributed(dist_backend="gloo")
    logger = ds_comm.comms_logger  # what the engine's config does with a ds_config's comms_logger block
    logger.enabled, logger.prof_all, logger.verbose, logger.debug, logger.prof_ops = logger_on, True, False, False, []
    patches.install_grad_count()
    patches.install_grad_count()  # idempotent: counted once
    counter = patches.CollectiveCounter()
    counter.take()
    before = dict(patches.GRAD_COUNT)
    ds_comm.all_reduce(torch.ones(1000))                                      # 4,000 bytes
    ds_comm.all_reduce(torch.ones(300, dtype=torch.bfloat16))                 # 600
    ds_comm.reduce_scatter_tensor(torch.empty(500), torch.ones(500 * world))  # its input: 4,000
    ds_comm.all_reduce(torch.ones(64), log_name=patches.REDUCER_LOG_NAME)     # nshard's own: not DeepSpeed's
    taken = counter.take()
    return {"calls": patches.GRAD_COUNT["calls"] - before["calls"],
            "bytes": patches.GRAD_COUNT["bytes_sent"] - before["bytes_sent"],
            "deepspeed_grad_bytes": taken["deepspeed_grad_bytes"], "other_bytes": taken["other_bytes"],
            "logged": patches.comms_logged()}


@pytest.mark.slow  # two spawned processes importing DeepSpeed
@pytest.mark.parametrize("logger_on", [False, True])
def test_deepspeed_gradient_bytes_are_counted_with_the_logger_off_and_agree_with_it_on(logger_on):
    for result in run_ranks(_collectives, 2, (logger_on,), timeout_s=180):
        assert result["logged"] is logger_on
        assert result["calls"] == 3 and result["bytes"] == 4000 + 600 + 4 * 500 * 2, result
        # The receipts' figure: the logger's where it runs, nshard's count where it does not; the same either way.
        assert result["deepspeed_grad_bytes"] == result["bytes"], result
        assert result["other_bytes"] == 0, result  # gradient bytes are not taken from the parameters' count
