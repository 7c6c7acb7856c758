"""Ranks agree on the parameter names and shapes before the first update: one small collective of a hash."""

from __future__ import annotations

import hashlib
import json
from typing import Mapping, Sequence

from nshard.comm.transport import Transport


class RanksDisagree(RuntimeError):
    """Ranks hold different parameter sets: every later collective would pair unrelated tensors."""


def shapes_sha256(named_shapes: Mapping[str, Sequence[int]]) -> str:
    """SHA-256 over the sorted (name, shape) pairs: the parameter set's identity."""
    pairs = [[name, list(named_shapes[name])] for name in sorted(named_shapes)]
    return hashlib.sha256(json.dumps(pairs).encode()).hexdigest()


def agree_on_shapes(named_shapes: Mapping[str, Sequence[int]], transport: Transport) -> None:
    """Raise RanksDisagree naming the first parameter whose presence or shape differs from rank 0's."""
    digests = transport.all_gather_object(shapes_sha256(named_shapes))
    if len(set(digests)) == 1:
        return
    # Only on a mismatch: gather every rank's names and shapes to name the parameter.
    everyone = transport.all_gather_object({name: tuple(s) for name, s in named_shapes.items()})
    for rank, shapes in enumerate(everyone[1:], start=1):
        for name in sorted(set(everyone[0]) | set(shapes)):
            first, other = everyone[0].get(name), shapes.get(name)
            if first != other:
                raise RanksDisagree(f"ranks hold different parameters: {name!r} is {_shape(first)} on rank 0 and "
                                    f"{_shape(other)} on rank {rank}; every rank must build the same model")
    raise RanksDisagree(f"ranks' parameter-set hashes differ ({digests}) though their names and shapes match")


def _shape(shape) -> str:
    return "missing" if shape is None else f"shape {shape}"
