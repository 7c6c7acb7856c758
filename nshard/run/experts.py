"""Expert execution receipts for a sparse (Mixtral or Qwen2-MoE) model: each update's router load per layer and expert over
the tokens trained on (all ranks), tokens dropped, dead experts, and one probe routed on every rank, whose routing
must be identical everywhere (a rank that routes otherwise stops the run)."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from nshard.run.ranks import RunError

PROBE_TOKENS = 64
"""The probe is the first prepared document's first tokens: the same on every rank."""
AUX_LOSS = ("Switch-Transformer load balancing per document: E * sum_e f_e * P_e over the document's real tokens "
            "(f_e: share of its top-k slots routed to e; P_e: its mean router probability of e), averaged over layers, "
            "weighted by the document's share of the update's target weight, times the model config's "
            "router_aux_loss_coef; added to the weighted NLL (per document, so it does not depend on how documents "
            "are dealt into microbatches or ranks)")
CAPACITY = ("none: transformers' Mixtral and Qwen2-MoE send every token to its top-k experts, so no token is dropped "
            "(dropped_tokens counts tokens routed to fewer than top_k experts, which must stay 0)")


def routers(model) -> list[torch.nn.Module]:
    """The top-k routers in layer order: modules with a (num_experts, hidden) weight, top_k and num_experts."""
    found = [m for _, m in model.named_modules()
             if hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(getattr(m, "weight", None), torch.Tensor)
             and getattr(m, "weight").ndim == 2 and getattr(m, "weight").shape[0] == m.num_experts]
    return found


class ExpertTap:
    """Forward hooks on every router: the training microbatches' load (real tokens only, by their attention mask)
    and, once per update, the probe's routing."""

    def __init__(self, model, found: list[torch.nn.Module], probe_ids: list[int]):
        self.model = model
        self.coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
        self.aux_sum = 0.0
        self.experts, self.top_k = found[0].num_experts, found[0].top_k
        self.load = torch.zeros(len(found), self.experts, dtype=torch.int64)
        self.dropped = 0
        self.mask: torch.Tensor | None = None
        self.counted: set[int] = set()
        """Router layers whose load this microbatch has counted: under activation checkpointing the backward runs each
        layer's forward again, and its router hook fires again on the same tokens."""
        self.probe = torch.tensor([probe_ids[:PROBE_TOKENS]])
        self.probe_routes: list[torch.Tensor] | None = None
        self.hooks = [router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(found)]

    @classmethod
    def find(cls, model, probe_ids: list[int]) -> "ExpertTap | None":
        found = routers(model)
        return cls(model, found, probe_ids) if found else None

    def declared(self) -> dict:
        return {"layers": len(self.hooks), "experts": self.experts, "top_k": self.top_k, "capacity": CAPACITY,
                "aux_loss": AUX_LOSS if self.coef else "none (router_aux_loss_coef is 0)", "aux_loss_coef": self.coef,
                "probe_tokens": int(self.probe.shape[1])}

    def aux_term(self, router_logits, mask: torch.Tensor, doc_shares: torch.Tensor) -> torch.Tensor:
        """coef * sum_d share_d * balance_d for this microbatch (shares: each document's target weight over the
        update's, 0 for a filler rerun); its value, summed over ranks, is the update's logged aux loss."""
        loss = balance_loss(router_logits, mask, doc_shares, self.experts, self.top_k)
        self.aux_sum += loss.item()
        return self.coef * loss


    def see(self, mask: torch.Tensor) -> None:
        """The attention mask of the microbatch about to go forward (padding is not routed load)."""
        self.mask = mask.reshape(-1).bool()
        self.counted = set()

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            indices = output[2].detach()
            if self.probe_routes is not None:
                self.probe_routes.append(indices.cpu())
                return
            if layer in self.counted:  # recomputed in backward (activation checkpointing): counted in the forward
                return
            self.counted.add(layer)
            real = indices[self.mask.to(indices.device)] if self.mask is not None else indices
            self.dropped += int((real.shape[1] < self.top_k) * real.shape[0])
            self.load[layer] += torch.bincount(real.reshape(-1).cpu(), minlength=self.experts)
        return hook

    def finish_update(self, update: int, rank: int, device) -> dict:
        """This update's load summed over ranks, its dead experts, and the probe's routing checked on every rank."""
        load = self.load.to(device)
        dist.all_reduce(load)  # torch.distributed, not deepspeed.comm: no update's gradient byte count
        load = load.cpu()
        aux = torch.tensor([self.aux_sum], dtype=torch.float64, device=device)
        dist.all_reduce(aux)
        digest = self._probe_digest()
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise RunError(f"update {update}: the ranks route the same probe differently (routing sha256 "
                           f"{[d[:16] for d in digests]}); the replicas' routers diverged, do not use this run")
        body = {"update": update, "load": load.tolist(), "routed_tokens": int(load[0].sum()) // self.top_k,
                "dropped_tokens": self.dropped, "aux_loss": aux.item(),
                "dead": [[layer, e] for layer, e in (load == 0).nonzero().tolist()],
                "probe_routing_sha256": digest, "routing_identical_on_ranks": True}
        self.load.zero_()
        self.dropped, self.aux_sum = 0, 0.0
        return body

    def _probe_digest(self) -> str:
        was_training = self.model.training
        self.probe_routes = []
        try:
            self.model.eval()
            with torch.no_grad():
                self.model(input_ids=self.probe.to(self.model.device), use_cache=False)
            routes = torch.stack(self.probe_routes)  # (layers, tokens, top_k)
        finally:
            self.probe_routes = None
            self.model.train(was_training)
        return hashlib.sha256(routes.to(torch.int64).numpy().tobytes()).hexdigest()


def balance_loss(router_logits, mask: torch.Tensor, doc_shares: torch.Tensor, experts: int, top_k: int) -> torch.Tensor:
    """sum_d share_d * mean over layers of E * sum_e f_de * P_de, over each document's real tokens."""
    b, s = mask.shape
    real = mask.to(torch.float32).unsqueeze(-1)  # (b, s, 1)
    tokens = real.sum(1).clamp(min=1.0)  # (b, 1)
    total = torch.zeros(b, device=mask.device)
    for logits in router_logits:
        probs = logits.float().softmax(-1).view(b, s, experts)
        chosen = torch.nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, experts).sum(-2).float()
        f = (chosen * real).sum(1) / (tokens * top_k)
        p = (probs * real).sum(1) / tokens
        total = total + experts * (f * p).sum(-1)
    return (total / len(router_logits) * doc_shares.to(total.device)).sum()


def summary(updates: list[dict]) -> dict:
    """Over the whole run: dead experts in any update, tokens dropped, and whether every probe agreed."""
    dead = sorted({tuple(d) for u in updates for d in u["dead"]})
    return {"updates": len(updates), "dead_in_any_update": [list(d) for d in dead],
            "dropped_tokens": sum(u["dropped_tokens"] for u in updates),
            "routing_identical_on_ranks": all(u["routing_identical_on_ranks"] for u in updates)}
