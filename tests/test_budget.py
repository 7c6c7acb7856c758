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
    routers = 2 * 4 * 16  # a 4 x 16 router per layer, left out as the budget states
    assert budget_mod.active_parameters(sparse) == total - 4 * mlp + 2 * mlp - routers
    with torch.device("meta"):  # top-1: exactly the dense model's cost per token
        top1 = MixtralForCausalLM(MixtralConfig(**small, num_local_experts=4, num_experts_per_tok=1))
    assert budget_mod.active_parameters(top1) == budget_mod.active_parameters(dense)


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
