"""Where a study's arms run, and whether their times can be compared the way the reference compared them.

The reference study timed one GPU against two GPUs on two hosts: each rank had a host's compute to itself
and the two-rank arms talked over a link. `study.placement = "emulated"` rebuilds that on one machine:
launch/hosts.sh brings up two hosts (a network namespace each, `study.cores_per_host` cores each that the host's
sshd and everything it starts inherit, a link of `study.link` between them), the one-rank arm runs on the first host
and the two-rank arms across both, each through DeepSpeed's plain `deepspeed --hostfile` command. Everything is torn
down on every way out (error, Ctrl-C, SIGTERM). The cores are pinned by a cpuset group of cgroup v2, else v1, else by
the CPU affinity (nshard/cgroups.py; NSHARD_PLACEMENT_PIN forces one), and the placement records which.

Without root the emulated hosts cannot be made: the arms then run on this machine, and the placement says the
speed screen is not comparable, and why; the study says so before its first arm.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from nshard import cgroups
from nshard.run.plan import REPO_ROOT, Plan

HOSTS_SH = REPO_ROOT / "launch" / "hosts.sh"


class PlacementError(RuntimeError):
    """The emulated hosts could not be brought up or torn down; the message says what to do."""


def emulation_unavailable() -> str | None:
    """Why two hosts cannot be emulated here (None: they can)."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, veth, tc, sshd)"
    if not HOSTS_SH.is_file():
        return f"{HOSTS_SH} is missing (emulated hosts run from a checkout of nshard)"
    return None


def describe(plan: Plan, cuda: bool) -> dict:
    """The placement the study will use, with whether the speed screen can compare its arms (and why not).
    The reference timed two-rank arms whose ranks had a host each and talked over a link: an arm whose ranks
    all share one host (a one-host hostfile, localhost included, or local GPUs) is not timed that way."""
    study = plan.study
    shared = [a.name for a in study.arms if a.ranks > 1]
    if study.hostfile:
        from nshard.run.hostfile import parse_hostfile

        hosts = list(parse_hostfile(study.hostfile))
        one_host = len(hosts) == 1 and shared
        return {"kind": "hostfile", "hostfile": study.hostfile, "hosts": hosts, "link": None, "cores_per_host": None,
                "comparable": not one_host,
                "why": None if not one_host else (
                    f"every rank of {', '.join(shared)} ran on one host ({hosts[0]}, the only host in "
                    f"{study.hostfile}): no link lay between their ranks; list two hosts of one slot each "
                    "(launch/hostfile.two-hosts)")}
    if study.placement == "emulated":
        why = emulation_unavailable()
        if why is None:
            return {"kind": "emulated", "link": study.link, "cores_per_host": study.cores_per_host,
                    "pin": pin_choice(), "comparable": True, "why": None}
        return {"kind": "local", "requested": "emulated", "link": None, "cores_per_host": None, "comparable": False,
                "why": f"{why}; the arms ran on this machine, the two-rank arms splitting its cores with no link "
                       "between their ranks"}
    if cuda and not shared:
        return {"kind": "local", "link": None, "cores_per_host": None, "comparable": True, "why": None}
    if cuda:
        return {"kind": "local", "link": None, "cores_per_host": None, "comparable": False,
                "why": f"every rank of {', '.join(shared)} ran on this machine's GPUs: no link lay between their "
                       "ranks (study.hostfile with two hosts of one slot each times them as the reference did)"}
    return {"kind": "local", "link": None, "cores_per_host": None, "comparable": False,
            "why": "every rank ran on this machine's CPU: the two-rank arms split the cores the one-rank arm had to "
                   "itself, and no link lay between their ranks (study.placement = \"emulated\" times them as the "
                   "reference did)"}


def pin_choice() -> dict:
    """How the emulated hosts' cores will be pinned (cgroup v2, v1 or affinity), as nshard/cgroups.py chooses it; a
    NSHARD_PLACEMENT_PIN that cannot run here is refused before anything runs."""
    try:
        return cgroups.choose("cpuset").record()
    except cgroups.CgroupError as exc:
        raise PlacementError(str(exc)) from None


def preflight(placement: dict) -> tuple[str, str | None]:
    """Before the first arm: a line on where the arms will run and how their cores are held apart, and a warning
    when the speed screen will read NOT COMPARABLE (None when it can compare the arms)."""
    if placement["kind"] == "emulated":
        line = (f"placement: two emulated hosts, {placement['cores_per_host']} core(s) each pinned by "
                f"{placement['pin']['by']}, link {placement['link']}")
    elif placement["kind"] == "hostfile":
        line = f"placement: the hosts of {placement['hostfile']} ({', '.join(placement['hosts'])})"
    else:
        line = "placement: every rank on this machine" + (
            f" (asked: {placement['requested']})" if placement.get("requested") else "")
    if placement["comparable"]:
        return line + "; the speed screen can compare the arms", None
    return line, f"the speed screen will read NOT COMPARABLE: {placement['why']}"


def _hosts_sh(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(HOSTS_SH), *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


@contextlib.contextmanager
def emulated_hosts(link: str, cores_per_host: int, out: Path, pin_mode: str | None = None):
    """Bring up the two hosts, their cores pinned the way `pin_mode` says (v2, v1, affinity; None: as hosts.sh
    chooses, NSHARD_PLACEMENT_PIN included); yields {"all": hostfile of both, "first": hostfile of the first alone,
    "hosts": [...], "cores": [...], "pinned": [how each host's sshd was pinned]}. Torn down however the block ends; SIGTERM and SIGHUP end it like Ctrl-C does."""
    up = _hosts_sh("up", link, str(cores_per_host),
                   env={**os.environ, **({cgroups.PIN_VARIABLE: pin_mode} if pin_mode else {})})
    if up.returncode != 0:
        raise PlacementError(f"launch/hosts.sh up {link} {cores_per_host} failed: {up.stderr.strip()[-800:]}")

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        hostfile = Path(up.stdout.strip().splitlines()[-1])
        lines = [line for line in hostfile.read_text().splitlines() if line.strip()]
        folder = out / "hosts"
        folder.mkdir(parents=True, exist_ok=True)
        both, first = folder / "hostfile", folder / "hostfile-first"
        both.write_text("\n".join(lines) + "\n")
        first.write_text(lines[0] + "\n")
        cores = [(hostfile.parent / f"cores-{i + 1}").read_text().strip() for i in range(len(lines))]
        pinned = [(hostfile.parent / f"pin-{i + 1}").read_text().strip() for i in range(len(lines))]
        yield {"all": both, "first": first, "hosts": [line.split()[0] for line in lines], "cores": cores,
               "pinned": pinned}
    finally:
        down = _hosts_sh("down")
        for s, handler in previous.items():
            signal.signal(s, handler)
        if down.returncode != 0:
            raise PlacementError(f"launch/hosts.sh down failed: {down.stderr.strip()[-800:]}; run it by hand")
