"""A growth study's frozen training budget (plan [growth], docs/growth.md#the-budget): training FLOPs, counted as
HOW says: per document token trained, 2 FLOPs forward, 2 backward for the activations' gradient and 2 for the
weight's own gradient per parameter the token passes through, the last 2 only where the weight trains.

The parameters one token passes through: all of a dense model's; for a sparse model, every non-expert weight, the
routers (and a shared expert and its gate), and top_k of each layer's E routed experts. A frozen weight still costs
its forward and the backward through it (the activations below it need their gradient), not its own gradient.
Every arm trains the most whole updates of the plan's schedule (the same data order: a shorter arm trains a prefix)
whose FLOPs stay within the budget; the study writes each arm's count into its plan before either arm runs, and the
trainer refuses a schedule that exceeds it.
"""

from __future__ import annotations

import json
from pathlib import Path

from nshard.run.data import batch_schedule
from nshard.run.plan import PlanError

FLOPS_PER_PARAMETER_TOKEN = 6
"""Forward (2), the activations' gradient (2) and the weight's gradient (2) per parameter per token."""
FROZEN_SAVING = 2
"""A frozen weight's own gradient is not computed: its forward and the backward through it are."""
HOW = (f"({FLOPS_PER_PARAMETER_TOKEN} x active - {FROZEN_SAVING} x frozen active parameters per token) x document "
       "tokens trained: each parameter a token passes through (every dense weight, the routers, a shared expert and "
       "its gate, the top_k routed experts it is sent to) costs 2 FLOPs forward, 2 for the activations' gradient "
       "(frozen or not) and 2 for its own gradient (trained weights only); padding not counted, attention's sequence "
       "term left out, alike for every arm")
"""The count, stated once: records, receipts and reports print it."""


class BudgetError(PlanError):
    """A schedule that does not fit the plan's declared budget; the message names the numbers and the fix."""


def sparsity(config) -> tuple[int, int] | None:
    """(E, top_k) of a sparse model's config (Mixtral's num_local_experts, Qwen2-MoE's num_experts), else None."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return (experts, top_k) if experts and top_k else None


def parameter_cost(model, frozen: set[str] | None = None) -> tuple[int, int]:
    """(active, frozen active): the parameters one token passes through (every parameter, the routed experts at
    top_k / E of their weights), and those of them whose weights do not train (`frozen` names them; None: those
    with requires_grad False)."""
    sparse = sparsity(getattr(model, "config", None))
    active = fixed = 0
    for name, p in model.named_parameters():
        n = p.numel() * sparse[1] // sparse[0] if sparse and ".experts." in name else p.numel()
        active += n
        if (name in frozen) if frozen is not None else not p.requires_grad:
            fixed += n
    return active, fixed


def active_parameters(model) -> int:
    """Parameters one token passes through (parameter_cost's first)."""
    return parameter_cost(model, set())[0]


def router_parameters(model) -> int:
    """The top-k routers' weights of a sparse model: each sparse block's `gate` (Mixtral's block_sparse_moe.gate in
    a checkpoint, Qwen2-MoE's mlp.gate), not a dense MLP's gate_proj nor a shared expert's gate."""
    return sum(p.numel() for name, p in model.named_parameters() if name.endswith(".gate.weight"))


def declared_freeze(model_dir) -> str:
    """What a grown export's record says training keeps fixed (nshard-grown.json growth.freeze); "none" otherwise."""
    from nshard.evidence.export import GROWN

    path = Path(model_dir) / GROWN
    return json.loads(path.read_text())["growth"].get("freeze", "none") if path.is_file() else "none"


def model_cost(model_dir) -> tuple[int, int]:
    """parameter_cost of a transformers directory, with its declared freeze, counted on the meta device (no weights
    read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from nshard.run.upcycle import frozen_names

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = [n for n, _ in model.named_parameters()]
    return parameter_cost(model, set(frozen_names(names, declared_freeze(model_dir))))


def update_tokens(lengths: list[int], schedule: list[list[int]]) -> list[int]:
    """Tokens each update trains: the lengths of its documents."""
    return [sum(lengths[i] for i in batch) for batch in schedule]


def token_flops(active: int, frozen: int = 0) -> int:
    """HOW's FLOPs for one trained token."""
    return FLOPS_PER_PARAMETER_TOKEN * active - FROZEN_SAVING * frozen


def flops(active: int, tokens: list[int], frozen: int = 0) -> int:
    return token_flops(active, frozen) * sum(tokens)


def updates_within(budget: float, active: int, lengths: list[int], n_docs: int, global_batch: int, seed: int,
                   ceiling: int = 100_000, frozen: int = 0) -> int:
    """The most whole updates of the plan's schedule (batch_schedule: its prefix is the same for any length) whose
    FLOPs at `active` parameters per token (`frozen` of them not trained) stay within `budget`."""
    spent, count, horizon = 0, 0, 64
    while True:
        schedule = batch_schedule(n_docs, horizon, global_batch, seed)
        for batch in schedule[count:]:
            cost = token_flops(active, frozen) * sum(lengths[i] for i in batch)
            if spent + cost > budget:
                return count
            spent, count = spent + cost, count + 1
        if horizon >= ceiling:
            raise BudgetError(f"growth.train_flops={budget:.4g} buys more than {ceiling} updates; lower it")
        horizon *= 2


def controls_short(arms: dict[str, dict]) -> list[str]:
    """The continued-dense arms ({name: {"grown", "train_flops"}}) that would train fewer FLOPs than a grown arm: a
    control is never given less than the candidate."""
    grown = max((a["train_flops"] for a in arms.values() if a["grown"]), default=0)
    return [name for name, a in arms.items() if not a["grown"] and a["train_flops"] < grown]


def check_schedule(budget: float, active: int, tokens: list[int], frozen: int = 0) -> dict:
    """The trainer's check of its own schedule against the budget (BudgetError if it spends more); the record."""
    spent = flops(active, tokens, frozen)
    if spent > budget:
        raise BudgetError(f"growth: train.updates={len(tokens)} spends {spent:.4g} training FLOPs at {active} active "
                          f"parameters per token, over the plan's budget of {budget:.4g} (growth.train_flops); run the "
                          "arm through python -m nshard.study, which sets each arm's updates from the budget, or "
                          "lower train.updates")
    return {"kind": "train_flops", "budget": budget, "spent": spent, "active_parameters_per_token": active,
            "frozen_active_parameters_per_token": frozen, "flops_per_token": token_flops(active, frozen),
            "tokens": sum(tokens), "updates": len(tokens), "how": HOW}
