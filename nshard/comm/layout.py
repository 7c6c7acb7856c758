"""Which gradients PowerSGD compresses, and where each one's P and Q live in the flat buffers.

A 3-D parameter of an `experts` module is a stack of matrices (transformers' fused experts: Mixtral's
`mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I]): each expert's matrix is compressed on
its own, as the unfused model's would be, under the name `param[e]`. Every other parameter (a 3-D convolution
kernel too) is one (shape[0], rest) matrix under its own name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch


@dataclass(frozen=True)
class MatrixSlot:
    """One compressed gradient seen as an (n, m) matrix with rank-r factors P (n, r) and Q (m, r)."""

    name: str
    """The unit's name: the parameter's, or `param[e]` for expert e of a stacked (3-D) parameter."""
    n: int
    m: int
    r: int
    p_offset: int
    q_offset: int
    param: str
    """The parameter whose gradient holds this matrix."""
    index: int | None = None
    """The matrix's index along a stacked parameter's first dimension (None: the whole parameter)."""


@dataclass(frozen=True)
class GroupSlot:
    """Same-shape matrices whose P blocks are adjacent, so one batched QR orthogonalizes them all."""

    n: int
    m: int
    r: int
    count: int
    p_offset: int


@dataclass(frozen=True, eq=False)
class Layout:
    """The compression plan; a pure function of (names, shapes, rank, min_compression_rate), so identical on all ranks."""

    shapes: dict[str, torch.Size]
    dense_names: tuple[str, ...]
    matrices: tuple[MatrixSlot, ...]
    groups: tuple[GroupSlot, ...]
    p_numel: int
    q_numel: int

    def error_shape(self, slot: MatrixSlot) -> torch.Size:
        """The shape a unit's error memory is saved in: the parameter's, or (n, m) for one expert of a stack."""
        return self.shapes[slot.param] if slot.index is None else torch.Size((slot.n, slot.m))

    def compressed(self) -> dict[str, tuple[MatrixSlot, ...]]:
        """Each compressed parameter's units, in layout order (one for a matrix, one per expert for a stack)."""
        out: dict[str, list[MatrixSlot]] = {}
        for slot in self.matrices:
            out.setdefault(slot.param, []).append(slot)
        return {param: tuple(sorted(slots, key=lambda s: s.index or 0)) for param, slots in out.items()}


EXPERTS = "experts"
"""The module name under which transformers keeps fused expert tensors (one [E, out, in] parameter per projection)."""


def stacked(name: str, shape: Sequence[int]) -> bool:
    """A 3-D parameter of an `experts` module is a stack of per-expert matrices along its first dimension."""
    return len(shape) == 3 and EXPERTS in name.split(".")[:-1]


def units(name: str, shape: torch.Size) -> list[tuple[str, int | None, torch.Size]]:
    """(unit name, index, matrix shape) of the matrices a parameter's gradient is compressed as."""
    if stacked(name, shape):
        return [(f"{name}[{e}]", e, torch.Size(shape[1:])) for e in range(shape[0])]
    return [(name, None, shape)]


def p_block(p_flat: torch.Tensor, slot: MatrixSlot) -> torch.Tensor:
    return p_flat[slot.p_offset : slot.p_offset + slot.n * slot.r].view(slot.n, slot.r)


def q_block(q_flat: torch.Tensor, slot: MatrixSlot) -> torch.Tensor:
    return q_flat[slot.q_offset : slot.q_offset + slot.m * slot.r].view(slot.m, slot.r)


def p_group(p_flat: torch.Tensor, group: GroupSlot) -> torch.Tensor:
    return p_flat[group.p_offset : group.p_offset + group.count * group.n * group.r].view(
        group.count, group.n, group.r
    )


def group_matrices(layout: Layout) -> list[tuple[MatrixSlot, ...]]:
    """The matrices of each shape group, in layout order: a group's Q blocks are one contiguous range of the flat Q."""
    out, start = [], 0
    for group in layout.groups:
        out.append(layout.matrices[start : start + group.count])
        start += group.count
    return out


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The (shape[0], rest) matrix view PowerSGD compresses."""
    n = shape[0]
    return n, (torch.Size(shape).numel() // n if n else 0)


def effective_rank(n: int, m: int, rank: int) -> int:
    # A P with more columns than rows cannot be orthonormal; r = min(n, m) already reconstructs exactly.
    return min(rank, n, m)


def should_compress(shape: Sequence[int], rank: int, min_compression_rate: float) -> bool:
    """Compress when r*(n+m)*min_compression_rate <= n*m; vectors and scalars always go dense."""
    if len(shape) < 2 or torch.Size(shape).numel() == 0:
        return False
    n, m = matrix_shape(shape)
    return effective_rank(n, m, rank) * (n + m) * min_compression_rate <= n * m


def _group_by_shape(members: list[tuple[str, str, int | None, torch.Size]]) -> dict[tuple[int, int], list]:
    # Insertion order = first appearance in sorted names: deterministic, so collectives line up on all ranks.
    groups: dict[tuple[int, int], list] = {}
    for member in members:
        groups.setdefault(matrix_shape(member[3]), []).append(member)
    return groups


def build_layout(named_shapes: Mapping[str, Sequence[int]], rank: int, min_compression_rate: float) -> Layout:
    """Sort names, split dense from compressed (a stack by its experts' matrix shape), and give every compressed
    matrix its P and Q offsets."""
    shapes = {name: torch.Size(named_shapes[name]) for name in sorted(named_shapes)}
    members = [(unit, name, index, shape) for name, s in shapes.items() for unit, index, shape in units(name, s)
               if should_compress(shape, rank, min_compression_rate)]
    compressed = {param for _, param, _, _ in members}
    dense_names = tuple(name for name in shapes if name not in compressed)
    matrices, groups, p_offset, q_offset = [], [], 0, 0
    for (n, m), group in _group_by_shape(members).items():
        r = effective_rank(n, m, rank)
        groups.append(GroupSlot(n, m, r, len(group), p_offset))
        for unit, param, index, _ in group:
            matrices.append(MatrixSlot(unit, n, m, r, p_offset, q_offset, param, index))
            p_offset += n * r
            q_offset += m * r
    return Layout(shapes, dense_names, tuple(matrices), tuple(groups), p_offset, q_offset)


def check_same_shapes(expected: Mapping[str, torch.Size], actual: Mapping[str, Sequence[int]], source: str) -> None:
    """Raise ValueError naming the first parameter whose presence or shape differs between the two."""
    missing = sorted(set(expected) - set(actual))
    if missing:
        raise ValueError(f"{source} lacks parameter {missing[0]!r} that the reducer was registered with")
    extra = sorted(set(actual) - set(expected))
    if extra:
        raise ValueError(f"{source} has parameter {extra[0]!r} that the reducer was not registered with")
    for name in sorted(expected):
        if torch.Size(actual[name]) != expected[name]:
            raise ValueError(
                f"{source} gives parameter {name!r} shape {tuple(actual[name])}, "
                f"but the reducer was registered with {tuple(expected[name])}"
            )
