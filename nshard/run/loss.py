"""Response-token loss and its normalization contract.

The objective of one update is  sum over the global batch of (weight x NLL)  /  global target weight.
Each microbatch contributes its own weighted NLL sum divided by the *global* weight, so the gradient
does not depend on how documents are split into microbatches or ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nshard.run.data import deal


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


@dataclass(frozen=True)
class Microbatch:
    """One of a rank's microbatches in one update, ready for forward/backward."""
    docs: list                    # the documents it runs (a filler reruns the rank's first microbatch)
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    weights: torch.Tensor         # response-token weights; all zero in a filler
    filler: bool
    loss_scale: float             # weighted NLL sum x loss_scale is what engine.backward receives
    doc_shares: list[float]       # each document's weight / the global batch's weight (0 in a filler)


def rank_microbatches(prepared: list, batch: list[int], world: int, rank: int, microbatch_docs: int, pad_id: int,
                      reverse_ranks: bool = False) -> list[Microbatch]:
    """This rank's microbatches of one global batch (deal), each scaled by the response weight of the *whole*
    global batch: the contract that makes the gradient independent of the split into ranks and microbatches."""
    global_weight = math.fsum(prepared[i].target_weight for i in batch)
    share = deal(batch, [len(p.input_ids) for p in prepared], world, microbatch_docs, reverse_ranks)[rank]
    scale = deepspeed_backward_scale(world) / global_weight
    out = []
    for micro in share:
        # An empty microbatch (this rank has run out of documents) reruns its first one at zero weight.
        docs = [prepared[i] for i in (micro or share[0])]
        ids, mask, weights = pad_microbatch(docs, pad_id, zero_weight=not micro)
        out.append(Microbatch(docs, ids, mask, weights, not micro, scale,
                              [d.target_weight / global_weight if micro else 0.0 for d in docs]))
    return out
