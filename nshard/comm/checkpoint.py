"""The checks a saved PowerSGD state must pass before it is loaded (pure functions of the layout; the
reducer's own state_dict/load_state_dict in nshard/comm/powersgd.py call them)."""

from __future__ import annotations

from typing import Mapping

import torch

from nshard.comm.layout import Layout, q_block

REQUIRED_KEYS = ("updates", "rng", "shapes", "errors", "q")


def check_header(saved: Mapping) -> None:
    missing = [key for key in REQUIRED_KEYS if key not in saved]
    if missing:
        raise ValueError(f"state_dict lacks {missing}; it is not a PowerSGD reducer state")
    if not (isinstance(saved["rng"], torch.Tensor) and saved["rng"].dtype == torch.uint8):
        raise ValueError("state_dict rng is not a torch.Generator state (uint8 tensor)")


def _expected_shapes(layout: Layout | None, part: str) -> dict[str, torch.Size]:
    if layout is None:
        return {}
    if part == "errors":
        return {s.name: layout.error_shape(s) for s in layout.matrices}
    return {s.name: torch.Size((s.m, s.r)) for s in layout.matrices}


def check_part(layout: Layout | None, saved: Mapping[str, torch.Tensor], part: str) -> None:
    """A saved `errors`/`q` part is empty (never compressed) or covers exactly the compressed names and shapes."""
    expected = _expected_shapes(layout, part)
    if not saved:
        return
    for name in sorted(set(expected) | set(saved)):
        if name not in saved:
            raise ValueError(f"state_dict {part} lacks parameter {name!r}, which this reducer compresses")
        if name not in expected:
            raise ValueError(f"state_dict {part} has parameter {name!r}, which this reducer does not compress")
        if saved[name].shape != expected[name]:
            raise ValueError(
                f"state_dict {part} for parameter {name!r} has shape {tuple(saved[name].shape)}, this reducer "
                f"expects {tuple(expected[name])} (saved with another nshard.rank or model?)"
            )


def assemble_q(layout: Layout, saved_q: Mapping[str, torch.Tensor], like: torch.Tensor | None) -> torch.Tensor:
    """The flat Q buffer from per-name (m, r) blocks, on the device of the buffer it replaces."""
    device = like.device if like is not None else torch.device("cpu")
    q_flat = torch.empty(layout.q_numel, dtype=torch.float32, device=device)
    for slot in layout.matrices:
        q_block(q_flat, slot).copy_(saved_q[slot.name])
    return q_flat
