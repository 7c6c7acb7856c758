"""PowerSGD (Vogels et al., 2019) keyed by parameter name: rank-r gradient averaging with fp32 error feedback.

One update: dense 1-D remainder in one flat all-reduce; M = grad + error; P = M Q, summed over ranks
in one all-reduce; P orthonormalized (identical on every rank, since the summed P is); Q = Mᵀ P, averaged
in one all-reduce; output P Qᵀ (already the average) written into the gradient; new error = M - output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from nshard.comm.agree import agree_on_shapes
from nshard.comm.checkpoint import assemble_q, check_header, check_part
from nshard.comm.config import ReducerConfig
from nshard.comm.dense import (InFlight, ShapeRegistry, abandon, all_reduce_mean_, check_buckets_cover, land,
                               sorted_grads, start_sum_)
from nshard.comm.feedback import DeviceErrorMemory, ErrorMemory, build_error_memory
from nshard.comm.layout import (Layout, MatrixSlot, build_layout, check_same_shapes, group_matrices, p_block,
                                 p_group, q_block)
from nshard.comm.ledger import ByteLedger
from nshard.comm.numerics import PinnedMatmuls, pinned
from nshard.comm.orthogonal import orthonormalize_, resolve
from nshard.comm.transport import AsyncTransport, Transport
from nshard.phases import phase, timed

PQ, ERROR_UPDATE = phase("powersgd_pq"), phase("error_update")
"""The sub-phases of reducer_compute (nshard/phases.py) that SummedUpdate.output marks inline."""


@dataclass
class PowerSGDState:
    """Everything PowerSGD keeps between updates, grouped like PyTorch's PowerSGDState."""

    # Hyperparameters.
    rank: int
    dense_warmup_updates: int
    min_compression_rate: float
    warm_start: bool
    orthogonalization: str  # the config's setting ("auto" is resolved per update by the device)
    # Internal state (all of it saved by state_dict).
    generator: torch.Generator
    errors: ErrorMemory
    registry: ShapeRegistry = field(default_factory=ShapeRegistry)
    layout: Layout | None = None
    q_flat: torch.Tensor | None = None
    p_flat: torch.Tensor | None = None  # scratch, reallocated only if the device changes
    updates: int = 0
    # Set by the engine seam, not saved: the dtype the optimizer receives each gradient in.
    delivered_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    matmuls: PinnedMatmuls = field(default_factory=lambda: PinnedMatmuls(False))
    """The precision of every matmul below (nshard.tf32; full fp32 by default, whatever torch's global setting)."""
    # Statistics.
    ledger: ByteLedger = field(default_factory=ByteLedger)
    orthogonal_fallbacks: int = 0  # matrices CholeskyQR2 handed to Householder QR (not saved)
    orthogonalized: int = 0  # matrices orthogonalized by either method (not saved)


def as_matrix(grad: torch.Tensor) -> torch.Tensor:
    return grad.reshape(grad.shape[0], -1)


def unit_grad(grads: Mapping[str, torch.Tensor], slot: MatrixSlot) -> torch.Tensor:
    """The part of its parameter's gradient a unit compresses: the whole gradient, or one expert's [e] view."""
    grad = grads[slot.param]
    return grad if slot.index is None else grad[slot.index]


def draw_q(generator: torch.Generator, numel: int, device: torch.device) -> torch.Tensor:
    """Gaussian Q drawn on CPU from the shared generator: same seed and order give the same Q on every replica."""
    return torch.randn(numel, generator=generator, dtype=torch.float32).to(device)


@timed("powersgd_pq")
@pinned
def compute_p(state: PowerSGDState, grads: Mapping[str, torch.Tensor], slots: Sequence[MatrixSlot] | None = None) -> None:
    """P = M Q for every compressed matrix (or those of `slots`), each written into its block of the flat P buffer."""
    for slot in state.layout.matrices if slots is None else slots:
        m = state.errors.matrix(slot.name, as_matrix(unit_grad(grads, slot)))
        torch.matmul(m, q_block(state.q_flat, slot), out=p_block(state.p_flat, slot))


