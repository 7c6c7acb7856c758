"""A growth study's frozen training budget (plan [growth], docs/growth.md#the-budget): training FLOPs, counted as
6 x the parameters one token passes through x the tokens an update trains (each document's tokens, padding not
counted; attention's sequence-length term and the router left out, alike for every arm).

The parameters one token passes through: all of a dense model's; for a sparse model with top-k routers, all but
the (E - k) / E share of the expert weights it does not reach. Every arm trains the most whole updates of the
plan's schedule (the same data order: a shorter arm trains a prefix) whose FLOPs stay within the budget; the study
writes each arm's count into its plan before either arm runs, and the trainer refuses a schedule that exceeds it.
"""

from __future__ import annotations

from nshard.run.data import batch_schedule
from nshard.run.plan import PlanError

FLOPS_PER_PARAMETER_TOKEN = 6
"""Forward (2) and backward (4) multiply-adds per parameter per token."""
HOW = (f"{FLOPS_PER_PARAMETER_TOKEN} x active parameters per token x document tokens trained (padding not counted; "
       "attention's sequence term and the router left out, alike for every arm)")
"""The count, as records and reports state it."""


class BudgetError(PlanError):
    """A schedule that does not fit the plan's declared budget; the message names the numbers and the fix."""


def active_parameters(model) -> int:
    """Parameters one token passes through: every parameter, less the experts a top-k router does not send it to,
    and less the routers themselves (HOW: left out, as attention's sequence term is), so that a top-1 model costs
    exactly its dense source per token."""
    total = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    experts, top_k = getattr(config, "num_local_experts", None), getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return total
    expert = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total - expert + expert * top_k // experts - router_parameters(model)


def router_parameters(model) -> int:
    """The top-k routers' weights of a sparse (Mixtral) model: each sparse block's `gate` (in a checkpoint,
    block_sparse_moe.gate), not a dense MLP's gate_proj."""
    return sum(p.numel() for name, p in model.named_parameters() if name.endswith(".gate.weight"))


def model_active_parameters(model_dir) -> int:
    """active_parameters of a transformers directory, counted on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return active_parameters(model)


def update_tokens(lengths: list[int], schedule: list[list[int]]) -> list[int]:
    """Tokens each update trains: the lengths of its documents."""
    return [sum(lengths[i] for i in batch) for batch in schedule]


def flops(active: int, tokens: list[int]) -> int:
    return FLOPS_PER_PARAMETER_TOKEN * active * sum(tokens)


def updates_within(budget: float, active: int, lengths: list[int], n_docs: int, global_batch: int, seed: int,
                   ceiling: int = 100_000) -> int:
    """The most whole updates of the plan's schedule (batch_schedule: its prefix is the same for any length) whose
    FLOPs at `active` parameters per token stay within `budget`."""
    spent, count, horizon = 0, 0, 64
    while True:
        schedule = batch_schedule(n_docs, horizon, global_batch, seed)
        for batch in schedule[count:]:
            cost = FLOPS_PER_PARAMETER_TOKEN * active * sum(lengths[i] for i in batch)
            if spent + cost > budget:
                return count
            spent, count = spent + cost, count + 1
        if horizon >= ceiling:
            raise BudgetError(f"growth.train_flops={budget:.4g} buys more than {ceiling} updates; lower it")
        horizon *= 2


def check_schedule(budget: float, active: int, tokens: list[int]) -> dict:
    """The trainer's check of its own schedule against the budget (BudgetError if it spends more); the record."""
    spent = flops(active, tokens)
    if spent > budget:
        raise BudgetError(f"growth: train.updates={len(tokens)} spends {spent:.4g} training FLOPs at {active} active "
                          f"parameters per token, over the plan's budget of {budget:.4g} (growth.train_flops); run the "
                          "arm through python -m nshard.study, which sets each arm's updates from the budget, or "
                          "lower train.updates")
    return {"kind": "train_flops", "budget": budget, "spent": spent, "active_parameters_per_token": active,
            "tokens": sum(tokens), "updates": len(tokens), "how": HOW}
