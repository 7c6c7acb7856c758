"""Cores and memory for a process tree, with what this Linux offers: a group of cgroup v2 (the unified hierarchy,
where its cgroup.controllers lists the controller), else a group of cgroup v1 (the controller's own mount), else,
for cores only, the CPU affinity, which every process started after it inherits. Standard library only:
launch/hosts.sh and launch/setup.sh run it with any python3, from the checkout's root.

    python3 -m nshard.cgroups mode cpuset|memory     # the mode this machine gives (or the variable forces)
    python3 -m nshard.cgroups pin MODE NAME CORES PID [--state DIR]   # PID, and all it starts, onto CORES
    python3 -m nshard.cgroups groups NAME...         # the groups of those names that exist, any hierarchy
    python3 -m nshard.cgroups pids NAME...           # the processes in them
    python3 -m nshard.cgroups remove NAME... [--state DIR]   # rmdir them; undo a controller `pin` enabled

`pin` writes the group's cgroup files (cpuset.cpus, cpuset.mems, cgroup.procs) or the process's affinity, and with
--state DIR a record of what it enabled there. Exit 2 with one line naming the fix when a forced mode cannot run
here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PIN_VARIABLE = "NSHARD_PLACEMENT_PIN"
"""Forces how the emulated hosts' cores are pinned: v2, v1 or affinity (unset: the first this machine allows)."""
MEMCAP_VARIABLE = "NSHARD_MEMCAP_CGROUP"
"""Forces which cgroup version launch/memcap.py caps ranks' memory with: v2 or v1 (unset: v2 where it can)."""
MODES = {"cpuset": ("v2", "v1", "affinity"), "memory": ("v2", "v1")}
VARIABLES = {"cpuset": PIN_VARIABLE, "memory": MEMCAP_VARIABLE}


class CgroupError(RuntimeError):
    """A mode that cannot run here, or a group that cannot be made; the message names the fix."""


@dataclass(frozen=True)
class Mounts:
    """Where the cgroup file systems are: the unified (v2) hierarchy, and each v1 controller's own mount."""

    v2: Path | None
    v1: dict = field(default_factory=dict)


