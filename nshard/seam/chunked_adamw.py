"""torch's AdamW stepped in cache-sized pieces on CPU: the same arithmetic, without full-size temporaries.

torch's single-tensor AdamW (the path it takes for CPU tensors) makes two temporaries the size of each
parameter (sqrt of the second moment, and the denominator) and streams every state tensor through memory
several times. ZeRO-1/2 hand it one flat partition holding half the model, so each step allocates two
partition-sized temporaries (fresh pages from the kernel: glibc maps anything over 32 MiB) and runs out of
cache; on 2 CPU cores that made ZeRO's step slower than stage 0's over twice the elements.

`chunk_steps(optimizer)` makes the optimizer's step hand torch's own functional `adam` the same tensors
cut into pieces of CHUNK_ELEMENTS elements. Every operation of AdamW is elementwise with per-group
scalars, and the pieces start at multiples of the vector width, so each element is computed by the same
instructions as before: the result is bit-identical (tests/test_chunked_adamw.py), the temporaries are a
piece's size, and the working set stays in cache. Missing state is created first by torch's own
_init_group, so the first step goes in pieces too. Anything the plain path does not cover (amsgrad,
capturable, differentiable, fused, foreach forced on, complex or non-CPU tensors, a closure) is left to
torch's own step.
"""

from __future__ import annotations

import functools

import torch
from torch.optim.adam import adam

CHUNK_ELEMENTS = 1 << 18  # 1 MiB of fp32 per piece: two temporaries and four state tensors fit in L2/L3


def chunk_steps(optimizer, chunk: int = CHUNK_ELEMENTS) -> bool:
    """Wrap `optimizer.step` (a torch.optim.AdamW, exactly) to step in pieces; False if it is another optimizer."""
    if type(optimizer) is not torch.optim.AdamW or getattr(optimizer, "_nshard_chunked", False):
        return False
    if chunk <= 0 or chunk % 64:
        raise ValueError(f"chunk must be a positive multiple of 64 elements (the widest vector), got {chunk}")
    original = optimizer.step

    @functools.wraps(original)
    def step(closure=None):
        if closure is None:
            _init_state(optimizer)
        if closure is not None or not _plain(optimizer):
            return original(closure)
        with torch.no_grad():
            for group in optimizer.param_groups:
                _step_group(optimizer, group, chunk)
        return None

    optimizer.step = step
    optimizer._nshard_chunked = True
    return True


def _init_state(optimizer) -> None:
    """Create missing state with torch's own initialization (_init_group, as step() does), so the first step
    runs in pieces too: torch's own first step would make full-size temporaries, which on ZeRO's flat
    partition was the largest transient of the whole run."""
    for group in optimizer.param_groups:
        if any(p.grad is not None and not optimizer.state.get(p) for p in group["params"]):
            optimizer._init_group(group, [], [], [], [], [], [])


def _plain(optimizer) -> bool:
    """True when torch would take its single-tensor path and every parameter with a gradient has state."""
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        return False
    for group in optimizer.param_groups:
        if group["amsgrad"] or group["capturable"] or group["differentiable"] or group["fused"] or group["foreach"]:
            return False
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p)
            if (not state or "step" not in state or p.device.type != "cpu" or p.is_complex() or p.grad.is_sparse
                    or not (p.is_contiguous() and p.grad.is_contiguous())):
                return False
    return True


def _pieces(tensor: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    flat = tensor.view(-1)
    return [flat[i : i + chunk] for i in range(0, flat.numel(), chunk)] if flat.numel() > chunk else [tensor]


def _step_group(optimizer, group: dict, chunk: int) -> None:
    params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
    for p in group["params"]:
        if p.grad is None:
            continue
        state = optimizer.state[p]
        pieces = _pieces(p, chunk)
        params += pieces
        grads += _pieces(p.grad, chunk)
        exp_avgs += _pieces(state["exp_avg"], chunk)
        exp_avg_sqs += _pieces(state["exp_avg_sq"], chunk)
        # adam() adds 1 to each piece's step: the first piece holds the parameter's own counter.
        steps += [state["step"]] + [state["step"].clone() for _ in pieces[1:]]
    if not params:
        return
    beta1, beta2 = group["betas"]
    adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, has_complex=False, beta1=beta1,
         beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
         maximize=group["maximize"], foreach=group["foreach"], capturable=False, differentiable=False,
         fused=group["fused"], grad_scale=None, found_inf=None, decoupled_weight_decay=group["decoupled_weight_decay"])
