"""PowerSGD state as a dict keyed by parameter name, and the checks a saved state must pass before it is loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from nshard.comm.layout import Layout, build_layout, check_same_shapes, q_block

if TYPE_CHECKING:
    from nshard.comm.powersgd import PowerSGDReducer, PowerSGDState

REQUIRED_KEYS = ("updates", "rng", "shapes", "errors", "q")


def powersgd_state_dict(state: PowerSGDState) -> dict[str, Any]:
    """errors: fp32, parameter-shaped, live references; q: (m, r) copies; rng: the projection generator's state."""
    layout = state.layout
    shapes = layout.shapes if layout else {}
    return {
        "updates": state.updates,
        "rng": state.generator.get_state(),
        "shapes": {name: tuple(s) for name, s in shapes.items()},
        "errors": {name: e.view(shapes[name]) for name, e in state.errors.tensors.items()},
        "q": {} if state.q_flat is None else {s.name: q_block(state.q_flat, s).clone() for s in layout.matrices},
        "ledger": state.ledger.state_dict(),
    }


def _expected_shapes(layout: Layout | None, part: str) -> dict[str, torch.Size]:
    if layout is None:
        return {}
    if part == "errors":
        return {s.name: layout.shapes[s.name] for s in layout.matrices}
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


def _assemble_q(layout: Layout, saved_q: Mapping[str, torch.Tensor], like: torch.Tensor | None) -> torch.Tensor:
    device = like.device if like is not None else torch.device("cpu")
    q_flat = torch.empty(layout.q_numel, dtype=torch.float32, device=device)
    for slot in layout.matrices:
        q_block(q_flat, slot).copy_(saved_q[slot.name])
    return q_flat


def load_powersgd_state_dict(reducer: PowerSGDReducer, saved: Mapping[str, Any]) -> None:
    """Check everything first, then replace the state: a refused load leaves the reducer untouched."""
    missing = [key for key in REQUIRED_KEYS if key not in saved]
    if missing:
        raise ValueError(f"state_dict lacks {missing}; it is not a PowerSGD reducer state")
    if not (isinstance(saved["rng"], torch.Tensor) and saved["rng"].dtype == torch.uint8):
        raise ValueError("state_dict rng is not a torch.Generator state (uint8 tensor)")
    state = reducer.state
    layout = state.layout
    if saved["shapes"] and layout is None:  # a state saved before any reduce carries no shapes
        layout = build_layout(saved["shapes"], state.rank, state.min_compression_rate)
    elif saved["shapes"]:
        check_same_shapes(layout.shapes, saved["shapes"], "state_dict")
    check_part(layout, saved["errors"], "errors")
    check_part(layout, saved["q"], "q")
    if saved["shapes"]:
        reducer.register(saved["shapes"], "state_dict")
    state.updates = int(saved["updates"])
    state.generator.set_state(saved["rng"])
    state.errors.load({name: e.reshape(e.shape[0], -1) for name, e in saved["errors"].items()})
    state.q_flat = _assemble_q(state.layout, saved["q"], state.q_flat) if saved["q"] else None
    if "ledger" in saved:
        state.ledger.load_state_dict(saved["ledger"])
