"""Activation checkpointing (the ds_config's "activation_checkpointing" section): non-reentrant, so the ingest seam's
torch.autograd.grad works through it; the same gradients as without it, a sparse model's load counted once although
the backward recomputes every router, and one and two ranks still training the same model at stage 0 and ZeRO-2."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from nshard.run.experts import ExpertTap
from nshard.seam.ds_config import CHECKPOINTING_DEFAULTS, DsConfigError, activation_checkpointing, validate_ds_config
from nshard.seam.engine import checkpoint_activations
from runs import REPO, cached_run, final_params, receipts, run_env, tiny_config

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
ON = {"activation_checkpointing": {}}


def tiny_models():
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return {"llama": LlamaForCausalLM(LlamaConfig(**SMALL)),
            "mixtral": MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2,
                                                        router_aux_loss_coef=0.1))}


def forward_backward(model, ids, mask):
    """One microbatch as nshard's ingest seam runs it: forward with use_cache=False (router logits and the aux term
    for a sparse model, the tap's load), then torch.autograd.grad over every parameter. Counts the decoder layers'
    attention forwards, which the backward repeats when checkpointing is on."""
    model.train()
    tap = ExpertTap.find(model, ids[0].tolist())
    calls = []
    hook = model.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    if tap is not None:
        tap.see(mask)
    out = model(input_ids=ids, attention_mask=mask, use_cache=False, **({"output_router_logits": True} if tap else {}))
    targets = torch.nn.functional.log_softmax(out.logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    loss = -(targets * mask).sum()
    if tap is not None:
        loss = loss + tap.aux_term(out.router_logits, mask, torch.tensor([0.25, 0.75]))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    hook.remove()
    return {"grads": dict(zip([n for n, _ in model.named_parameters()], grads)), "attention_forwards": len(calls),
            "load": None if tap is None else tap.load.clone(), "aux": None if tap is None else tap.aux_sum}


def test_checkpointed_gradients_equal_the_plain_ones_for_llama_and_mixtral():
    ids = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # padding is not routed load
    for name, plain in tiny_models().items():
        checkpointed = copy.deepcopy(plain)
        checkpoint_activations(checkpointed)
        a, b = forward_backward(plain, ids, mask), forward_backward(checkpointed, ids, mask)
        assert (a["attention_forwards"], b["attention_forwards"]) == (1, 2), name  # the backward really recomputed
        assert a["grads"].keys() == b["grads"].keys()
        for key in a["grads"]:
            torch.testing.assert_close(b["grads"][key], a["grads"][key], rtol=1e-5, atol=1e-7, msg=f"{name}:{key}")
        assert max(g.abs().max().item() for g in a["grads"].values()) > 0
        if name == "mixtral":  # counted once per microbatch, though every router ran again in the backward
            assert torch.equal(b["load"], a["load"])
            assert b["load"].sum(1).tolist() == [2 * int(mask.sum())] * 2
            assert b["aux"] == a["aux"] > 0


def test_the_section_switches_checkpointing_on_and_refuses_deepspeeds_own_options():
    assert activation_checkpointing({}) is None
    record = activation_checkpointing({"activation_checkpointing": dict(CHECKPOINTING_DEFAULTS)})
    assert record["use_reentrant"] is False and record["kind"].startswith("non-reentrant")
    config = json.loads((REPO / "ds_configs/dense.json").read_text())
    for key, value in [("partition_activations", True), ("cpu_checkpointing", True), ("profile", True),
                       ("contiguous_memory_optimization", True), ("synchronize_checkpoint_boundary", True),
                       ("number_checkpoints", 4)]:
        with pytest.raises(DsConfigError, match=f"activation_checkpointing.{key}=.*deepspeed.checkpointing API.*"
                                                "Remove the key or set it to"):
            validate_ds_config({**config, "activation_checkpointing": {key: value}})
    with pytest.raises(DsConfigError, match=r"activation_checkpointing.enabled: not a DeepSpeed .*leave it out"):
        validate_ds_config({**config, "activation_checkpointing": {"enabled": False}})
    with pytest.raises(DsConfigError, match=r"activation_checkpointing=true: use an object"):
        validate_ds_config({**config, "activation_checkpointing": True})


def test_a_model_without_checkpointing_support_is_refused_by_name():
    with pytest.raises(DsConfigError, match="Linear does not support .*remove the section"):
        checkpoint_activations(torch.nn.Linear(2, 2))


# One and two ranks, with and without checkpointing, at stage 0 and ZeRO-2 under PowerSGD (compressed from update 2:
# P and Q are linear in M, so one rank and two agree within fp32 tolerance), and ZeRO-3 under DeepSpeed's reduction.
POWERSGD = {"reducer": "powersgd", "rank": 2, "dense_warmup_updates": 1, "min_compression_rate": 2,
            "error_feedback": "device", "warm_start": True, "seed": 0, "transport": "torch"}


def assert_close_params(a, b, what):
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        torch.testing.assert_close(pa[key], pb[key], rtol=1e-5, atol=1e-6, msg=f"{what}: {key}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_one_and_two_ranks_agree_with_checkpointing_under_powersgd(runs_root, stage):
    plain = tiny_config(stage=stage, nshard=POWERSGD)
    checkpointed = {**plain, **ON}
    runs = {"two": cached_run(runs_root, f"psgd-z{stage}", plain),  # test_reducer_engine.py's run, when both run
            "ckpt-two": cached_run(runs_root, f"ckpt-psgd-z{stage}", checkpointed),
            "ckpt-one": cached_run(runs_root, f"ckpt-psgd-z{stage}-1r", checkpointed, world=1)}
    assert_close_params(runs["ckpt-two"], runs["ckpt-one"], "two ranks vs one, checkpointed")
    assert_close_params(runs["ckpt-two"], runs["two"], "checkpointed vs not")
    for name, out in runs.items():
        run = json.loads((out / "run.json").read_text())
        record = run["activation_checkpointing"]
        assert (record is None) == (name == "two"), name
        if record:
            assert record["use_reentrant"] is False and record["checkpointed_layers"] == 2
        assert all(r["activation_checkpointing"] == record for r in receipts(out))
        assert receipts(out)[0]["update_compressed"] == [False, True, True]


@pytest.mark.slow
def test_zero3_trains_the_same_model_with_checkpointing(runs_root):
    """DeepSpeed's own reduction at ZeRO-3 gathers each layer's parameters again for the recomputed forward."""
    plain = tiny_config(stage=3)
    two = cached_run(runs_root, "ckpt-off-z3", plain)
    ckpt = cached_run(runs_root, "ckpt-z3", {**plain, **ON})
    assert_close_params(ckpt, two, "ZeRO-3 checkpointed vs not")
    assert json.loads((ckpt / "run.json").read_text())["activation_checkpointing"]["checkpointed_layers"] == 2


@pytest.mark.slow
def test_a_grown_mixtral_counts_its_load_once_and_trains_the_same_with_checkpointing(runs_root, tmp_path_factory):
    from nshard.grow import Growth, grow

    source = cached_run(runs_root, "ds-dense", tiny_config())
    tmp = tmp_path_factory.mktemp("ckpt-grown")
    grow(source, tmp / "grown", Growth(experts=4, top_k=2, seed=1, aux_coef=0.1))
    plan = tmp / "grown.toml"
    plan.write_text((REPO / "launch/plans/tiny.toml").read_text().replace('spec = "tiny"', f'spec = "{tmp / "grown"}"'))
    config = tiny_config(lr=5e-4, stage=2, nshard=POWERSGD)
    plain = cached_run(runs_root, "ckpt-off-grown-z2", config, plan=plan)
    ckpt = cached_run(runs_root, "ckpt-grown-z2", {**config, **ON}, plan=plan)
    assert_close_params(ckpt, plain, "grown, checkpointed vs not")
    metrics = [[json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()] for out in (plain, ckpt)]
    prepared = [json.loads(line) for line in (ckpt / "prepared" / "documents.jsonl").read_text().splitlines()]
    schedule = json.loads((ckpt / "prepared" / "schedule.json").read_text())
    for update, (a, b) in enumerate(zip(*metrics)):
        tokens = sum(len(prepared[i]["input_ids"]) for i in schedule[update])
        assert b["expert_load"] == a["expert_load"] and [sum(layer) for layer in b["expert_load"]] == [2 * tokens] * 2
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the probe's per-rank memory cgroups)")
def test_the_memory_probe_shows_the_peak_falling_with_the_same_weights(tmp_path):
    """launch/memory_probe.py on the embedded model, one rank, two updates of two 2-document microbatches: the
    second update holds the AdamW moments and the gradients beside the activations, so what checkpointing frees
    shows in the process's peak. Both arms train bit for bit the same weights."""
    out = tmp_path / "probe"
    proc = subprocess.run([sys.executable, "-m", "launch.memory_probe", "--model", "embedded", "--arms",
                           "s0-dense-1r,s0-dense-1r-ckpt", "--updates", "2", "--microbatch_docs", "2", "--cap_gib", "6",
                           "--out", str(out), "--timeout_s", "600"], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=1300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [row] = json.loads((out / "embedded" / "checkpointing.json").read_text())
    assert row["arm"] == "s0-dense-1r" and row["same_parameter_root"]
    assert row["peak_rss_bytes_on"] < row["peak_rss_bytes_off"], row
    assert "| s0-dense-1r | " in proc.stdout and "activation checkpointing, embedded" in proc.stdout
