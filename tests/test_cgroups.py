"""nshard/cgroups.py: the three ways to pin cores (cgroup v2, v1, CPU affinity) and the two to cap memory.

The v2 path cannot run on a machine that mounts cgroup v1's cpuset (a controller lives in one hierarchy at a time):
its logic (the files it writes, their values and their order) is checked on a directory laid out like a v2
hierarchy, which is pure logic, not a stand-in for the kernel. The v1 and affinity paths run for real where this
machine allows them, and the pinned process's cores are read back from /proc/<pid>/status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nshard import cgroups
from spawn import require

REPO = Path(__file__).resolve().parent.parent

HYBRID = """cgroup /sys/fs/cgroup/cpuset cgroup rw,nosuid,nodev,noexec,relatime,cpuset 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,nosuid,nodev,noexec,relatime,memory 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,nosuid,nodev,noexec,relatime 0 0
"""
UNIFIED = "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate 0 0\n"


def test_the_mounts_are_read_for_a_hybrid_and_a_unified_machine():
    hybrid = cgroups.read_mounts(HYBRID)
    assert hybrid.v2 == Path("/sys/fs/cgroup/unified")
    assert hybrid.v1 == {"cpuset": Path("/sys/fs/cgroup/cpuset"), "memory": Path("/sys/fs/cgroup/memory")}
    unified = cgroups.read_mounts(UNIFIED)
    assert unified.v2 == Path("/sys/fs/cgroup") and unified.v1 == {}


def fake_v2(root: Path, controllers: str = "cpuset cpu io memory pids", enabled: str = "cpu memory pids") -> cgroups.Mounts:
    """A directory laid out as the top of a v2 hierarchy: the files the code reads before it makes a group."""
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text(enabled + "\n")
    (root / "cpuset.mems.effective").write_text("0\n")
    return cgroups.Mounts(v2=root)


@pytest.mark.skipif(os.geteuid() != 0, reason="the fake tree is writable, but choose() asks for root's access")
def test_v2_is_chosen_first_and_writes_its_files_in_order_on_a_v2_tree(tmp_path):
    root, state = tmp_path / "v2", tmp_path / "state"
    state.mkdir()
    mounts = fake_v2(root)
    choice = cgroups.choose("cpuset", forced=None, mounts=mounts)
    assert (choice.mode, choice.hierarchy.root, choice.forced) == ("v2", root, False)
    assert choice.record()["by"] == f"cgroup v2's cpuset ({root})"
    group = root / "nshard-h1"
    # The parent hands cpuset to its children before the group exists; the cores, then the memory nodes, then the
    # process (a v1 group takes no task before both are set; v2 would inherit the nodes, but says them anyway).
    assert choice.hierarchy.steps("nshard-h1", "1") == [
        ("enable", root / "cgroup.subtree_control", "+cpuset"), ("mkdir", group, ""),
        ("write", group / "cpuset.cpus", "1"), ("write", group / "cpuset.mems", "0")]
    assert choice.hierarchy.make("nshard-h1", "1", state) == group
    choice.hierarchy.join("nshard-h1", 4242)
    assert (root / "cgroup.subtree_control").read_text() == "+cpuset"
    assert [(group / f).read_text() for f in ("cpuset.cpus", "cpuset.mems", "cgroup.procs")] == ["1", "0", "4242"]
    assert (state / "enabled-cpuset").read_text().strip() == str(root / "cgroup.subtree_control")
    assert choice.hierarchy.pids("nshard-h1") == [4242]
    # remove: the group goes (the kernel takes its interface files with it; here they are removed first), then the
    # controller the make enabled is handed back.
    for f in group.iterdir():
        f.unlink()
    assert cgroups.remove(["nshard-h1"], state, mounts=mounts) == [] and not group.exists()
    assert (root / "cgroup.subtree_control").read_text() == "-cpuset" and not (state / "enabled-cpuset").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="choose() asks for root's access to the fake tree")
def test_v2_memory_caps_write_memory_max_and_keep_swap_out_only_where_the_kernel_has_the_file(tmp_path):
    root = tmp_path / "v2"
    mounts = fake_v2(root, enabled="cpu memory")  # memory already handed down: nothing to enable
    choice = cgroups.choose("memory", mounts=mounts)
    group = root / "cap-rank0"
    assert choice.hierarchy.steps("cap-rank0", "1073741824") == [
        ("mkdir", group, ""), ("write", group / "memory.max", "1073741824"),
        ("write if present", group / "memory.swap.max", "0")]
    choice.hierarchy.make("cap-rank0", "1073741824")
    assert (group / "memory.max").read_text() == "1073741824" and not (group / "memory.swap.max").exists()
    assert (root / "cgroup.subtree_control").read_text() == "cpu memory\n"


def test_a_v2_tree_without_the_controller_is_passed_over_and_forcing_it_is_refused(tmp_path):
    mounts = fake_v2(tmp_path / "v2", controllers="cpu io memory pids")
    choice = cgroups.choose("cpuset", mounts=mounts)
    assert choice.mode == "affinity" and choice.hierarchy is None and not choice.forced
    assert choice.passed_over[0].startswith("v2: the cgroup v2 hierarchy at") and "no cpuset controller" in choice.passed_over[0]
    assert choice.passed_over[1] == "v1: no cgroup v1 hierarchy is mounted"
    with pytest.raises(cgroups.CgroupError, match=r"NSHARD_PLACEMENT_PIN=v2 cannot run here: .*no cpuset controller"):
        cgroups.choose("cpuset", forced="v2", mounts=mounts)
    with pytest.raises(cgroups.CgroupError, match=r"NSHARD_PLACEMENT_PIN='v3': use one of v2, v1, affinity"):
        cgroups.choose("cpuset", forced="v3", mounts=mounts)
    with pytest.raises(cgroups.CgroupError, match="no way to limit memory here: v2: .* no memory controller; v1: no"):
        cgroups.choose("memory", mounts=fake_v2(tmp_path / "v2-no-memory", controllers="cpu io pids"))  # no affinity


def test_the_kernel_lists_of_cores_are_read():
    assert cgroups.parse_cores("0,2-4,7\n") == [0, 2, 3, 4, 7] and cgroups.parse_cores("") == []
    assert cgroups.parse_cores(cgroups.allowed_cores()) == sorted(os.sched_getaffinity(0))


CHILD = ("import subprocess, sys; sys.stdin.readline(); "  # waits to be pinned, then starts a grandchild
         "print(subprocess.run(['cat', '/proc/self/status'], capture_output=True, text=True).stdout, flush=True)")


def pinned_and_inherited(mode: str, name: str) -> tuple[str, str, str]:
    """A child pinned to the last core this process may use by `mode`; what /proc/<pid>/status says the child may
    use, and what a process the child starts after that inherits."""
    core = str(sorted(os.sched_getaffinity(0))[-1])
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        how = cgroups.pin(mode, name, core, child.pid)
        own = cgroups.allowed_cores(child.pid)
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
        child.wait()
    inherited = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Cpus_allowed_list"))
    assert (own, inherited) == (core, core), (mode, own, inherited, core)
    return how, own, inherited


def test_affinity_pins_a_process_and_what_it_starts():
    require(len(os.sched_getaffinity(0)) >= 2, "two cores (pinning to the only one changes nothing)")
    assert pinned_and_inherited("affinity", "unused")[0] == "CPU affinity"


def test_the_machines_own_cgroup_cpuset_pins_a_process_and_what_it_starts(tmp_path):
    """The first cgroup mode this machine runs (v1 here; v2 where it has v2), for real: a group of its own name,
    removed again."""
    choice = cgroups.choose("cpuset", forced=None)
    require(choice.mode != "affinity" and len(os.sched_getaffinity(0)) >= 2,
            f"a writable cpuset controller and two cores ({'; '.join(choice.passed_over)})")
    name = f"nshard-test-{os.getpid()}"
    try:
        how = pinned_and_inherited(choice.mode, name)[0]
        assert how == f"cgroup {choice.mode} group {choice.hierarchy.root / name}"
    finally:
        left = cgroups.remove([name], tmp_path)
    assert left == [] and not (choice.hierarchy.root / name).exists()


def test_a_v2_memory_groups_usage_is_read_from_memory_events_and_peak(tmp_path):
    """launch/memcap.py's reading of a v2 group after the run (pure logic on the files a v2 kernel writes): OOM kills
    and times the limit was hit from memory.events, the peak from memory.peak (memory.current before kernel 5.19)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from launch.memcap import RankUsage, usage

    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n")
    (tmp_path / "memory.current").write_text("4096\n")
    assert usage(tmp_path, "v2") == RankUsage(oom_kills=1, max_usage_bytes=4096, failcnt=3)
    (tmp_path / "memory.peak").write_text("12345\n")
    assert usage(tmp_path, "v2") == RankUsage(oom_kills=1, max_usage_bytes=12345, failcnt=3)
