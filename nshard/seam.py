"""Where one update's gradients are reduced: DeepSpeed's own all-reduce, or an nshard reducer in its place.

Each seam runs a microbatch's forward and backward and the optimizer step; nshard/engine.py picks
the seam and prepares DeepSpeed for it (the private attributes live there, not here).
"""

from __future__ import annotations

import torch


class DeepSpeedReduction:
    """DeepSpeed's own gradient all-reduce; its bytes come from DeepSpeed's comms logger."""

    name = "deepspeed"

    def forward(self, engine, **inputs):
        return engine(**inputs)

    def backward_and_step(self, engine, loss, last: bool) -> None:
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()  # DeepSpeed steps the optimizer only at its accumulation boundary

    def last_update_compressed(self) -> bool:
        return False

    def last_update_bytes(self) -> int:
        return 0

    def state_dict(self) -> dict:
        return {}  # DeepSpeed's own reduction keeps nothing between updates

    def load_state_dict(self, state: dict) -> None:
        pass


class ReducerSeam:
    """Shared by the nshard seams: the reducer, the trained parameters, the ledger's last record."""

    def __init__(self, engine, reducer, name: str):
        self.reducer, self.name = reducer, name
        self.params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
        reducer.register({n: tuple(p.shape) for n, p in self.params.items()})
        # What the optimizer receives: the parameter's dtype (bf16 under bf16, though reduced in fp32).
        reducer.deliver_as({n: p.dtype for n, p in self.params.items()})

    def last_update_compressed(self) -> bool:
        return self.reducer.ledger.records[-1]["compressed"]

    def last_update_bytes(self) -> int:
        return sum(self.reducer.ledger.records[-1]["bytes"].values())

    def state_dict(self) -> dict:
        """The reducer's state (between updates the seams' own buffers hold zeros: nothing else to keep)."""
        return {"reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.reducer.load_state_dict(state["reducer"])


class InPlaceSeam(ReducerSeam):
    """Stage 0, fp32: DeepSpeed's all-reduce is switched off (enable_backward_allreduce), microbatch
    gradients accumulate in .grad through engine.backward, and after the last one the reducer
    averages .grad in place before engine.step()."""

    def forward(self, engine, **inputs):
        return engine(**inputs)

    def backward_and_step(self, engine, loss, last: bool) -> None:
        engine.backward(loss, scale_wrt_gas=False)
        if last:
            for p in self.params.values():
                if p.grad is None:  # every parameter takes part in every update, with a zero gradient if unused
                    p.grad = torch.zeros_like(p)
            self.reducer.reduce({n: p.grad for n, p in self.params.items()})
        engine.step()


class IngestSeam(ReducerSeam):
    """ZeRO-1/2 and bf16: hand DeepSpeed a gradient that is already reduced.

    ZeRO-2 reduces at every micro-step (compressing partial sums is not the study's algorithm) and
    bf16 optimizers copy .grad into fp32 buffers of their own during backward, so .grad after
    backward is not what the optimizer reads. Instead each microbatch's backward runs through
    torch.autograd.grad (no DeepSpeed hook fires) with a hook on every parameter that adds its
    gradient to an fp32 sum the moment autograd produces it and hands autograd back a zero-stride
    zero, so one parameter's gradient exists at a time, not all of them (issue 9 item 2). The
    reducer averages the sums in place; a backward through HandOver nodes, whose gradient is
    exactly the reduced sum, hands them to DeepSpeed, whose own reduction engine.py has replaced by a
    no-op; engine.step() updates. DeepSpeed runs with gradient_accumulation_steps=1: it sees one
    micro-step per update.
    Cost: one fp32 sum per parameter on top of DeepSpeed's buffers. The sums are kept apart from
    PowerSGD's error memory so that M = error + (g1 + g2 + ...) rounds exactly as before.
    """

    def __init__(self, engine, reducer, name: str):
        super().__init__(engine, reducer, name)
        if engine.gradient_accumulation_steps() != 1:
            raise RuntimeError("nshard's ingest seam needs DeepSpeed gradient_accumulation_steps=1 "
                               "(complete_ds_config sets it); got "
                               f"{engine.gradient_accumulation_steps()}")
        self.accumulated = {n: torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                            for n, p in self.params.items()}

    def forward(self, engine, **inputs):
        # The module is called directly: the engine's forward hooks its outputs so that any
        # backward through them (torch.autograd.grad included) runs ZeRO's reduction epilogue.
        return engine.module(**inputs)

    def backward_and_step(self, engine, loss, last: bool) -> None:
        handles = [p.register_hook(_adder(self.accumulated[n])) for n, p in self.params.items()]
        try:
            torch.autograd.grad(loss, list(self.params.values()), allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        if not last:
            return
        self.reducer.reduce(self.accumulated)
        surrogate = sum(HandOver.apply(p, self.accumulated[n]) for n, p in self.params.items())
        engine.backward(surrogate, scale_wrt_gas=False)
        engine.step()
        for acc in self.accumulated.values():
            acc.zero_()


def _adder(acc: torch.Tensor):
    """A parameter hook: add the gradient to its fp32 sum (as `acc.add_(g)` on autograd.grad's result did)
    and give autograd a zero-stride zero to return instead, so the gradient itself is freed at once."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        acc.add_(grad)
        return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
    return hook


class HandOver(torch.autograd.Function):
    """A zero whose gradient with respect to `param` is `reduced` (in the parameter's dtype), computed as
    `grad_output * reduced` exactly as the backward of `(param * reduced).sum()` did, but without
    keeping a parameter-dtype copy of `reduced` in the graph: the copy is made per parameter in
    backward and handed to DeepSpeed's gradient hooks (AccumulateGrad takes it without cloning)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
        ctx.reduced = reduced
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        reduced = ctx.reduced
        del ctx.reduced
        param_grad = grad_output * reduced.to(grad_output.dtype)
        return param_grad, None
