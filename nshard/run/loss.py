"""Response-token loss and its normalization contract.

The objective of one update is  sum over the global batch of (weight x NLL)  /  global target weight.
Each microbatch contributes its own weighted NLL sum divided by the *global* weight, so the gradient
does not depend on how documents are split into microbatches or ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_nll_sum(logits: torch.Tensor, input_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum of weights[t] * -log p(input_ids[t] | input_ids[:t]) over a padded microbatch (fp32 maths)."""
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:]
    nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
    return (nll * weights[:, 1:].reshape(-1).to(nll.dtype)).sum()


def deepspeed_backward_scale(world_size: int) -> float:
    """Factor applied to a microbatch's (local sum / global weight) before engine.backward.

    DeepSpeed averages gradients over ranks (sum, then divide by world size) and, with
    scale_wrt_gas=True, divides the loss by the accumulation steps. nshard calls
    engine.backward(..., scale_wrt_gas=False), so only the rank average needs undoing: multiplying
    by world_size makes the reduced gradient exactly  sum(weight x NLL) / global weight.
    The nshard reducers average over ranks the same way, so the same factor holds for them.
    """
    return float(world_size)


def pad_microbatch(prepared: list, pad_id: int, zero_weight: bool = False):
    """Right-pad documents into (input_ids, attention_mask, weights) tensors; padding weighs 0.

    zero_weight=True builds the filler microbatch a rank runs when it has no document left at
    this accumulation step: it keeps collectives and hooks in step while contributing nothing.
    """
    width = max(len(p.input_ids) for p in prepared)
    ids = torch.full((len(prepared), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prepared), width), dtype=torch.long)
    weights = torch.zeros((len(prepared), width), dtype=torch.float32)
    for row, p in enumerate(prepared):
        n = len(p.input_ids)
        ids[row, :n] = torch.tensor(p.input_ids)
        mask[row, :n] = 1
        if not zero_weight:
            weights[row, :n] = torch.tensor(p.weights, dtype=torch.float32)
    return ids, mask, weights
