"""The reducer interface the engine relies on, and `build_reducer` from the ds_config's "nshard" section."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import torch

from nshard.comm.config import ReducerConfig, parse_config
from nshard.comm.dense import DenseReducer
from nshard.comm.ledger import ByteLedger
from nshard.comm.powersgd import PowerSGDReducer
from nshard.comm.transport import build_transport


class SummedReduction(Protocol):
    """One update whose compressed gradients were summed into the reducer's error_sums() (Reducer.reduce_summed):
    each matrix's averaged gradient is computed when asked for, so no full-size output buffer exists."""

    def output(self, name: str) -> torch.Tensor:
        """The averaged gradient of one summed matrix (once per name)."""
        ...

    def finish(self) -> None:
        """Close the update once every output was taken (ledger record, update count)."""
        ...


class BucketedReduction(Protocol):
    """One update whose gradients are handed over bucket by bucket as backward finishes them
    (Reducer.start_buckets, driven by nshard/comm/overlap.py), with the same result as reduce()."""

    def launch(self, grads: Mapping[str, torch.Tensor]) -> None:
        """One bucket's final gradients: its collectives start and run on while the caller computes."""
        ...

    def finish(self, named_grads: Mapping[str, torch.Tensor]) -> None:
        """Wait for every bucket and complete the update in place; `named_grads` are all of the update's, each
        launched in exactly one bucket."""
        ...

    def abandon(self) -> None:
        """The update's backward failed: wait for every bucket launched, so no collective is left in flight."""
        ...


class Reducer(Protocol):
    """Averages one update's gradients over data-parallel ranks, in place. The seams call nothing else."""

    ledger: ByteLedger
    updates: int

    def register(self, named_shapes: Mapping[str, Sequence[int]]) -> None:
        """Fix names and shapes up front; otherwise the first reduce() does, and later calls are checked."""
        ...

    def deliver_as(self, dtypes: Mapping[str, torch.dtype]) -> None:
        """The dtype the optimizer receives each gradient in (error feedback settles against it)."""
        ...

    def error_sums(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Buffers (by parameter name) an update's gradients may be summed into in place of their own, for
        reduce_summed(); empty when the reducer has none."""
        ...

    def reduce(self, named_grads: Mapping[str, torch.Tensor]) -> None:
        """One call per update; names are processed in sorted order so collectives match across ranks."""
        ...

    def reduce_summed(self, dense_grads: Mapping[str, torch.Tensor]) -> SummedReduction:
        """reduce() for an update whose matrices were summed into error_sums(): the other (dense) gradients are
        averaged in place now, the matrices' outputs come from the returned update (a collective: all ranks)."""
        ...

    def start_buckets(self, device: torch.device) -> BucketedReduction:
        """reduce() for gradients that arrive bucket by bucket (nshard.overlap_backward: the transport must be
        "torch"). Every rank launches the same buckets in the same order."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def build_reducer(config: ReducerConfig | Mapping[str, Any] | None, group: Any = None,
                  all_reduce: Any = None, skip_one_rank: bool = False) -> Reducer:
    """A reducer for the parsed "nshard" section (a raw mapping is parsed here, before any transport is touched).
    `skip_one_rank`: the dense reducer leaves a world of one rank's gradients as they are (DenseReducer)."""
    parsed = config if isinstance(config, ReducerConfig) else parse_config(config)
    transport = build_transport(parsed.transport, group, all_reduce)
    if parsed.reducer == "dense":
        return DenseReducer(transport, skip_one_rank)
    return PowerSGDReducer(parsed, transport)