@timed("orthogonalize")
@pinned
def orthogonalize(state: PowerSGDState) -> None:
    """Orthonormal columns for every summed P, batched per shape group (nshard/comm/orthogonal.py).

    CholeskyQR2 or Householder QR, not Gram-Schmidt: a P that CholeskyQR2 cannot handle (rank-deficient, even
    all-zero) goes to Householder QR, which stays orthonormal there without an epsilon. Both are deterministic
    and the fallback depends on the summed P alone, so ranks holding the same summed P get the same result.
    """
    method = resolve(state.orthogonalization, state.p_flat.device)
    stacks = [p_group(state.p_flat, group) for group in state.layout.groups]
    state.orthogonal_fallbacks += orthonormalize_(stacks, method)
    state.orthogonalized += sum(len(stack) for stack in stacks)


@timed("powersgd_pq")
@pinned
def compute_q(state: PowerSGDState, grads: Mapping[str, torch.Tensor], slots: Sequence[MatrixSlot] | None = None) -> None:
    """Q = Mᵀ P (P orthonormal) for every compressed matrix (or those of `slots`), each written into its block of the
    flat Q buffer."""
    for slot in state.layout.matrices if slots is None else slots:
        m = state.errors.matrix(slot.name, as_matrix(unit_grad(grads, slot)))
        torch.matmul(m.T, p_block(state.p_flat, slot), out=q_block(state.q_flat, slot))


@timed("powersgd_pq")
def decompress(p: torch.Tensor, q: torch.Tensor, grad: torch.Tensor) -> None:
    """Write P Qᵀ into the gradient, straight into its memory when it is contiguous fp32."""
    if grad.dtype == torch.float32 and grad.is_contiguous():
        torch.matmul(p, q.T, out=grad.view(grad.shape[0], -1))
    else:
        grad.copy_(torch.matmul(p, q.T).view(grad.shape))


def round_to_delivered(grad: torch.Tensor, dtype: torch.dtype | None) -> None:
    """Round the output to the dtype the optimizer will receive it in (bf16 parameters fed from an fp32
    buffer), so the error settles against what is applied, not against a value nobody sees."""
    if dtype is not None and dtype != grad.dtype:
        grad.copy_(grad.to(dtype))


@timed("error_update")
def update_error(state: PowerSGDState, slot: MatrixSlot, m: torch.Tensor, grad: torch.Tensor) -> None:
    """Error = M - the output as delivered (in the gradient's dtype, rounded to the delivered dtype)."""
    state.errors.settle(slot.name, m, as_matrix(grad))


@pinned
def decompress_all(state: PowerSGDState, grads: Mapping[str, torch.Tensor],
                   slots: Sequence[MatrixSlot] | None = None) -> None:
    """Output and error for every compressed matrix (or those of `slots`), once its P and averaged Q are in."""
    for slot in state.layout.matrices if slots is None else slots:
        grad = unit_grad(grads, slot)
        m = state.errors.matrix(slot.name, as_matrix(grad))  # before the gradient is overwritten
        decompress(p_block(state.p_flat, slot), q_block(state.q_flat, slot), grad)
        round_to_delivered(grad, state.delivered_dtypes.get(slot.param))
        update_error(state, slot, m, grad)


def keep_usable_q(state: PowerSGDState, previous: torch.Tensor) -> None:
    """A matrix whose averaged Q is all zero (M = 0 on every rank: zero gradient and error) keeps its
    previous Q. A zero Q would make the next P = M Q zero, and the QR of zero is a fixed set of axes,
    so the next update would project onto the first r coordinates instead of a warm-started subspace."""
    slots = state.layout.matrices
    zero = torch.stack([~q_block(state.q_flat, s).any() for s in slots]).tolist()  # one device sync
    for slot, is_zero in zip(slots, zero):
        if is_zero:
            q_block(state.q_flat, slot).copy_(q_block(previous, slot))


def prepare_buffers(state: PowerSGDState, device: torch.device) -> None:
    """Allocate P, draw Q when needed (first compressed update, or every one without warm start), place errors."""
    layout = state.layout
    if state.p_flat is None or state.p_flat.device != device:
        state.p_flat = torch.empty(layout.p_numel, dtype=torch.float32, device=device)
    if state.q_flat is None or not state.warm_start:
        state.q_flat = draw_q(state.generator, layout.q_numel, device)
    elif state.q_flat.device != device:
        state.q_flat = state.q_flat.to(device)
    state.errors.ensure(layout.matrices, device)


