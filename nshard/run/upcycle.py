"""Growth's tensor rules, torch alone (docs/growth.md#upcycling), one per design:
- "mixtral": a Llama state's MLPs copied into every expert of a Mixtral state, with a seeded router (the router's
  one chosen weight is renormalized to 1 at top 1, so it learns from the balancing loss alone);
- "qwen2_moe": the accepted MLP kept as Qwen2-MoE's shared expert, new routed experts with zero down projections,
  a seeded router whose probabilities scale the experts' outputs, so the task loss trains it.
nshard.grow applies them to an export; nshard/run/models.py the Mixtral rule to the random 135M, for
random:mixtral-4x135m. `frozen_names` says which of a grown model's parameters a `freeze` setting keeps."""

from __future__ import annotations

import torch

MLP = ("gate", "up", "down")
FREEZE = ("none", "shared", "accepted")
"""What a qwen2_moe growth keeps fixed in training: nothing; the shared expert (the accepted MLP) and its gate; or
every weight carried from the accepted model (attention, norms, embeddings, the shared expert and its gate), so
that only the routers and the routed experts train."""


def _router(growth, hidden: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """N(0, router_std), drawn in fp32 and stored in the source's dtype (a bf16 engine then holds exactly it)."""
    return torch.empty(growth.experts, hidden).normal_(0.0, growth.router_std, generator=generator).to(dtype)


def _carried(dense: dict[str, torch.Tensor], n_layers: int) -> dict:
    mlp = {f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(n_layers) for p in MLP}
    return {name: tensor.clone() for name, tensor in dense.items() if name not in mlp}


def upcycled_state(dense: dict[str, torch.Tensor], n_layers: int, growth, hidden: int) -> dict:
    """Mixtral tensors from Llama tensors: each layer's MLP copied into every expert (gate_up_proj [E, 2I, H] is
    gate then up, as Mixtral chunks it; down_proj [E, H, I]), a seeded N(0, router_std) router; the rest as is.
    `growth`: anything with experts, seed and router_std (nshard.grow.Growth)."""
    state, generator = _carried(dense, n_layers), torch.Generator().manual_seed(growth.seed)
    for i in range(n_layers):
        prefix = f"model.layers.{i}.mlp."
        gate, up, down = (dense[f"{prefix}{p}_proj.weight"] for p in MLP)
        state[f"{prefix}experts.gate_up_proj"] = torch.cat([gate, up]).unsqueeze(0).repeat(growth.experts, 1, 1)
        state[f"{prefix}experts.down_proj"] = down.unsqueeze(0).repeat(growth.experts, 1, 1)
        state[f"{prefix}gate.weight"] = _router(growth, hidden, generator, gate.dtype)
    return state


def shared_expert_state(dense: dict[str, torch.Tensor], n_layers: int, growth, hidden: int, expert_size: int) -> dict:
    """Qwen2-MoE tensors from Llama tensors, computing what the Llama computes, exactly in any float dtype:
    - the shared expert is the layer's MLP with its down projection doubled, behind a zero sigmoid gate:
      sigmoid(0) = 1/2, and doubling and halving are exact (a power of two), so it gives the MLP's output;
    - each routed expert's gate_up_proj [E, 2 x expert_size, H] takes expert_size of the MLP's gate and up rows
      (expert e rows e x expert_size, ... mod I: copies at expert_size = I, a partition at I / E), and its
      down_proj [E, H, expert_size] is zero, so every routed expert adds exactly 0 until training moves it;
    - a seeded N(0, router_std) router whose top-k probabilities, not renormalized, scale the experts' outputs.
    The rest is as is. The zero down projections take their gradient from the task at the first update; from then
    the router's does too (d loss / d router is the experts' outputs, weighted)."""
    state, generator = _carried(dense, n_layers), torch.Generator().manual_seed(growth.seed)
    for i in range(n_layers):
        prefix = f"model.layers.{i}.mlp."
        gate, up, down = (dense[f"{prefix}{p}_proj.weight"] for p in MLP)
        state[f"{prefix}shared_expert.gate_proj.weight"] = gate.clone()
        state[f"{prefix}shared_expert.up_proj.weight"] = up.clone()
        state[f"{prefix}shared_expert.down_proj.weight"] = down * 2
        state[f"{prefix}shared_expert_gate.weight"] = torch.zeros(1, hidden, dtype=gate.dtype)
        rows = (torch.arange(growth.experts)[:, None] * expert_size + torch.arange(expert_size)) % gate.shape[0]
        state[f"{prefix}experts.gate_up_proj"] = torch.cat([gate[rows], up[rows]], dim=1)
        state[f"{prefix}experts.down_proj"] = torch.zeros(growth.experts, hidden, expert_size, dtype=gate.dtype)
        state[f"{prefix}gate.weight"] = _router(growth, hidden, generator, gate.dtype)
    return state


def frozen_names(names, freeze: str) -> list[str]:
    """The parameters a qwen2_moe growth's `freeze` keeps fixed, of `names` (a model's parameter names)."""
    if freeze not in FREEZE:
        raise ValueError(f"freeze={freeze!r}: use one of {', '.join(FREEZE)}")
    if freeze == "none":
        return []
    if freeze == "shared":
        return [n for n in names if ".mlp.shared_expert." in n or ".mlp.shared_expert_gate." in n]
    return [n for n in names if not (".mlp.experts." in n or n.endswith(".mlp.gate.weight"))]


def freeze(model, setting: str) -> list[str]:
    """requires_grad = False on the parameters `setting` keeps (frozen_names); returns their names. Before the
    engine is built: DeepSpeed and nshard's seams then reduce and step only what trains."""
    names = frozen_names([n for n, _ in model.named_parameters()], setting)
    params = dict(model.named_parameters())
    for name in names:
        params[name].requires_grad_(False)
    return names
