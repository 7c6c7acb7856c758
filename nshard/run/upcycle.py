"""Sparse upcycling's tensor rule, torch alone: a Llama state's MLPs copied into every expert of a Mixtral state, with
a seeded router. nshard.grow applies it to an export; nshard/run/models.py to the random 135M, for random:mixtral-4x135m."""

from __future__ import annotations

import torch


def upcycled_state(dense: dict[str, torch.Tensor], n_layers: int, growth, hidden: int) -> dict:
    """Mixtral tensors from Llama tensors: each layer's MLP copied into every expert (gate_up_proj [E, 2I, H] is
    gate then up, as Mixtral chunks it; down_proj [E, H, I]), a seeded N(0, router_std) router (drawn in fp32,
    stored in the source's dtype); the rest as is. `growth`: anything with experts, seed and router_std (nshard.grow.Growth)."""
    state, generator = {}, torch.Generator().manual_seed(growth.seed)
    dtype = next(iter(dense.values())).dtype
    mlp = {f"model.layers.{i}.mlp.{p}_proj.weight" for i in range(n_layers) for p in ("gate", "up", "down")}
    for name, tensor in dense.items():
        if name not in mlp:
            state[name] = tensor.clone()
    for i in range(n_layers):
        prefix = f"model.layers.{i}.mlp."
        gate, up, down = (dense[f"{prefix}{p}_proj.weight"] for p in ("gate", "up", "down"))
        state[f"{prefix}experts.gate_up_proj"] = torch.cat([gate, up]).unsqueeze(0).repeat(growth.experts, 1, 1)
        state[f"{prefix}experts.down_proj"] = down.unsqueeze(0).repeat(growth.experts, 1, 1)
        router = torch.empty(growth.experts, hidden).normal_(0.0, growth.router_std, generator=generator)
        state[f"{prefix}gate.weight"] = router.to(dtype)
    return state
