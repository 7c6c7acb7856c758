"""Where one update's gradients are reduced: the Seam protocol, DeepSpeed's own all-reduce, and the stage-0 seam
that puts an nshard reducer in its place (the ingest seam for ZeRO-1/2 and bf16 is nshard/seam/ingest.py).

Each seam runs a microbatch's forward and backward and the optimizer step; nshard/seam/engine.py picks
the seam, and nshard/seam/patches.py prepares DeepSpeed for it (every private attribute lives there).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from nshard.comm.ledger import ByteLedger
from nshard.comm.overlap import BackwardOverlap
from nshard.comm.reducer import Reducer
from nshard.phases import phase


class Seam(Protocol):
    """What the training loop calls on a seam, once per microbatch and once per update."""

    name: str
    """The reduction, for receipts: "deepspeed", or the nshard reducer's name."""
    sums: str
    """Where the last update's microbatch gradients were summed (metrics.jsonl's microbatch_sums)."""
    one_rank_skip: bool
    """A world of one rank whose reduction is skipped (the receipts' reduction_ran.one_rank)."""

    def forward(self, engine, **inputs) -> Any:
        """One microbatch's forward (the engine, or its module where DeepSpeed's hooks must not fire)."""
        ...

    def backward_and_step(self, engine, loss: torch.Tensor, last: bool) -> None:
        """Backward of one microbatch; after the `last` one of an update, reduce and step the optimizer."""
        ...

    def last_update_compressed(self) -> bool: ...

    def last_update_bytes(self) -> int:
        """Bytes the nshard reducer sent in the last update (0 under DeepSpeed's own reduction)."""
        ...

    @property
    def ledger(self) -> ByteLedger | None:
        """The nshard reducer's byte ledger; None under DeepSpeed's own reduction."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class DeepSpeedReduction:
    """DeepSpeed's own gradient all-reduce; its bytes come from DeepSpeed's comms logger. On one rank at stage 0 its
    epilogue, the identity there, is replaced by what it does that matters (`one_rank_skip`:
    patches.skip_one_rank_reduction)."""

    name = "deepspeed"
    sums = "deepspeed"  # where an update's microbatch gradients are summed

    def __init__(self, one_rank_skip: bool = False):
        self.one_rank_skip = one_rank_skip

    def forward(self, engine, **inputs):
        return engine(**inputs)

    def backward_and_step(self, engine, loss, last: bool) -> None:
        engine.backward(loss, scale_wrt_gas=False)  # its reduction epilogue: patches.time_deepspeed_reduction
        with phase("optimizer_step"):
            engine.step()  # DeepSpeed steps the optimizer only at its accumulation boundary

    def last_update_compressed(self) -> bool:
        return False

    def last_update_bytes(self) -> int:
        return 0

    @property
    def ledger(self) -> None:
        return None  # DeepSpeed's comms logger counts its bytes (nshard/seam/patches.py CollectiveCounter)

    def state_dict(self) -> dict:
        return {}  # DeepSpeed's own reduction keeps nothing between updates

    def load_state_dict(self, state: dict) -> None:
        pass


class ReducerSeam:
    """Shared by the nshard seams: the reducer, the trained parameters, the ledger's last record. `one_rank_skip`:
    a world of one rank, where the reducer averages nothing (the dense average of one gradient is itself, and its
    reducer was built to skip it) and no reduction starts during backward."""

    def __init__(self, engine, reducer: Reducer, name: str, one_rank_skip: bool = False):
        self.reducer, self.name, self.one_rank_skip = reducer, name, one_rank_skip
        self.params = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
        reducer.register({n: tuple(p.shape) for n, p in self.params.items()})
        # What the optimizer receives: the parameter's dtype (bf16 under bf16, though reduced in fp32).
        reducer.deliver_as({n: p.dtype for n, p in self.params.items()})

    def last_update_compressed(self) -> bool:
        return self.reducer.ledger.records[-1]["compressed"]

    def last_update_bytes(self) -> int:
        return sum(self.reducer.ledger.records[-1]["bytes"].values())

    @property
    def ledger(self) -> ByteLedger:
        return self.reducer.ledger

    def state_dict(self) -> dict:
        """The reducer's state (between updates the seams' own buffers hold zeros: nothing else to keep)."""
        return {"reducer": self.reducer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.reducer.load_state_dict(state["reducer"])


class InPlaceSeam(ReducerSeam):
    """Stage 0, fp32: DeepSpeed's all-reduce is switched off (enable_backward_allreduce), microbatch
    gradients accumulate in .grad through engine.backward, and after the last one the reducer
    averages .grad in place before engine.step(). With `overlap` (nshard.overlap_backward) the reduction
    starts during the last backward, bucket by bucket (nshard/comm/overlap.py), with the same result."""

    sums = ".grad"

    def __init__(self, engine, reducer: Reducer, name: str, overlap: bool = False, one_rank_skip: bool = False):
        super().__init__(engine, reducer, name, one_rank_skip)
        self.overlap = BackwardOverlap(reducer, self.params) if overlap else None

    def forward(self, engine, **inputs):
        return engine(**inputs)

    def backward_and_step(self, engine, loss, last: bool) -> None:
        if last and self.overlap is not None:
            self.overlap.reduce(lambda: engine.backward(loss, scale_wrt_gas=False))
            with phase("optimizer_step"):
                engine.step()
            return
        engine.backward(loss, scale_wrt_gas=False)
        if last:
            with phase("reducer_compute"):
                for p in self.params.values():
                    if p.grad is None:  # every parameter takes part in every update, with a zero gradient if unused
                        p.grad = torch.zeros_like(p)
                self.reducer.reduce({n: p.grad for n, p in self.params.items()})
        with phase("optimizer_step"):
            engine.step()
