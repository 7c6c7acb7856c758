"""bf16 at stage 0 steps DeepSpeed's fp32 masters from one flat fp32 gradient buffer (patches.install_flat_master_step),
and a world of one rank reduces nothing (engine.one_rank_skips): both give the bits of the paths they replaced
(NSHARD_BF16_STEP=deepspeed, NSHARD_ONE_RANK_REDUCTION=run), computed in the same test run on real DeepSpeed engines
in gloo processes. The updates include a clipped one, an unclipped one and one with a non-finite gradient, which
both paths skip. Launched runs of the tiny plan, old way and new way: tests/test_reducer_engine.py."""

from __future__ import annotations

import math
import os

import pytest
import torch

from spawn import run_ranks

REFERENCE = {"NSHARD_BF16_STEP": "deepspeed", "NSHARD_ONE_RANK_REDUCTION": "run"}
POWERSGD = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 1, "min_compression_rate": 1,
            "error_feedback": "device", "warm_start": True, "seed": 0, "transport": "torch"}
LOSS_SCALES = (50.0, 1e-3, 1.0, math.inf)
"""Per update: a gradient norm over the clip (scaled down), one under it (x 1 skipped), an ordinary one, then a
non-finite one (the step is skipped; last, as it leaves PowerSGD's error memory non-finite)."""


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def train(rank: int, world: int, section: dict, microbatches: int, env: dict) -> dict:
    """Four updates of a tiny Llama in bf16 at stage 0 through nshard's seam; the masters, moments, bf16 weights, the
    gradient norm DeepSpeed kept for each update and what the seam recorded."""
    from nshard.comm.config import parse_config
    from nshard.seam import engine as engine_mod
    from nshard.seam.launch_env import extensions_dir, pin_ninja

    saved = {k: os.environ.get(k) for k in REFERENCE}
    # as the launcher would; DeepSpeed's CPU collective from this venv's build (setup.sh), not torch's shared cache
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1", TORCH_EXTENSIONS_DIR=extensions_dir(), **env)
    pin_ninja()  # the ninja set-up built it with: another would rebuild it
    try:
        config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                            "torch_adam": True}},
                  "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}
        engine = engine_mod.build_engine(tiny_llama(), config)
        seam = engine_mod.install_reducer(engine, parse_config(section))
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    norms = []
    for update, scale in enumerate(LOSS_SCALES):
        for micro in range(microbatches):
            g = torch.Generator().manual_seed(1000 * update + 10 * micro + rank)
            ids = torch.randint(1, 97, (2, 12), generator=g)
            logits = seam.forward(engine, input_ids=ids).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 97), ids[:, 1:].reshape(-1))
            seam.backward_and_step(engine, loss * scale, last=micro == microbatches - 1)
        norms.append(float(engine.get_global_grad_norm()))
    state = engine_mod.full_optimizer_state(engine)
    return {"weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()}, "state": state,
            "norms": norms, "skipped_steps": engine.skipped_steps, "one_rank_skip": seam.one_rank_skip,
            "master_step": engine_mod.optimizer_record(engine, config)["master_step"],
            "overlap": getattr(seam, "overlap", None) is not None,
            "bytes": [sum(r["bytes"].values()) for r in seam.ledger.records]}


def both_ways(rank: int, world: int, cases: list) -> list:
    return [(train(rank, world, section, microbatches, {}), train(rank, world, section, microbatches, REFERENCE))
            for section, microbatches in cases]


def assert_same_bits(new: dict, old: dict) -> None:
    assert new["norms"] == old["norms"] and new["skipped_steps"] == old["skipped_steps"] == 1
    assert new["weights"].keys() == old["weights"].keys()
    for name in new["weights"]:
        assert torch.equal(new["weights"][name], old["weights"][name]), name
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(new["state"][name][key], old["state"][name][key]), (name, key)


def test_one_rank_dense_skips_the_reduction_and_steps_flat_with_the_same_bits():
    """The one-rank control (ds_configs/cpu-dense.json's reducer, bf16): no reduction, the flat step, the same
    masters, moments and bf16 weights as the reduction with itself and DeepSpeed's per-parameter step."""
    ((new, old),) = run_ranks(both_ways, 1, args=([({"reducer": "dense"}, 2)],), timeout_s=600)[0]
    assert (new["one_rank_skip"], old["one_rank_skip"]) == (True, False)
    assert (new["master_step"], old["master_step"]) == ("flat", "per parameter")
    assert new["bytes"] == [0] * len(LOSS_SCALES) and all(b > 0 for b in old["bytes"])
    assert new["norms"][0] > 1.0 > new["norms"][1] and math.isinf(new["norms"][3])  # clipped, not clipped, skipped
    assert_same_bits(new, old)


@pytest.mark.slow
def test_two_ranks_step_flat_with_the_same_bits_on_every_path_into_the_sums():
    """Two ranks: the dense reducer (after backward and during it), PowerSGD with one microbatch (the matrices summed
    into the error memory, their outputs written into the flat buffer as they are computed) and with two."""
    cases = [({"reducer": "dense"}, 2), ({"reducer": "dense", "overlap_backward": True}, 2), (POWERSGD, 1),
             (POWERSGD, 2)]
    by_rank = run_ranks(both_ways, 2, args=(cases,), timeout_s=900)
    for (section, _), *pairs in zip(cases, *by_rank):
        for new, old in pairs:
            assert not new["one_rank_skip"] and new["master_step"] == "flat", section
            assert new["overlap"] == bool(section.get("overlap_backward")), section
            assert new["bytes"] == old["bytes"], section
            assert_same_bits(new, old)
    for (new_0, _), (new_1, _) in zip(*by_rank):  # the replicas agree
        assert all(torch.equal(new_0["weights"][n], new_1["weights"][n]) for n in new_0["weights"])


def test_a_reference_switch_with_an_unknown_value_is_refused(monkeypatch):
    from nshard.seam.engine import reference_switch

    monkeypatch.setenv("NSHARD_BF16_STEP", "flatt")
    with pytest.raises(ValueError, match=r"NSHARD_BF16_STEP='flatt': set it to one of flat, deepspeed"):
        reference_switch("NSHARD_BF16_STEP", ("flat", "deepspeed"))


def test_flat_gradients_align_each_view_and_round_to_the_parameters_dtype():
    from nshard.seam.ingest import FlatGradients

    params = {"a": torch.zeros(3, 5, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.bfloat16),
              "c": torch.zeros(2, dtype=torch.float32)}
    flat = FlatGradients(params)
    assert [v.storage_offset() for v in flat.views.values()] == [0, 16, 32]
    assert all(v.data_ptr() % 64 == 0 for v in flat.views.values()) and flat.flat.numel() == 48
    values = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, (n, p) in
              enumerate(params.items())}
    for n, v in values.items():
        flat.views[n].copy_(v)
    computed = values["b"] * 3
    flat.deliver({"a": flat.views["a"], "b": lambda: computed, "c": flat.views["c"]},
                 {n: p.dtype for n, p in params.items()})
    assert torch.equal(flat.views["a"], values["a"].to(torch.bfloat16).float())
    assert torch.equal(flat.views["b"], computed.to(torch.bfloat16).float())
    assert torch.equal(flat.views["c"], values["c"])  # an fp32 parameter's gradient is kept as it is
    assert not torch.equal(flat.views["a"], values["a"])  # the rounding is not idle
    flat.zero_()
    assert not flat.flat.any()
