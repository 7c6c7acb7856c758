"""The pooled-memory ingest path for ZeRO-1/2 and bf16, in one place: the ingest seam (each gradient summed
as autograd makes it), the partition writer (the reduced gradient straight into ZeRO's partition), and where
the reducer's summed update (comm/powersgd.py SummedUpdate, behind Reducer.reduce_summed) is consumed.
The optimizer step that follows runs nshard/seam/chunked_adamw.py and ends with nshard/seam/param_gather.py's
in-place all-gather, both installed by nshard/seam/engine.py and nshard/seam/patches.py.
"""

from __future__ import annotations

import functools

import torch

from nshard.comm.overlap import BackwardOverlap
from nshard.phases import phase
from nshard.seam import patches
from nshard.seam.reduction import ReducerSeam


class IngestSeam(ReducerSeam):
    """ZeRO-1/2 and bf16: hand DeepSpeed a gradient that is already reduced.

    ZeRO-2 reduces at every micro-step (compressing partial sums is not the study's algorithm) and
    bf16 optimizers copy .grad into fp32 buffers of their own during backward, so .grad after
    backward is not what the optimizer reads. Instead each microbatch's backward runs through
    torch.autograd.grad (no DeepSpeed hook fires) with a hook on every parameter that adds its
    gradient to an fp32 sum the moment autograd produces it and hands autograd back a zero-stride
    zero, so one parameter's gradient exists at a time, not all of them (issue 9 item 2). The
    reducer averages the sums and hands them to DeepSpeed: under ZeRO-1/2 `partition_writer`
    (ZeroPartitionWriter, below) copies each parameter's owned slice into ZeRO's gradient
    partition; bf16 at stage 0 (`flat`, a FlatGradients) sums straight into the fp32 gradients that
    DeepSpeed's FP16_UnfusedOptimizer (bf16 mode) steps its fp32 masters from, one flat buffer, rounded there to
    the bf16 values that optimizer would have received (patches.install_flat_master_step). With
    NSHARD_BF16_STEP=deepspeed (the reference path it replaced bit for bit) the sums go instead through a backward
    of HandOver nodes, whose gradient is exactly the reduced sum, into DeepSpeed's hooks and its own
    per-parameter step. DeepSpeed's backward all-reduce is switched off (patches.silence_deepspeed_reduction).
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
    - With `overlap` (nshard.overlap_backward) always fp32 sums, reduced bucket by bucket during the last
      backward (nshard/comm/overlap.py): the same bits as either path above.
    `sums` names where the last update's sums were.
    """

    def __init__(self, engine, reducer, name: str, partition_writer=None, sum_every_microbatch_into_error: bool = False,
                 overlap: bool = False, flat: "FlatGradients | None" = None, one_rank_skip: bool = False):
        super().__init__(engine, reducer, name, one_rank_skip)
        # nshard.overlap_backward: the sums are reduced bucket by bucket during the last backward
        # (nshard/comm/overlap.py); they are always fp32 sums then, 0 + g being g exactly, so the bits are those
        # of the error-memory path too.
        self.overlap = BackwardOverlap(reducer, self.params) if overlap else None
        self.partition_writer = partition_writer
        self.sum_every_microbatch_into_error = sum_every_microbatch_into_error
        if engine.gradient_accumulation_steps() != 1:
            raise RuntimeError("nshard's ingest seam needs DeepSpeed gradient_accumulation_steps=1 "
                               "(complete_ds_config sets it); got "
                               f"{engine.gradient_accumulation_steps()}")
        self.device = next(iter(self.params.values())).device
        self.flat = flat
        # fp32 sums, made when first needed; with `flat`, its views, which the optimizer steps from
        self.accumulated: dict[str, torch.Tensor] = dict(flat.views) if flat is not None else {}
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

    def microbatch_sums(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 sum as the next update fills it (launch/bench_bf16_step.py fills them itself)."""
        return {n: self._sum(n) for n in self.params}

    def backward_and_step(self, engine, loss, last: bool) -> None:
        if self.first:  # `last` on the first microbatch: the update has exactly one
            into_error = (last or self.sum_every_microbatch_into_error) and self.overlap is None
            self.into_error = self.reducer.error_sums(self.device) if into_error else {}
            self.sums = "error memory" if self.into_error else "fp32 sums"
        self.first = last
        overlap = self.overlap if last else None
        if overlap is not None:
            overlap.begin(self._sum)
        handles = [p.register_hook(_adder(self._sum(n), functools.partial(overlap.final, n) if overlap else None))
                   for n, p in self.params.items()]
        backward = functools.partial(torch.autograd.grad, loss, list(self.params.values()), allow_unused=True)
        try:
            if overlap is not None:
                overlap.backward(backward)  # a failed backward waits for the buckets it started, then raises
            else:
                backward()
        finally:
            for handle in handles:
                handle.remove()
        if last:
            self.finish_update(engine)

    def finish_update(self, engine) -> None:
        """After the update's last backward: reduce the sums, hand them to DeepSpeed, step, zero the sums."""
        update = None
        if self.overlap is not None:
            self.overlap.end()  # the sums, reduced in place
            sources = {n: self._sum(n) for n in self.params}
        elif self.into_error:
            update = self.reducer.reduce_summed({n: self._sum(n) for n in self.params if n not in self.into_error})
            sources = {n: functools.partial(update.output, n) if n in self.into_error else self._sum(n)
                       for n in self.params}
        else:
            sources = {n: self._sum(n) for n in self.params}
            self.reducer.reduce(sources)
        if self.flat is not None:
            # bf16 at stage 0: the sums are the masters' fp32 gradients. Rounding them to the bf16 values the optimizer
            # takes and zeroing them after its step are the optimizer's gradient handling (DeepSpeed's own step made
            # its fp32 copies and dropped them), not reduction work: optimizer_step, with no reducer as with one
            # (a summed update's outputs, computed as they are written, stay reducer_compute).
            with phase("optimizer_step"):
                self.flat.deliver(sources, {n: p.dtype for n, p in self.params.items()})
                if update is not None:
                    update.finish()
                engine.step()
                self.flat.zero_()
            return
        with phase("reducer_compute"):  # the hand-over (a summed update's outputs computed as they are taken)
            if self.partition_writer is not None:  # ZeRO-1/2: straight into the owned partition
                writer = self.partition_writer
                writer.begin()
                for n, p in self.params.items():
                    writer.write(p, sources[n]() if callable(sources[n]) else sources[n])
                writer.finish()
            else:  # bf16 at stage 0, NSHARD_BF16_STEP=deepspeed: through DeepSpeed's own gradient hooks
                surrogate = sum(HandOver.apply(p, sources[n]) for n, p in self.params.items())
                engine.backward(surrogate, scale_wrt_gas=False)
            if update is not None:
                update.finish()
        with phase("optimizer_step"):
            engine.step()
        with phase("reducer_compute"):
            for acc in self.accumulated.values():
                acc.zero_()


def _adder(acc: torch.Tensor, final=None):
    """A parameter hook: add the gradient to its fp32 sum (as `acc.add_(g)` on autograd.grad's result did)
    and give autograd a zero-stride zero to return instead, so the gradient itself is freed at once. `final()`,
    if given, is then told that the sum is complete (the last backward under nshard.overlap_backward)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        acc.add_(grad)
        if final is not None:
            final()
        return torch.zeros((), dtype=grad.dtype, device=grad.device).expand(grad.shape)
    return hook


class FlatGradients:
    """One flat fp32 buffer holding a gradient per parameter (`views`, by name, in the order given), each view starting
    on a 64-byte boundary: the ingest seam's sums at bf16 stage 0, and the gradients DeepSpeed's fp32 masters step
    from (patches.install_flat_master_step), so the reduced sum is written once per update and nothing is copied
    into a gradient of its own."""

    ALIGN = 16  # fp32 elements: 64 bytes, a cache line and the widest vector

    def __init__(self, params: dict[str, torch.Tensor]):
        offsets, total = {}, 0
        for name, p in params.items():
            offsets[name] = total
            total += -(-p.numel() // self.ALIGN) * self.ALIGN
        device = next(iter(params.values())).device
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.views = {name: self.flat.narrow(0, offsets[name], p.numel()).view(p.shape) for name, p in params.items()}

    def deliver(self, sources: dict, dtypes: dict[str, torch.dtype]) -> None:
        """Each view := its source (a tensor, the view itself, or a callable that computes it) rounded to the dtype
        its parameter receives gradients in, as a gradient handed to DeepSpeed in that dtype was."""
        for name, view in self.views.items():
            source = sources[name]() if callable(sources[name]) else sources[name]
            if source is view:
                if dtypes[name] == torch.float32:
                    continue
                for piece in view.view(-1).split(ROUND_PIECE):  # in place, a cache-sized piece at a time
                    piece.copy_(piece.to(dtypes[name]))
            else:
                view.copy_(source.to(dtypes[name]))

    def zero_(self) -> None:
        self.flat.zero_()


ROUND_PIECE = 1 << 16
"""Elements rounded at a time (FlatGradients.deliver): the bf16 copy of a piece stays in cache."""


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


class ZeroPartitionWriter:
    """Hands ZeRO-1/2 an already-reduced gradient by writing each parameter's owned slice straight into the
    flat gradient partition its step() reads (averaged_gradients[i], ZeRO's own compact partition buffer:
    what its reduction epilogue builds when it accumulates in fp32), so DeepSpeed's backward, its per-parameter
    hooks, its reduce bucket (4 bytes per parameter) and its copies into the partition are not needed.

    The values are what DeepSpeed's path delivered (the gradient rounded to the parameter's dtype, then held in
    the partition's dtype), at the offsets ZeRO computed at construction, so the step is unchanged bit for bit.
    ZeRO's attributes are read through nshard/seam/patches.py.
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.slices = patches.zero_owned_slices(optimizer)  # id(param) -> (group, source, destination, count)
        self.buffers, self.flats = None, None

    def begin(self) -> None:
        """Fresh zeroed partitions (ZeRO's step releases them, so they do not outlive the update)."""
        self.buffers, self.flats = patches.fresh_zero_partitions(self.optimizer)

    def write(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Copy the part of `grad` (param's full reduced gradient) that this rank owns; nothing if none."""
        where = self.slices.get(id(param))
        if where is None:
            return
        group, source, destination, count = where
        owned = grad.reshape(-1).narrow(0, source, count).to(param.dtype)
        self.flats[group].narrow(0, destination, count).copy_(owned)

    def finish(self) -> None:
        patches.hand_zero_partitions(self.optimizer, self.buffers)
        self.buffers, self.flats = None, None
