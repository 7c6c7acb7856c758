"""Per-rank hard memory caps on CPU: one cgroup v1 memory group per local rank, joined by
launch/capped.sh, removed again when the block ends (also on an exception or SIGTERM/SIGINT).

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

CGROUP_ROOT = Path(os.environ.get("NSHARD_CGROUP_ROOT", "/sys/fs/cgroup/memory"))
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


def oom_kills(group: Path) -> int:
    """The group's OOM-kill count (memory.oom_control's oom_kill line; kernels >= 4.13)."""
    for line in (group / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    raise CapError(f"{group}/memory.oom_control has no oom_kill line; this kernel cannot tell OOM kills apart")


class RankCaps:
    """`ranks` memory groups of `cap_bytes` each; use as a context manager and pass `env` to the launcher."""

    def __init__(self, cap_bytes: int, ranks: int, tag: str = ""):
        if not (CGROUP_ROOT / "cgroup.procs").is_file() or not os.access(CGROUP_ROOT, os.W_OK):
            raise CapError(f"{CGROUP_ROOT} is not a writable cgroup v1 memory controller; per-rank caps need it "
                           "(run as root on a host that mounts it, or cap GPU ranks with "
                           "torch.cuda.set_per_process_memory_fraction)")
        self.cap_bytes, self.ranks = int(cap_bytes), ranks
        self.prefix = f"nshard-cap-{os.getpid()}-{tag or int(time.time() * 1000) % 10**8}"
        self.groups = [CGROUP_ROOT / f"{self.prefix}-rank{r}" for r in range(ranks)]
        self._old_handlers: dict = {}

    @property
    def env(self) -> dict[str, str]:
        return {"NSHARD_CGROUP_ROOT": str(CGROUP_ROOT), "NSHARD_CGROUP_PREFIX": self.prefix,
                "NSHARD_PYTHON": sys.executable, "NSHARD_TRAIN": str(TRAIN)}

    def __enter__(self) -> "RankCaps":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for group in self.groups:
                group.mkdir()
                # No swap here, but keep the group off it anyway so the limit means resident memory.
                (group / "memory.swappiness").write_text("0")
                (group / "memory.limit_in_bytes").write_text(str(self.cap_bytes))
        except BaseException:
            self.remove()
            raise
        return self

    def _on_signal(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")  # unwinds through __exit__, which removes the groups

    def usage(self) -> list[RankUsage]:
        return [RankUsage(oom_kills(g), int((g / "memory.max_usage_in_bytes").read_text()),
                          int((g / "memory.failcnt").read_text())) for g in self.groups]

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
    return sorted(p for p in CGROUP_ROOT.glob(f"{prefix}*") if p.is_dir())


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
