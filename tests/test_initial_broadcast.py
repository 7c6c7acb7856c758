"""DeepSpeed's engine broadcasts every parameter from rank 0 when it starts; nshard asks first and broadcasts only to
ranks whose parameters differ (nshard/seam/patches.py agree_before_broadcast). Two real gloo ranks build real
engines: ranks holding the same weights skip the broadcast, a rank holding other weights still gets rank 0's, and
NSHARD_INITIAL_BROADCAST=deepspeed keeps DeepSpeed's broadcast."""

import os

import torch

from spawn import run_ranks


def start(rank: int, world: int, cases: list) -> list:
    """For each case, an engine built from a tiny Llama (rank 1's first weight moved when `differ`): what the start
    did about rank 0's parameters, and the parameter root of the weights before and after it."""
    from nshard.run.receipts import parameter_root
    from nshard.seam import engine as engine_mod
    from nshard.seam import patches
    from nshard.seam.launch_env import extensions_dir, pin_ninja
    from test_bf16_step import tiny_llama

    out = []
    for differ, env in cases:
        saved = {k: os.environ.get(k) for k in ("NSHARD_INITIAL_BROADCAST",)}
        os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="1", TORCH_EXTENSIONS_DIR=extensions_dir(), **env)
        pin_ninja()
        try:
            model = tiny_llama()
            if differ and rank == 1:
                with torch.no_grad():
                    next(model.parameters()).add_(1.0)
            before = parameter_root(model.named_parameters())
            patches.INITIAL_BROADCAST.clear()
            config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                      "zero_optimization": {"stage": 0}}
            engine = engine_mod.build_engine(model, config)
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        out.append((dict(patches.INITIAL_BROADCAST), before, parameter_root(engine.module.named_parameters())))
    return out


def test_ranks_that_hold_rank_zeros_weights_skip_deepspeeds_broadcast_and_a_rank_that_does_not_gets_them():
    cases = [(False, {}), (True, {}), (False, {"NSHARD_INITIAL_BROADCAST": "deepspeed"})]
    zero, one = run_ranks(start, 2, args=(cases,), timeout_s=600)
    (same0, same1), (differ0, differ1), (forced0, forced1) = zip(zero, one)
    # The same weights: no broadcast, and nothing changed.
    assert same0[0] == same1[0] and same0[0]["ran"] is False and len(same0[0]["sha256"]) == 64
    assert same0[1] == same1[1] == same0[2] == same1[2]
    # Rank 1 held other weights: both ranks see it, the broadcast runs, and rank 1 ends with rank 0's.
    assert differ1[1] != differ0[1] and differ0[0]["ran"] is True and differ1[0]["ran"] is True
    assert differ0[2] == differ1[2] == differ0[1]
    # The reference switch: DeepSpeed's own broadcast, same result.
    assert forced0[0] == forced1[0] == {"ran": True, "why": "DeepSpeed's own"} and forced0[2] == forced1[2]
