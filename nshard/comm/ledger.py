"""Per-update record of the bytes this rank handed to each collective (dense flat, PowerSGD P, PowerSGD Q)."""

from __future__ import annotations

from typing import Any

BYTE_KINDS = ("dense", "p", "q")


class ByteLedger:
    """One record per update: `{"update": i, "compressed": bool, "bytes": {"dense", "p", "q"}}`."""

    def __init__(self):
        self.records: list[dict[str, Any]] = []

    def record(self, update: int, compressed: bool, dense: int = 0, p: int = 0, q: int = 0) -> None:
        self.records.append(
            {"update": update, "compressed": compressed, "bytes": {"dense": dense, "p": p, "q": q}}
        )

    def totals(self) -> dict[str, int]:
        """Bytes per kind summed over all recorded updates."""
        return {kind: sum(r["bytes"][kind] for r in self.records) for kind in BYTE_KINDS}

    def total_bytes(self) -> int:
        """All bytes this rank sent, over all updates and kinds."""
        return sum(self.totals().values())

    def state_dict(self) -> dict[str, Any]:
        return {"records": [_copy_record(r) for r in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [_copy_record(r) for r in state["records"]]


def _copy_record(record: dict[str, Any]) -> dict[str, Any]:
    # Records are plain dicts handed to callers: copy so nobody edits the ledger through a saved state.
    return {"update": record["update"], "compressed": record["compressed"], "bytes": dict(record["bytes"])}
