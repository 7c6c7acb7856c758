"""A growth study's budget (nshard/run/budget.py) and plan rules ([growth]), without a launch; the tiny growth study
itself runs at the end of test_study.py."""

from __future__ import annotations

import pytest

from nshard.run import budget as budget_mod
from nshard.run.data import batch_schedule
from nshard.run.plan import PlanError, plan_from_dict
from nshard.study.growth import arm_plan_text

LENGTHS = [10 + (7 * i) % 23 for i in range(30)]


def spend(active: int, updates: int) -> int:
    return budget_mod.flops(active, budget_mod.update_tokens(LENGTHS, batch_schedule(30, updates, 4, 3)))


def test_each_arm_trains_the_most_whole_updates_its_budget_buys():
    """The budget a dense arm spends in 10 updates buys it exactly 10; a model that costs 1.6x per token fewer, the
    most whose FLOPs stay within it, and one more would exceed it."""
    budget = spend(100, 10)
    assert budget_mod.updates_within(budget, 100, LENGTHS, 30, 4, 3) == 10
    assert budget_mod.updates_within(budget - 1, 100, LENGTHS, 30, 4, 3) == 9
    k = budget_mod.updates_within(budget, 160, LENGTHS, 30, 4, 3)
    assert 5 <= k < 10 and spend(160, k) <= budget < spend(160, k + 1)
    assert budget_mod.updates_within(spend(100, 200), 100, LENGTHS, 30, 4, 3) == 200  # past the first horizon


def test_a_schedule_over_the_budget_is_refused_naming_the_numbers():
    tokens = budget_mod.update_tokens(LENGTHS, batch_schedule(30, 5, 4, 3))
    record = budget_mod.check_schedule(budget_mod.flops(100, tokens), 100, tokens)
    assert record["spent"] == record["budget"] and record["updates"] == 5
    with pytest.raises(budget_mod.BudgetError, match="over the plan's budget"):
        budget_mod.check_schedule(budget_mod.flops(100, tokens) - 1, 100, tokens)


def test_active_parameters_leave_out_the_experts_a_token_does_not_reach():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1)
    with torch.device("meta"):
        dense = LlamaForCausalLM(LlamaConfig(**small))
        sparse = MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=2))
    mlp = 2 * 3 * 16 * 24
    assert budget_mod.active_parameters(dense) == sum(p.numel() for p in dense.parameters())
    total = sum(p.numel() for p in sparse.parameters())
    routers = 2 * 4 * 16  # a 4 x 16 router per layer: every token passes through it, so it is counted
    assert budget_mod.router_parameters(sparse) == routers
    assert budget_mod.active_parameters(sparse) == total - 4 * mlp + 2 * mlp
    with torch.device("meta"):  # top-1: the dense model's cost per token and its routers'
        top1 = MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=1))
    assert budget_mod.active_parameters(top1) == budget_mod.active_parameters(dense) + routers


def test_a_frozen_weight_costs_its_forward_and_the_backward_through_it_not_its_gradient():
    """HOW, on a Qwen2-MoE grown with the shared expert frozen: 6 FLOPs per token per trained parameter a token
    passes through (the routers, the shared expert's gate, top_k of the routed experts), 4 per frozen one (the
    shared expert: its forward and the activations' gradient through it)."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from nshard.run.upcycle import freeze

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, qkv_bias=False, tie_word_embeddings=True)
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**small, num_experts=4, num_experts_per_tok=2,
                                                   moe_intermediate_size=8, shared_expert_intermediate_size=24))
    mlp, routed, routers, gates = 3 * 16 * 24, 3 * 16 * 8, 4 * 16, 16  # per layer
    total = sum(p.numel() for p in model.parameters())
    active = total - 2 * 4 * routed + 2 * 2 * routed
    assert budget_mod.parameter_cost(model) == (active, 0)
    names = freeze(model, "shared")
    assert len(names) == 2 * 4 and budget_mod.parameter_cost(model) == (active, 2 * (mlp + gates))
    assert budget_mod.token_flops(*budget_mod.parameter_cost(model)) == 6 * active - 2 * 2 * (mlp + gates)
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(model.config)
    freeze(model, "accepted")  # only the routers and the routed experts train
    assert budget_mod.parameter_cost(model) == (active, active - 2 * (2 * routed + routers))


def test_a_control_is_never_given_less_than_the_candidate():
    arms = {"dense": {"grown": False, "train_flops": 90}, "grown": {"grown": True, "train_flops": 100}}
    assert budget_mod.controls_short(arms) == ["dense"]
    assert budget_mod.controls_short({**arms, "dense": {"grown": False, "train_flops": 100}}) == []


GROWTH = {"cohort": {"from": "runs/x", "start": "weights"}, "growth": {"budget": "train_flops"},
          "study": {"candidate": "grown", "speed_baseline": "dense",
                    "arms": [{"name": "dense", "ranks": 2}, {"name": "grown", "ranks": 2, "grown": True}]}}


def test_a_growth_plan_names_its_budget_its_grown_candidate_and_a_dense_arm():
    plan = plan_from_dict(GROWTH)
    assert plan.growth.enabled and plan.study.arm("grown").grown
    for edit, message in [
        (lambda r: r["growth"].update(budget="device_seconds"), "use \"train_flops\""),
        (lambda r: r["cohort"].update(start="state"), "start = \"weights\""),
        (lambda r: r["study"].update(candidate="dense"), "exactly one arm sets grown = true"),
        (lambda r: r["study"]["arms"][0].update(grown=True), "exactly one arm sets grown = true"),
        (lambda r: r.pop("growth"), "without a [growth] section"),
        (lambda r: r["growth"].update(top_k=5), "growth.top_k=5: choose 1 <= top_k <= experts"),
        (lambda r: r["growth"].update(train_flops=-1.0), "growth.train_flops=-1.0"),
    ]:
        raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in GROWTH.items()}
        raw["study"] = {**GROWTH["study"], "arms": [dict(a) for a in GROWTH["study"]["arms"]]}
        raw["cohort"], raw["growth"] = dict(GROWTH["cohort"]), dict(GROWTH["growth"])
        edit(raw)
        with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("(", r"\(")):
            plan_from_dict(raw)


def test_an_arms_plan_is_the_studys_with_its_updates_and_the_budget_in_numbers():
    text = "[train]\nupdates = 16\nseed = 0\n\n[growth]\nbudget = \"train_flops\"\n"
    out = arm_plan_text(text, 9, 1.5e15)
    assert "updates = 9\n" in out and "[growth]\ntrain_flops = 1500000000000000.0\n" in out
    again = arm_plan_text(out, 7, 2e15)
    assert again.count("train_flops =") == 1 and "train_flops = 2000000000000000.0" in again
