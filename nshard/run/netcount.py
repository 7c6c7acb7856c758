"""Where a rank ran and what crossed its link: the kernel's transmit counter of the interface gloo (or NCCL's
socket transport) uses, set beside the bytes the rank handed to collectives (DeepSpeed's comms logger, the reducer's
ledger, nshard's count of the weights' all-gather and delta sync)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil

from nshard.log import log

TOLERANCE = 0.05
"""Protocol overhead allowed between the kernel's count and the collectives' payload: TCP/IP framing
and acknowledgements measured 0.1-5% of the payload on the emulated link (FACTS.md)."""


IFNAME_VARIABLES = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def link_interface(backend: str = "gloo") -> str | None:
    """The interface the backend was told to use (GLOO_SOCKET_IFNAME, or NCCL_SOCKET_IFNAME under NCCL: its first
    name if a list, without NCCL's exact-match "="); None when unset, as on one machine, where the traffic goes
    through loopback or shared memory, or when NCCL's variable excludes interfaces ("^...") instead."""
    first = os.environ.get(IFNAME_VARIABLES.get(backend, "GLOO_SOCKET_IFNAME"), "").split(",")[0].strip()
    return None if first.startswith("^") else first.lstrip("=") or None


INFINIBAND = Path("/sys/class/infiniband")


def not_countable(backend: str, infiniband: Path = INFINIBAND) -> str | None:
    """Why the kernel's interface counter cannot count this rank's collectives (None: it can, given an interface)."""
    if backend != "nccl":
        return None
    devices = sorted(p.name for p in infiniband.iterdir()) if infiniband.is_dir() else []
    if os.environ.get("NCCL_IB_DISABLE", "0") != "1" and devices:
        return (f"NCCL can carry the collectives over InfiniBand ({', '.join(devices)}), whose RDMA "
                "traffic no kernel interface counter sees; set NCCL_IB_DISABLE=1 (and NCCL_SOCKET_IFNAME) to count "
                "over sockets")
    if os.environ.get("NCCL_SOCKET_IFNAME", "").startswith("^"):
        return "NCCL_SOCKET_IFNAME excludes interfaces (^...) instead of naming one; name the interface to count it"
    return None


def tx_bytes(interface: str | None) -> int | None:
    """Bytes the kernel has transmitted on `interface`; None when there is no such interface.

    psutil reads /proc/net/dev, which always shows the reading process's own network namespace
    (/sys/class/net shows whichever namespace sysfs was mounted in), same counter as
    /sys/class/net/IF/statistics/tx_bytes."""
    if interface is None:
        return None
    try:
        counters = psutil.net_io_counters(pernic=True).get(interface)
    except OSError:
        return None
    return counters.bytes_sent if counters else None


def where(backend: str = "gloo") -> dict:
    """`host`: this rank's IPv4 address on the link interface, else the machine's name;
    `net_namespace`: the kernel's name for the network namespace the rank ran in."""
    interface = link_interface(backend)
    addresses = psutil.net_if_addrs().get(interface, []) if interface else []
    ipv4 = [a.address for a in addresses if a.family == socket.AF_INET]
    return {"host": ipv4[0] if ipv4 else socket.gethostname(), "net_namespace": os.readlink("/proc/self/ns/net")}


class LinkCount:
    """Started before the training loop, finished after it: the kernel's bytes against the collectives' bytes
    over the same span. `collectives` is an nshard.seam.patches.CollectiveCounter (bytes since its last take);
    `backend` the process group's ("gloo" or "nccl"), which decides the interface variable."""

    def __init__(self, collectives, backend: str = "gloo"):
        self.backend = backend
        self.not_counted = not_countable(backend)
        self.interface = None if self.not_counted else link_interface(backend)
        self.collectives = collectives
        collectives.take()
        self.tx_start = tx_bytes(self.interface)

    def finish(self, rank: int, world_size: int, ledger_bytes: int | None) -> dict:
        tx_end = tx_bytes(self.interface)
        logged = self.collectives.take()
        kernel = None if tx_end is None or self.tx_start is None else tx_end - self.tx_start
        logged_reducer = logged["logged_reducer_bytes"]  # None: DeepSpeed's comms logger was off
        # The reducer's bytes: the logger's where it counted (checked against the ledger below), else the ledger's.
        reducer = logged_reducer if logged_reducer is not None else ledger_bytes or 0
        logged_bytes = logged["deepspeed_grad_bytes"] + reducer + logged["other_bytes"]
        # A ring all-reduce (gloo's) sends 2(W-1)/W of the tensor from each rank: for two ranks, the tensor once.
        expected = logged_bytes * 2 * (world_size - 1) / world_size
        ratio = kernel / expected if kernel is not None and expected > 0 else None
        ledger_ok = None if ledger_bytes is None or logged_reducer is None else ledger_bytes == logged_reducer
        delta, logged_delta = logged.get("delta_bytes"), logged.get("logged_delta_bytes")
        delta_ok = None if logged_delta is None else delta == logged_delta
        if ledger_ok is False or delta_ok is False:
            agree = False
        elif ratio is None:  # no link interface (one machine), or nothing sent
            agree = None
        else:
            agree = abs(ratio - 1) <= TOLERANCE
        link = {"interface": self.interface, "kernel_tx_bytes": kernel, "logged_collective_bytes": logged_bytes,
                "logged_reducer_bytes": logged_reducer, "ledger_bytes": ledger_bytes,
                "delta_bytes": delta, "logged_delta_bytes": logged_delta,
                "expected_wire_bytes": round(expected), "kernel_over_expected": ratio,
                "ledger_matches_logger": ledger_ok, "delta_matches_logger": delta_ok, "tolerance": TOLERANCE,
                "agree": agree,
                "backend": self.backend, "not_counted": self.not_counted}
        if self.not_counted:
            log.warning("the link's bytes are not counted: %s", self.not_counted, extra={"rank": rank})
        if agree is False:
            log.warning(f"byte counts disagree beyond {TOLERANCE:.0%} protocol overhead: kernel sent {kernel} B on "
                        f"{self.interface}, collectives {logged_bytes} B (expected on the wire {round(expected)} B), "
                        f"reducer ledger {ledger_bytes} B vs logged {logged_reducer} B, delta sync {delta} B vs "
                        f"logged {logged_delta} B", extra={"rank": rank})
        return {**where(self.backend), "link": link}