def start_compressed(state: PowerSGDState, grads: Mapping[str, torch.Tensor], transport: Transport,
                     summed: bool = False) -> tuple[dict[str, int], torch.Tensor | None]:
    """The collectives of one PowerSGD update: dense remainder, then P and Q. `summed`: each matrix's
    gradient is already in its error memory (M formed in place), so it is not added again.
    Returns the bytes sent by part and the previous Q (for keep_usable_q, once the outputs are out)."""
    layout = state.layout
    dense_sent = all_reduce_mean_([grads[name] for name in layout.dense_names], transport)
    if not layout.matrices:
        return {"dense": dense_sent}, None
    prepare_buffers(state, grads[layout.matrices[0].param].device)
    if not summed:
        with ERROR_UPDATE:
            for slot in layout.matrices:
                state.errors.accumulate(slot.name, as_matrix(unit_grad(grads, slot)))
    compute_p(state, grads)
    p_sent = transport.all_reduce_sum_(state.p_flat)  # a sum: orthogonalization removes the scale
    q_sent, previous_q = reduce_q(state, grads, transport)
    return {"dense": dense_sent, "p": p_sent, "q": q_sent}, previous_q


def reduce_q(state: PowerSGDState, grads: Mapping[str, torch.Tensor], transport: Transport
             ) -> tuple[int, torch.Tensor | None]:
    """Once P is summed: orthogonalize it, Q = Mᵀ P averaged in one all-reduce. Returns the Q bytes sent and the
    previous Q (for keep_usable_q)."""
    orthogonalize(state)
    previous_q = state.q_flat.clone() if state.warm_start else None
    compute_q(state, grads)
    q_sent = transport.all_reduce_sum_(state.q_flat)
    state.q_flat.div_(transport.world_size)
    return q_sent, previous_q


def reduce_q_into_outputs(state: PowerSGDState, grads: Mapping[str, torch.Tensor], transport: AsyncTransport
                          ) -> tuple[int, torch.Tensor | None]:
    """Once P is summed, reduce_q() then decompress_all() with Q's all-reduce overlapped: orthogonalize, then per
    shape group compute its Q and start the all-reduce of its contiguous block; then per group, in the same order,
    wait, average and write its outputs and errors while the later groups' Q travel. Each Q element is the same sum
    of the same addends as in the one flat all-reduce (on two ranks the same two), divided the same way, so outputs,
    errors and Q are bit-identical to reduce_q() + decompress_all(). Returns the Q bytes sent and the previous Q."""
    orthogonalize(state)
    previous_q = state.q_flat.clone() if state.warm_start else None
    flights, sent = [], 0
    for slots in group_matrices(state.layout):
        compute_q(state, grads, slots)
        block = state.q_flat[slots[0].q_offset : slots[-1].q_offset + slots[-1].m * slots[-1].r]
        handle, n = transport.start_all_reduce_sum_(block)
        flights.append((handle, block, slots))
        sent += n
    for handle, block, slots in flights:
        transport.wait(handle)
        block.div_(transport.world_size)
        decompress_all(state, grads, slots)
    return sent, previous_q


def finish_compressed(state: PowerSGDState, sent: dict[str, int], previous_q: torch.Tensor | None) -> None:
    """After every output is out (it uses this update's Q: a zero Q gives the zero output it should)."""
    if previous_q is not None:
        keep_usable_q(state, previous_q)
    state.ledger.record(state.updates, bool(state.layout.matrices), **sent)


def compressed_update(state: PowerSGDState, grads: Mapping[str, torch.Tensor], transport: Transport) -> None:
    """One PowerSGD update: dense remainder, then P and Q collectives, then output and error."""
    sent, previous_q = start_compressed(state, grads, transport)
    decompress_all(state, grads)
    finish_compressed(state, sent, previous_q)


