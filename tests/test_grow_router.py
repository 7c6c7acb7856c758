"""The qwen2_moe growth (nshard/run/upcycle.py shared_expert_state): the tiny Llama grown into a Qwen2-MoE computes
the Llama's logits before training, and its router learns from the task loss alone (no balancing loss), where the
Mixtral design's top-1 router gets no gradient beyond rounding. In-process, on the tiny model: the fast tier."""

from __future__ import annotations

import pytest
import torch

from nshard.grow import Growth, upcycle
from nshard.run.models import resolve_model

IDS = torch.tensor([[1, 5, 9, 42, 7, 300, 11, 2], [3, 4, 5, 6, 7, 8, 9, 10]])


@pytest.fixture(scope="module")
def tiny():
    return resolve_model("tiny").path


def routers_and_experts(model) -> tuple[float, float]:
    """The largest router gradient and the largest routed down-projection gradient over the layers."""
    router = max(layer.mlp.gate.weight.grad.abs().max().item() for layer in model.model.layers)
    down = max(layer.mlp.experts.down_proj.grad.abs().max().item() for layer in model.model.layers)
    return router, down


def task_gradients(model) -> tuple[float, float]:
    """One backward of the language-model loss alone (output_router_logits off: no balancing term)."""
    model.train().zero_grad()
    model(input_ids=IDS, labels=IDS).loss.backward()
    return routers_and_experts(model)


@pytest.mark.parametrize("top_k", [1, 2])
def test_the_grown_qwen2_moe_computes_the_source_before_training(tiny, top_k):
    """The shared expert is the MLP (down x2 behind sigmoid(0) = 1/2, both exact), every routed expert adds 0: the
    logits are the Llama's within fp32 tolerance (on the machine that wrote this test they were bit-identical)."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny).eval()
    grown, _ = upcycle(tiny, Growth(experts=4, top_k=top_k, seed=3, architecture="qwen2_moe"))
    assert type(grown).__name__ == "Qwen2MoeForCausalLM" and grown.config.norm_topk_prob is False
    with torch.no_grad():
        want, got = dense(input_ids=IDS).logits, grown(input_ids=IDS).logits
    print(f"top {top_k}: largest logit difference {(got - want).abs().max().item():.3g}")
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert want.abs().max() > 0.1


def test_the_task_loss_trains_the_qwen2_moe_router_and_not_the_mixtral_top1_router(tiny):
    """With the balancing loss at 0: the Qwen2-MoE router's gradient is exactly 0 while every routed expert is 0
    (its outputs are what the router scales), the task gives the zero down projections a gradient, and after one
    optimizer step the router's gradient is of the experts' order. The Mixtral design at top 1, with experts made
    unequal, gets a router gradient at the rounding level only (its one chosen weight is renormalized to 1:
    g/v - g*(1/v)); at top 2 the same measure shows a real gradient, so the comparison can tell them apart."""
    qwen, _ = upcycle(tiny, Growth(experts=4, top_k=1, seed=3, aux_coef=0.0, architecture="qwen2_moe"))
    router, down = task_gradients(qwen)
    assert router == 0.0 and down > 0.0
    torch.optim.AdamW(qwen.parameters(), lr=1e-3).step()
    router, down = task_gradients(qwen)
    print(f"qwen2_moe top 1, after one step: router gradient {router:.3g}, routed down-projection gradient {down:.3g}")
    assert router > 1e-3 * down > 0.0

    relative = {}
    for top_k in (1, 2):
        mixtral, _ = upcycle(tiny, Growth(experts=4, top_k=top_k, seed=3, aux_coef=0.0))
        with torch.no_grad():  # experts trained apart: each a different function
            generator = torch.Generator().manual_seed(1)
            for layer in mixtral.model.layers:
                for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                    p.add_(torch.randn(p.shape, generator=generator) * 0.02)
        router, down = task_gradients(mixtral)
        print(f"mixtral top {top_k}: router gradient {router:.3g}, expert down-projection gradient {down:.3g}")
        relative[top_k] = router / down
    assert relative[1] < 1e-5 and relative[2] > 1e-3


def test_a_freeze_names_the_accepted_weights_it_keeps(tiny):
    from nshard.run.upcycle import freeze, frozen_names

    grown, _ = upcycle(tiny, Growth(experts=4, top_k=1, architecture="qwen2_moe", freeze="shared"))
    names = [n for n, _ in grown.named_parameters()]
    shared = frozen_names(names, "shared")
    assert sorted(shared) == sorted(f"model.layers.{i}.mlp.{p}" for i in range(2) for p in (
        "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
        "shared_expert_gate.weight"))
    accepted = set(frozen_names(names, "accepted"))
    trained = sorted(set(names) - accepted)
    assert trained == sorted(f"model.layers.{i}.mlp.{p}" for i in range(2) for p in (
        "gate.weight", "experts.gate_up_proj", "experts.down_proj"))
    assert "model.embed_tokens.weight" in accepted and frozen_names(names, "none") == []
    assert freeze(grown, "shared") == shared and not any(p.requires_grad for n, p in grown.named_parameters()
                                                          if n in shared)
    with pytest.raises(ValueError, match="freeze='all': use one of none, shared, accepted"):
        frozen_names(names, "all")
