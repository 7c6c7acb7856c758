"""Per-rank hard memory caps on CPU: one memory group per local rank, of cgroup v2 (`memory.max`) where the
machine's unified hierarchy has the memory controller, else of cgroup v1 (`memory.limit_in_bytes`;
NSHARD_MEMCAP_CGROUP=v2|v1 forces one: nshard/cgroups.py), joined by launch/capped.sh, removed again when the block
ends (also on an exception or SIGTERM/SIGINT).

On GPU the same cap would be `torch.cuda.set_per_process_memory_fraction(cap / total, device)` in
each rank before the model is built (an allocation past it raises torch.OutOfMemoryError); this
module covers the CPU case, where the kernel enforces the limit and OOM-kills the rank (exit 137).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nshard import cgroups

WRAPPER = Path(__file__).resolve().parent / "capped.sh"
TRAIN = Path(__file__).resolve().parent.parent / "nshard" / "train.py"


class CapError(RuntimeError):
    """The memory controller cannot be used here; the message says what is missing."""


@dataclass(frozen=True)
class RankUsage:
    """What one rank's group saw: OOM kills, peak charge (RSS + page cache + kernel), times the limit was hit."""

    oom_kills: int
    max_usage_bytes: int
    failcnt: int


def counter(path: Path, key: str) -> int:
    """One `key value` line of a cgroup file (v1's memory.oom_control, v2's memory.events)."""
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise CapError(f"{path} has no {key} line; this kernel cannot tell OOM kills apart (v1 needs kernel >= 4.13)")


def usage(group: Path, version: str) -> RankUsage:
    """v1: memory.oom_control's oom_kill, memory.max_usage_in_bytes, memory.failcnt. v2: memory.events' oom_kill
    and max (times the limit was hit), memory.peak (kernels >= 5.19; else memory.current at the end)."""
    if version == "v1":
        return RankUsage(counter(group / "memory.oom_control", "oom_kill"),
                         int((group / "memory.max_usage_in_bytes").read_text()), int((group / "memory.failcnt").read_text()))
    peak = group / "memory.peak" if (group / "memory.peak").is_file() else group / "memory.current"
    return RankUsage(counter(group / "memory.events", "oom_kill"), int(peak.read_text()),
                     counter(group / "memory.events", "max"))


class RankCaps:
    """`ranks` memory groups of `cap_bytes` each; use as a context manager and pass `env` to the launcher."""

    def __init__(self, cap_bytes: int, ranks: int, tag: str = ""):
        try:
            self.hierarchy = cgroups.choose("memory").hierarchy
        except cgroups.CgroupError as exc:
            raise CapError(f"{exc}; per-rank caps need a writable memory controller (run as root on a host that "
                           "mounts one, or cap GPU ranks with torch.cuda.set_per_process_memory_fraction)") from None
        self.cap_bytes, self.ranks = int(cap_bytes), ranks
        self.prefix = f"nshard-cap-{os.getpid()}-{tag or int(time.time() * 1000) % 10**8}"
        self.names = [f"{self.prefix}-rank{r}" for r in range(ranks)]
        self.groups = [self.hierarchy.root / n for n in self.names]
        self._old_handlers: dict = {}

    @property
    def env(self) -> dict[str, str]:
        return {"NSHARD_CGROUP_ROOT": str(self.hierarchy.root), "NSHARD_CGROUP_PREFIX": self.prefix,
                "NSHARD_PYTHON": sys.executable, "NSHARD_TRAIN": str(TRAIN)}

    def __enter__(self) -> "RankCaps":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for name in self.names:  # the limit with swap kept out, so that it means resident memory
                self.hierarchy.make(name, str(self.cap_bytes))
        except cgroups.CgroupError as exc:
            self.remove()
            raise CapError(str(exc)) from None
        except BaseException:
            self.remove()
            raise
        return self

    def _on_signal(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")  # unwinds through __exit__, which removes the groups

    def usage(self) -> list[RankUsage]:
        return [usage(g, self.hierarchy.version) for g in self.groups]

    def remove(self) -> None:
        """rmdir every group; a group whose last process is still exiting is retried for a few seconds."""
        for group in self.groups:
            for _ in range(50):
                try:
                    group.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: a killed rank not yet reaped
                    time.sleep(0.1)
            else:
                print(f"memcap: warning: could not remove {group}; rmdir it once its processes are gone",
                      file=sys.stderr)

    def __exit__(self, *exc) -> None:
        self.remove()
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)


def leftover_groups(prefix: str = "nshard-cap-") -> list[Path]:
    return sorted(p for h in cgroups.hierarchies("memory").values() for p in h.root.glob(f"{prefix}*") if p.is_dir())


def warm_extensions() -> dict:
    """Build DeepSpeed's CPU shm collective once, outside any cap, in this checkout's own extensions dir.

    init_distributed JIT-compiles it when the build dir's recipe differs (another checkout's venv path
    is enough), and the compiler then runs inside the rank's group: it was OOM-killed under a 2 GiB cap,
    which would read as the model not fitting. Returns the environment the ranks need to find it.
    """
    import subprocess

    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(TRAIN.parent.parent / ".cache" / "torch_extensions"))
    code = "from nshard.seam.engine import build_cpu_comm_extension; build_cpu_comm_extension()"
    subprocess.run([sys.executable, "-c", code], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=600)
    return {"TORCH_EXTENSIONS_DIR": env["TORCH_EXTENSIONS_DIR"]}