class SummedUpdate:
    """One update whose compressed matrices' gradients were summed straight into their error memory
    (PowerSGDReducer.error_sums): `output(name)` gives a matrix's averaged gradient, computed only
    when asked for, so no full-size output buffer exists; `finish()` closes the update.

    The arithmetic is the in-buffer path's, operation for operation: M = error + grad is the same
    single addition, P Qᵀ the same matmul (into a fresh tensor instead of the gradient), and the
    error is settled against the same rounded output, so outputs, errors and Q are bit-identical.
    Warm-up (dense) updates average the sums in place in the error memory, which finish() zeroes.
    """

    def __init__(self, reducer: "PowerSGDReducer", dense_grads: Mapping[str, torch.Tensor],
                 errors: Mapping[str, torch.Tensor]):
        self.reducer, state = reducer, reducer.state
        if not errors or set(dense_grads) != set(state.layout.dense_names):
            raise ValueError("reduce_summed() takes the gradients of the dense remainder "
                             f"{list(state.layout.dense_names) if state.layout else []}, after the compressed "
                             "matrices' were added to error_sums() (device error memory only)")
        self.slots = state.layout.compressed()
        grads = sorted_grads({**dense_grads, **errors})
        reducer.register({name: g.shape for name, g in grads.items()}, "reduce_summed() gradients")
        self.errors = errors
        self.pending = set(errors)
        self.warmup = state.updates < state.dense_warmup_updates
        if self.warmup:
            self.sent, self.previous_q = {"dense": all_reduce_mean_(list(grads.values()), reducer.transport)}, None
        else:
            self.sent, self.previous_q = start_compressed(state, grads, reducer.transport, summed=True)

    @timed("reducer_compute")
    def output(self, name: str) -> torch.Tensor:
        """The averaged gradient of a compressed matrix (fp32, rounded to its delivered dtype); once per name.
        In warm-up it is the error memory itself: read it before finish() zeroes it."""
        self.pending.remove(name)
        if self.warmup:
            return self.errors[name]  # the average, in place; zeroed by finish()
        state = self.reducer.state
        with state.matmuls:
            return self._output(state, name)

    def _output(self, state: PowerSGDState, name: str) -> torch.Tensor:
        slots = self.slots[name]
        if slots[0].index is None:
            slot = slots[0]
            with PQ:
                out = torch.matmul(p_block(state.p_flat, slot), q_block(state.q_flat, slot).T)
                round_to_delivered(out, state.delivered_dtypes.get(name))
            with ERROR_UPDATE:
                state.errors.settle(name, state.errors.tensors[name], out)
            return out.view(self.errors[name].shape)
        with PQ:
            out = torch.empty((len(slots), slots[0].n, slots[0].m), dtype=torch.float32,
                              device=self.errors[name].device)
            for i, slot in enumerate(slots):
                torch.matmul(p_block(state.p_flat, slot), q_block(state.q_flat, slot).T, out=out[i])
            round_to_delivered(out, state.delivered_dtypes.get(name))
        with ERROR_UPDATE:
            for i, slot in enumerate(slots):
                state.errors.settle(slot.name, state.errors.tensors[slot.name], out[i])
        return out.view(self.errors[name].shape)

    @timed("reducer_compute")
    def finish(self) -> None:
        if self.pending:
            raise RuntimeError(f"update closed before the outputs of {sorted(self.pending)} were taken")
        state = self.reducer.state
        if self.warmup:
            for error in self.errors.values():
                error.zero_()
            state.ledger.record(state.updates, False, **self.sent)
        else:
            finish_compressed(state, self.sent, self.previous_q)
        state.updates += 1


