"""Fault injection: NSHARD_FAULT=RANK:UPDATE[:PHASE] makes one rank fail at a chosen point.

Set by tests (tests/test_resume.py), launch/kill_resume.py and a study plan's [study.fault] (for that arm's first
attempt only, nshard/study/runner.py) to stop a run deterministically; unset (the normal case) it does nothing. UPDATE counts completed updates (1 = after the first). PHASE:
- "update" (default): SIGKILL after that update's optimizer step, before any check or save;
- "save": SIGKILL in the middle of the state save after that update, once DeepSpeed's files are
  written and before this rank's own part (so the save is left half-made);
- "diverge": after that update, nudge one parameter on that rank only (a silent replica divergence,
  for the parameter-root check).
"""

from __future__ import annotations

import os
import signal

import torch

PHASES = ("update", "save", "diverge")


def planned() -> tuple[int, int, str] | None:
    """(rank, update, phase) from NSHARD_FAULT, or None."""
    spec = os.environ.get("NSHARD_FAULT", "")
    if not spec:
        return None
    parts = spec.split(":")
    try:
        rank, update, phase = int(parts[0]), int(parts[1]), (parts[2] if len(parts) > 2 else "update")
    except (ValueError, IndexError):
        raise ValueError(f"NSHARD_FAULT={spec!r}: use RANK:UPDATE[:PHASE], e.g. 1:5:save") from None
    if phase not in PHASES or len(parts) > 3:
        raise ValueError(f"NSHARD_FAULT={spec!r}: PHASE must be one of {', '.join(PHASES)}")
    return rank, update, phase


def strike(rank: int, update: int, phase: str, module: torch.nn.Module | None = None) -> None:
    """Fail here if NSHARD_FAULT names this rank, update and phase."""
    if planned() != (rank, update, phase):
        return
    if phase == "diverge":
        with torch.no_grad():
            next(module.parameters()).view(-1)[0] += 1e-3
        return
    os.kill(os.getpid(), signal.SIGKILL)
