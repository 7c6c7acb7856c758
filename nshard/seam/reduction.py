"""Where one update's gradients are reduced: DeepSpeed's own all-reduce, or an nshard reducer in its place.

Each seam runs a microbatch's forward and backward and the optimizer step; nshard/seam/engine.py picks
the seam and prepares DeepSpeed for it (the private attributes live there, not here).
"""

from __future__ import annotations

import functools

import torch


class DeepSpeedReduction:
    """DeepSpeed's own gradient all-reduce; its bytes come from DeepSpeed's comms logger."""

    name = "deepspeed"
    sums = "deepspeed"  # where an update's microbatch gradients are summed

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

    sums = ".grad"

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
    reducer averages the sums and hands them to DeepSpeed: under ZeRO-1/2 `partition_writer`
    (engine.py's ZeroPartitionWriter) copies each parameter's owned slice into ZeRO's gradient
    partition; bf16 at stage 0 takes a backward through HandOver nodes, whose gradient is exactly the
    reduced sum, into DeepSpeed's hooks, whose own reduction engine.py has replaced by a no-op.
    engine.step() updates. DeepSpeed runs with gradient_accumulation_steps=1: it sees one
    micro-step per update.

    Where the sums live:
    - An update with one microbatch per rank, under PowerSGD with device error memory: each
      compressed matrix's gradient is added straight into its error memory (M = error + grad, the
      same single addition the reducer would make), and its averaged output is computed as it is
      handed to DeepSpeed, one matrix at a time. Beyond ZeRO's own buffers this path holds only the
      error memory, P/Q and fp32 sums of the small dense remainder.
      With nshard.microbatch_sums = "error" updates with several microbatches do the same, adding
      each into the error memory as it arrives: (e + g1) + g2, which rounds unlike stage 0's e + (g1 + g2).
    - Otherwise (several microbatches, dense reducer, host error memory): one fp32 sum per parameter,
      kept apart from the error memory so that M = error + (g1 + g2 + ...) rounds exactly as at stage 0.
    `sums` names where the last update's sums were.
    """

    def __init__(self, engine, reducer, name: str, partition_writer=None, sum_every_microbatch_into_error: bool = False):
        super().__init__(engine, reducer, name)
        self.partition_writer = partition_writer
        self.sum_every_microbatch_into_error = sum_every_microbatch_into_error
        if engine.gradient_accumulation_steps() != 1:
            raise RuntimeError("nshard's ingest seam needs DeepSpeed gradient_accumulation_steps=1 "
                               "(complete_ds_config sets it); got "
                               f"{engine.gradient_accumulation_steps()}")
        self.device = next(iter(self.params.values())).device
        self.accumulated: dict[str, torch.Tensor] = {}  # fp32 sums, made when first needed
        self.into_error: dict[str, torch.Tensor] = {}  # this update's matrices summed into the error memory
        self.first = True  # the next microbatch starts an update
        self.sums = "fp32 sums"

    def forward(self, engine, **inputs):
        # The module is called directly: the engine's forward hooks its outputs so that any
        # backward through them (torch.autograd.grad included) runs ZeRO's reduction epilogue.
        return engine.module(**inputs)

    def _sum(self, name: str) -> torch.Tensor:
        if name in self.into_error:
            return self.into_error[name]
        if name not in self.accumulated:
            self.accumulated[name] = torch.zeros(self.params[name].shape, dtype=torch.float32, device=self.device)
        return self.accumulated[name]

    def backward_and_step(self, engine, loss, last: bool) -> None:
        if self.first:  # `last` on the first microbatch: the update has exactly one
            into_error = last or self.sum_every_microbatch_into_error
            self.into_error = self.reducer.error_sums(self.device) if into_error else {}
            self.sums = "error memory" if self.into_error else "fp32 sums"
        self.first = last
        handles = [p.register_hook(_adder(self._sum(n))) for n, p in self.params.items()]
        try:
            torch.autograd.grad(loss, list(self.params.values()), allow_unused=True)
        finally:
            for handle in handles:
                handle.remove()
        if not last:
            return
        update = None
        if self.into_error:
            update = self.reducer.reduce_summed({n: self._sum(n) for n in self.params if n not in self.into_error})
            sources = {n: functools.partial(update.output, n) if n in self.into_error else self._sum(n)
                       for n in self.params}
        else:
            sources = {n: self._sum(n) for n in self.params}
            self.reducer.reduce(sources)
        if self.partition_writer is not None:  # ZeRO-1/2: straight into the owned partition
            writer = self.partition_writer
            writer.begin()
            for n, p in self.params.items():
                writer.write(p, sources[n]() if callable(sources[n]) else sources[n])
            writer.finish()
        else:  # bf16 at stage 0: through DeepSpeed's own gradient hooks
            surrogate = sum(HandOver.apply(p, sources[n]) for n, p in self.params.items())
            engine.backward(surrogate, scale_wrt_gas=False)
        if update is not None:
            update.finish()
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
    """A zero whose gradient with respect to `param` is `reduced` (in the parameter's dtype; a callable is
    called in backward, so an output computed on demand exists only while DeepSpeed's hook takes it), computed as
    `grad_output * reduced` exactly as the backward of `(param * reduced).sum()` did, but without
    keeping a parameter-dtype copy of `reduced` in the graph: the copy is made per parameter in
    backward and handed to DeepSpeed's gradient hooks (AccumulateGrad takes it without cloning)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, reduced) -> torch.Tensor:
        ctx.reduced = reduced  # the reduced tensor, or a callable that computes it when asked
        return param.new_zeros(())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        reduced = ctx.reduced() if callable(ctx.reduced) else ctx.reduced
        del ctx.reduced
        param_grad = grad_output * reduced.to(grad_output.dtype)
        return param_grad, None