class BucketedPowerSGD:
    """One update whose gradients arrive bucket by bucket (nshard/comm/overlap.py). Each bucket's launch does
    what reduce() does for its parameters before the P all-reduce (error update, P = M Q, per matrix) and starts
    one all-reduce of its dense remainder and its P blocks; finish() waits, then runs reduce()'s rest with Q's
    all-reduce started per shape group and each group's outputs and errors written as its Q lands
    (reduce_q_into_outputs). Per matrix the arithmetic is reduce()'s, and on two
    ranks every summed element has the same two addends, so outputs, errors and Q are bit-identical to reduce().
    A warm-up update is the dense reducer's buckets."""

    def __init__(self, reducer: "PowerSGDReducer", device: torch.device):
        state = self.state = reducer.state
        if state.layout is None:
            raise RuntimeError("start_buckets() needs the parameters registered first (register())")
        self.transport = reducer.transport
        self.warmup = state.updates < state.dense_warmup_updates
        self.compressed = {} if self.warmup else state.layout.compressed()
        self.flights: list[InFlight] = []
        self.names: list[str] = []
        if self.compressed:
            prepare_buffers(state, device)  # Q is drawn here, as in reduce(): the generator's only use

    @timed("reducer_compute")
    def launch(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Start one bucket of final gradients (every rank launches the same buckets in the same order)."""
        state, slots = self.state, [s for name in grads for s in self.compressed.get(name, ())]
        if slots:
            with ERROR_UPDATE:
                for slot in slots:
                    state.errors.accumulate(slot.name, as_matrix(unit_grad(grads, slot)))
            compute_p(state, grads, slots)
        averaged = [g for name, g in grads.items() if name not in self.compressed]
        self.names += list(grads)
        self.flights.append(start_sum_(averaged, [p_block(state.p_flat, s) for s in slots], self.transport))

    @timed("reducer_compute")
    def finish(self, named_grads: Mapping[str, torch.Tensor]) -> None:
        """Wait for every bucket and complete the update in place (`named_grads`: all of the update's)."""
        state, grads = self.state, sorted_grads(named_grads)
        state.registry.register({n: g.shape for n, g in grads.items()}, "bucketed gradients")
        check_buckets_cover(self.names, grads)
        sent = {"dense": 0, "p": 0}
        for flight in self.flights:
            dense, p = land(flight, self.transport)
            sent["dense"], sent["p"] = sent["dense"] + dense, sent["p"] + p
        if not self.compressed:  # warm-up, or nothing to compress: recorded as reduce() records it
            state.ledger.record(state.updates, False, dense=sent["dense"])
        else:
            sent["q"], previous_q = reduce_q_into_outputs(state, grads, self.transport)
            finish_compressed(state, sent, previous_q)
        state.updates += 1

    def abandon(self) -> None:
        """The update's backward failed: wait for the buckets started and write nothing back. The error memory
        and P already hold the launched buckets' part of the update: the run must resume from a checkpoint."""
        abandon(self.flights, self.transport)


class PowerSGDReducer:
    """Averages gradients with PowerSGD after `dense_warmup_updates` plain dense updates.

    Names and shapes are learned on the first reduce() (or register()) and checked on every later
    one; state_dict() keys all numerical state by parameter name so checkpoints survive re-bucketing.
    """

    def __init__(self, config: ReducerConfig, transport: Transport):
        self.transport = transport
        self.state = PowerSGDState(
            rank=config.rank,
            dense_warmup_updates=config.dense_warmup_updates,
            min_compression_rate=config.min_compression_rate,
            warm_start=config.warm_start,
            orthogonalization=config.orthogonalization,
            generator=torch.Generator(device="cpu").manual_seed(config.seed),
            errors=build_error_memory(config.error_feedback),
            matmuls=PinnedMatmuls(config.tf32),
        )

    @property
    def updates(self) -> int:
        return self.state.updates

    @property
    def ledger(self) -> ByteLedger:
        return self.state.ledger

    def register(self, named_shapes: Mapping[str, Sequence[int]], source: str = "register()") -> None:
        """Fix the parameter names and shapes (and so the compression plan) before the first update;
        the first call checks that every rank holds the same set (a collective: all ranks call it)."""
        state = self.state
        if state.registry.shapes is None:
            agree_on_shapes(named_shapes, self.transport)
        if state.registry.register(named_shapes, source):
            state.layout = build_layout(state.registry.shapes, state.rank, state.min_compression_rate)

    def deliver_as(self, dtypes: Mapping[str, torch.dtype]) -> None:
        """The dtype the optimizer receives each gradient in, when it differs from the reduced buffer's."""
        self.state.delivered_dtypes = dict(dtypes)

    def error_sums(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Each compressed matrix's error memory, parameter-shaped, for summing its gradient into
        directly (M = error + grad formed in place, no separate gradient buffer): an update with one
        microbatch adds it there and calls reduce_summed(). Empty unless the error memory lives
        beside the gradients ("device") and the shapes are registered. Between updates outside
        warm-up it holds the error; during warm-up, zeros."""
        state = self.state
        if not isinstance(state.errors, DeviceErrorMemory) or state.layout is None:
            return {}
        state.errors.ensure(state.layout.matrices, device)
        return self._error_views()

    def _error_views(self) -> dict[str, torch.Tensor]:
        """The existing error memories, parameter-shaped (none before error_sums() or a load made them)."""
        state = self.state
        if not isinstance(state.errors, DeviceErrorMemory) or state.layout is None:
            return {}
        errors, shapes = state.errors, state.layout.shapes
        views = {}
        for param, slots in state.layout.compressed().items():
            if slots[0].index is not None and param in errors.blocks:
                views[param] = errors.blocks[param]
            elif slots[0].index is None and param in errors.tensors:
                views[param] = errors.tensors[param].view(shapes[param])
        return views

    @timed("reducer_compute")
    def reduce_summed(self, dense_grads: Mapping[str, torch.Tensor]) -> SummedUpdate:
        """Like reduce(), after each compressed matrix's gradient was added to error_sums(): the dense
        remainder's gradients are averaged in place; the matrices' outputs come from the returned
        update's output(name), then its finish()."""
        return SummedUpdate(self, dense_grads, self._error_views())

    def start_buckets(self, device: torch.device) -> BucketedPowerSGD:
        """An update whose gradients arrive bucket by bucket (nshard/comm/overlap.py), bit-identical to reduce()
        on two ranks."""
        return BucketedPowerSGD(self, device)

    @timed("reducer_compute")
    def reduce(self, named_grads: Mapping[str, torch.Tensor]) -> None:
        """Average the gradients over ranks in place: dense during warm-up, PowerSGD after."""
        grads = sorted_grads(named_grads)
        self.register({name: g.shape for name, g in grads.items()}, "reduce() gradients")
        state = self.state
        if state.updates < state.dense_warmup_updates:
            sent = all_reduce_mean_(list(grads.values()), self.transport)
            state.ledger.record(state.updates, False, dense=sent)
        else:
            compressed_update(state, grads, self.transport)
        state.updates += 1

    def state_dict(self) -> dict[str, Any]:
        """errors: fp32, parameter-shaped, live references (like nn.Module.state_dict); q: (m, r) copies;
        rng: the projection generator's state; keyed by parameter name, so a re-bucketing cannot misplace them."""
        state, layout = self.state, self.state.layout
        shapes = layout.shapes if layout else {}
        return {
            "updates": state.updates,
            "rng": state.generator.get_state(),
            "shapes": {name: tuple(s) for name, s in shapes.items()},
            "errors": {s.name: state.errors.tensors[s.name].view(layout.error_shape(s))
                       for s in layout.matrices if s.name in state.errors.tensors} if layout else {},
            "q": {} if state.q_flat is None else {s.name: q_block(state.q_flat, s).clone() for s in layout.matrices},
            "ledger": state.ledger.state_dict(),
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Restore a saved state; refuses, naming the parameter, one whose names or shapes differ.
        Everything is checked first, so a refused load leaves the reducer untouched."""
        check_header(saved)
        state = self.state
        layout = state.layout
        if saved["shapes"] and layout is None:  # a state saved before any reduce carries no shapes
            layout = build_layout(saved["shapes"], state.rank, state.min_compression_rate)
        elif saved["shapes"]:
            check_same_shapes(layout.shapes, saved["shapes"], "state_dict")
        check_part(layout, saved["errors"], "errors")
        check_part(layout, saved["q"], "q")
        if saved["shapes"]:
            self.register(saved["shapes"], "state_dict")
        state.updates = int(saved["updates"])
        state.generator.set_state(saved["rng"])
        state.errors.load({name: e.reshape(e.shape[0], -1) for name, e in saved["errors"].items()})
        state.q_flat = assemble_q(state.layout, saved["q"], state.q_flat) if saved["q"] else None
        if "ledger" in saved:
            state.ledger.load_state_dict(saved["ledger"])