def read_mounts(text: str | None = None) -> Mounts:
    """From /proc/self/mounts (or its text): the first cgroup2 mount, and the v1 mounts of cpuset and memory."""
    if text is None:
        try:
            text = Path("/proc/self/mounts").read_text()
        except OSError:
            text = ""
    v2, v1 = None, {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = Path(fields[1].replace("\\040", " "))
        if fields[2] == "cgroup2" and v2 is None:
            v2 = point
        elif fields[2] == "cgroup":
            for controller in MODES:
                if controller in fields[3].split(","):
                    v1.setdefault(controller, point)
    return Mounts(v2, v1)


def words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller's groups are made: directly under `root`, the v2 mount or the controller's v1 mount."""

    version: str
    root: Path
    controller: str

    def why_not(self) -> str | None:
        """Why no group of this controller can be made here (None: it can)."""
        if self.version == "v2":
            if self.controller not in words(self.root / "cgroup.controllers"):
                return f"the cgroup v2 hierarchy at {self.root} has no {self.controller} controller"
            subtree = self.root / "cgroup.subtree_control"
            if self.controller not in words(subtree) and not os.access(subtree, os.W_OK):
                return f"{subtree} does not enable {self.controller} and cannot be written (needs root)"
        elif not (self.root / "cgroup.procs").is_file():
            return f"{self.root} is not a cgroup v1 {self.controller} controller"
        if not os.access(self.root, os.W_OK):
            return f"{self.root} cannot be written (needs root)"
        return None

    def settings(self, value: str) -> list[tuple[str, str, bool]]:
        """(file, value, only if the kernel made that file) in the order they are written: the cores and memory
        nodes of a cpuset (a v1 group takes no task before both), or the memory limit with swap kept out."""
        if self.controller == "cpuset":
            mems = (self.root / ("cpuset.mems.effective" if self.version == "v2" else "cpuset.mems")).read_text()
            return [("cpuset.cpus", value, False), ("cpuset.mems", mems.strip(), False)]
        if self.version == "v2":  # memory.swap.max exists only with swap accounting
            return [("memory.max", value, False), ("memory.swap.max", "0", True)]
        return [("memory.swappiness", "0", False), ("memory.limit_in_bytes", value, False)]

    def steps(self, name: str, value: str) -> list[tuple[str, Path, str]]:
        """What making group `name` writes, in order: ("enable", subtree_control, "+controller") where a v2 parent
        does not yet hand the controller to its children, ("mkdir", group, ""), then ("write", file, value), or
        ("write if present", ...) for a file only some kernels make."""
        out = []
        if self.version == "v2" and self.controller not in words(self.root / "cgroup.subtree_control"):
            out.append(("enable", self.root / "cgroup.subtree_control", f"+{self.controller}"))
        group = self.root / name
        out.append(("mkdir", group, ""))
        out += [("write if present" if optional else "write", group / f, v) for f, v, optional in self.settings(value)]
        return out

    def make(self, name: str, value: str, state: Path | None = None) -> Path:
        """Make group `name` limited to `value` (cores "0,1" or bytes); a group half made is removed again. A
        controller it enabled in the parent is noted in `state` for remove() to undo."""
        group, made = self.root / name, False
        try:
            for kind, path, text in self.steps(name, value):
                if kind == "mkdir":
                    path.mkdir()  # an existing group of that name is someone else's: refused, left alone
                    made = True
                elif kind == "enable":
                    path.write_text(text)
                    if state is not None:
                        (state / f"enabled-{self.controller}").write_text(str(path) + "\n")
                elif kind == "write" or path.exists():
                    path.write_text(text)
        except OSError as exc:
            if made:
                with contextlib.suppress(OSError):
                    group.rmdir()
            raise CgroupError(f"could not make {group} ({exc.strerror or exc}); force another way with "
                              f"{VARIABLES[self.controller]}=" + ("affinity" if self.controller == "cpuset" else
                                                                  "v1 or v2")) from None
        return group

    def join(self, name: str, pid: int) -> None:
        (self.root / name / "cgroup.procs").write_text(str(pid))

    def pids(self, name: str) -> list[int]:
        return [int(p) for p in words(self.root / name / "cgroup.procs")]


def hierarchies(controller: str, mounts: Mounts | None = None) -> dict[str, Hierarchy]:
    """This machine's candidates for `controller`, by version (a version with no mount is left out)."""
    mounts = mounts or read_mounts()
    found = {}
    if mounts.v2 is not None:
        found["v2"] = Hierarchy("v2", mounts.v2, controller)
    if controller in mounts.v1:
        found["v1"] = Hierarchy("v1", mounts.v1[controller], controller)
    return found


@dataclass(frozen=True)
class Choice:
    """How `controller` is limited here: `mode` (v2, v1, affinity), its hierarchy (None for affinity), whether
    the environment forced it, and why each mode before it was passed over."""

    controller: str
    mode: str
    hierarchy: Hierarchy | None
    forced: bool
    passed_over: tuple = ()

    def words(self) -> str:
        """How the preflight, set-up and the report name it: "cgroup v1's cpuset (/sys/fs/cgroup/cpuset)"."""
        if self.hierarchy is None:
            return "CPU affinity" + (f" ({self.passed_over[-1]})" if self.passed_over and not self.forced else "") + (
                f", forced by {VARIABLES[self.controller]}" if self.forced else "")
        return f"cgroup {self.mode}'s {self.controller} ({self.hierarchy.root})" + (
            f", forced by {VARIABLES[self.controller]}" if self.forced else "")

    def record(self) -> dict:
        return {"mode": self.mode, "path": str(self.hierarchy.root) if self.hierarchy else None, "forced": self.forced,
                "by": self.words(), "passed_over": list(self.passed_over)}


def choose(controller: str, forced: str | None = None, mounts: Mounts | None = None) -> Choice:
    """The first mode of MODES[controller] this machine can run, or the one `forced` (default: the environment's
    variable) names, refused with the reason when it cannot run here."""
    if forced is None:
        forced = os.environ.get(VARIABLES[controller]) or None
    modes = MODES[controller]
    if forced is not None and forced not in modes:
        raise CgroupError(f"{VARIABLES[controller]}={forced!r}: use one of {', '.join(modes)} (or unset it)")
    found = hierarchies(controller, mounts)
    passed = []
    for mode in ([forced] if forced else modes):
        if mode == "affinity":
            why = None if hasattr(os, "sched_setaffinity") else "this system has no sched_setaffinity"
        else:
            why = found[mode].why_not() if mode in found else f"no cgroup {mode} hierarchy is mounted"
        if why is None:
            return Choice(controller, mode, found.get(mode), bool(forced), tuple(passed))
        passed.append(f"{mode}: {why}")
    if forced:
        raise CgroupError(f"{VARIABLES[controller]}={forced} cannot run here: {passed[0].split(': ', 1)[1]}; "
                          f"unset it to take the first of {', '.join(modes)} this machine allows")
    raise CgroupError(f"no way to limit {controller} here: " + "; ".join(passed))


def set_affinity(pid: int, cores: list[int]) -> None:
    """Every thread of `pid` onto `cores`; whatever it starts from now on inherits them."""
    tasks = Path(f"/proc/{pid}/task")
    for tid in sorted(int(t) for t in os.listdir(tasks)) if tasks.is_dir() else [pid]:
        os.sched_setaffinity(tid, cores)


def parse_cores(text: str) -> list[int]:
    """ "0,2-3" -> [0, 2, 3] (the kernel's list format, as in Cpus_allowed_list)."""
    cores = []
    for part in filter(None, text.strip().split(",")):
        low, _, high = part.partition("-")
        cores += range(int(low), int(high or low) + 1)
    return cores


def allowed_cores(pid: int | str = "self") -> str:
    """The process's Cpus_allowed_list from /proc/<pid>/status: the cores its cpuset and affinity leave it."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise CgroupError(f"/proc/{pid}/status has no Cpus_allowed_list line")


def pin(mode: str, name: str, cores: str, pid: int, state: Path | None = None) -> str:
    """Put `pid` (and everything it will start) on `cores` the way `mode` says; returns what was done."""
    if mode == "affinity":
        set_affinity(pid, parse_cores(cores))
        return "CPU affinity"
    hierarchy = hierarchies("cpuset").get(mode)
    if hierarchy is None:
        raise CgroupError(f"no cgroup {mode} hierarchy is mounted here; unset {PIN_VARIABLE} to take what this machine has")
    group = hierarchy.make(name, cores, state)
    hierarchy.join(name, pid)
    return f"cgroup {mode} group {group}"


def existing(names: list[str], controller: str = "cpuset", mounts: Mounts | None = None) -> list[tuple[Hierarchy, str]]:
    return [(h, n) for h in hierarchies(controller, mounts).values() for n in names if (h.root / n).is_dir()]


def remove(names: list[str], state: Path | None = None, controller: str = "cpuset", tries: int = 50,
           mounts: Mounts | None = None) -> list[str]:
    """rmdir each group (a group whose last process is still exiting is retried); then undo the controller that
    make() enabled in a v2 parent, where nothing else uses it. Returns the groups that would not go."""
    left = []
    for hierarchy, name in existing(names, controller, mounts):
        for _ in range(tries):
            try:
                (hierarchy.root / name).rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)
        else:
            left.append(str(hierarchy.root / name))
    marker = state / f"enabled-{controller}" if state else None
    if not left and marker and marker.is_file():
        try:
            Path(marker.read_text().strip()).write_text(f"-{controller}")
        except OSError:
            pass  # another group uses it now: it stays enabled, as it would be by systemd
        marker.unlink()
    return left


def build_parser():
    from nshard.cli import ArgumentParser

    parser = ArgumentParser(prog="python3 -m nshard.cgroups", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("mode")
    p.add_argument("controller", choices=sorted(MODES))
    p.add_argument("--words", action="store_true", help="say it in words, with why earlier modes were passed over")
    p = sub.add_parser("pin")
    p.add_argument("mode", choices=MODES["cpuset"])
    p.add_argument("name")
    p.add_argument("cores")
    p.add_argument("pid", type=int)
    p.add_argument("--state", type=Path)
    for command in ("groups", "pids", "remove"):
        p = sub.add_parser(command)
        p.add_argument("names", nargs="+")
        p.add_argument("--state", type=Path)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "mode":
            choice = choose(args.controller)
            print(choice.words() if args.words else choice.mode)
        elif args.command == "pin":
            print(pin(args.mode, args.name, args.cores, args.pid, args.state))
        elif args.command == "groups":
            print("\n".join(str(h.root / n) for h, n in existing(args.names)))
        elif args.command == "pids":
            print(" ".join(str(p) for h, n in existing(args.names) for p in h.pids(n)))
        else:
            left = remove(args.names, args.state)
            if left:
                print(f"cgroups: could not remove {', '.join(left)}; rmdir them once their processes are gone",
                      file=sys.stderr)
                return 1
    except (CgroupError, OSError) as exc:
        print(f"cgroups: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
