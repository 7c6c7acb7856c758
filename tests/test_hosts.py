"""Two emulated hosts (launch/hosts.sh): DeepSpeed's plain multi-node command over ssh, one rank per
network namespace, the kernel's byte counters against the reducer's ledger, and nothing left behind. Every test
that brings the pair up is here (its namespace names are machine-wide, so these tests take turns: pytest-xdist
keeps a file on one worker), the launch/ benchmarks over a shaped link included."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from runs import DEEPSPEED, REPO, receipts, run_env, tiny_config
from spawn import free_port, require
from test_launch_scripts import script

HOSTS_SH = REPO / "launch" / "hosts.sh"
NAMESPACES = {"198.51.100.1": "nshard-h1", "198.51.100.2": "nshard-h2"}
LINKS = ("nshard-h1", "nshard-h2", "nshard-v1", "nshard-v2", "nshard-br")
USER_SSH_CONFIG = Path.home() / ".ssh" / "config"
CPUSETS = Path("/sys/fs/cgroup/cpuset")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces, veth and sshd need root (the not-root test drops it with setpriv)")


def hosts_sh(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(HOSTS_SH), *args], capture_output=True, text=True, timeout=timeout)


def in_namespace(ns: str, *cmd) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, check=True).stdout.strip()


def what_is_left() -> list[str]:
    """Every namespace, link, sshd, ssh-config line or state file that hosts.sh makes and that still exists."""
    left = [f"netns {n}" for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
            if n.startswith("nshard-")]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left += [f"link {name}" for name in LINKS if f" {name}:" in links or f" {name}@" in links]
    state = str(REPO / "runs" / "hosts")
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and any(state in a for a in proc.info["cmdline"] or ()):
            left.append(f"process {proc.pid} {proc.info['name']}")
    if USER_SSH_CONFIG.exists() and state in USER_SSH_CONFIG.read_text():
        left.append(f"Include line in {USER_SSH_CONFIG}")
    if Path(state).exists():
        left.append(state)
    left += [f"cpuset {g}" for g in sorted(CPUSETS.glob("nshard-h*"))]
    return left


def assert_nothing_left():
    for _ in range(50):  # an sshd that was just killed keeps its veth for a moment
        left = what_is_left()
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"left behind: {left}")


@pytest.fixture
def user_ssh_config():
    """~/.ssh/config must read the same after down as before up, whatever it held."""
    before = USER_SSH_CONFIG.read_text() if USER_SSH_CONFIG.exists() else None
    yield
    after = USER_SSH_CONFIG.read_text() if USER_SSH_CONFIG.exists() else None
    assert after == before


@pytest.fixture
def hosts(user_ssh_config):
    assert not what_is_left(), "another emulated pair is up (the addresses are fixed): run launch/hosts.sh down"
    up = hosts_sh("up")
    try:
        assert up.returncode == 0, up.stderr
        yield Path(up.stdout.strip().splitlines()[-1])
    finally:
        down = hosts_sh("down")
        assert down.returncode == 0, down.stderr
        # down returns only once every process it started is gone (the links may take a moment longer)
        assert not [x for x in what_is_left() if x.startswith("process")]
        assert_nothing_left()


def tx_bytes(ns: str) -> int:
    return int(in_namespace(ns, "cat", "/sys/class/net/eth0/statistics/tx_bytes"))


@pytest.mark.slow
def test_plain_deepspeed_command_runs_one_rank_per_host(hosts, tmp_path):
    assert hosts.read_text().split("\n")[:2] == ["198.51.100.1 slots=1", "198.51.100.2 slots=1"]
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(tiny_config(nshard={"reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1})))
    out = tmp_path / "run"
    outside_before = {ns: tx_bytes(ns) for ns in NAMESPACES.values()}
    # The plain form: no --no_ssh_check, no --master_addr; pdsh ssh-es to each host from the repo root.
    cmd = [DEEPSPEED, "--hostfile", str(hosts), "--master_port", str(free_port()), "nshard/train.py",
           "--ds_config", str(config), "--plan", "launch/plans/tiny.toml", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    outside = {ns: tx_bytes(ns) - outside_before[ns] for ns in NAMESPACES.values()}

    run = json.loads((out / "run.json").read_text())
    rs = receipts(out)
    assert run["status"] == "complete" and run["world_size"] == 2
    assert {r["parameter_root"] for r in rs} == {run["parameter_root"]}
    # Each rank ran in its own namespace: its address there, and that namespace's kernel id.
    assert [r["host"] for r in rs] == list(NAMESPACES)  # rank 0 on the first host of the hostfile
    for r in rs:
        assert r["net_namespace"] == in_namespace(NAMESPACES[r["host"]], "readlink", "/proc/self/ns/net")
    assert rs[0]["net_namespace"] != rs[1]["net_namespace"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rs:
        link = r["link"]
        assert r["update_compressed"] == [False, True, True]  # dense and compressed updates crossed the link
        assert link["interface"] == "eth0" and link["ledger_bytes"] == sum(m["reducer_bytes"] for m in metrics) > 0
        assert link["ledger_matches_logger"] is True
        # The kernel counted the ledger's bytes plus protocol overhead (under 5%), within what the
        # namespace sent in the whole run as seen from outside it.
        assert link["ledger_bytes"] <= link["kernel_tx_bytes"] <= 1.05 * link["ledger_bytes"], link
        assert link["kernel_tx_bytes"] <= outside[NAMESPACES[r["host"]]]
        assert link["agree"] is True
    assert "byte counts disagree" not in proc.stderr + proc.stdout


def test_down_cleans_up_after_a_crashed_up(user_ssh_config):
    assert not what_is_left(), "another emulated pair is up (the addresses are fixed): run launch/hosts.sh down"
    up = subprocess.Popen(["bash", str(HOSTS_SH), "up", "100mbit"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not Path("/run/netns/nshard-h1").exists() and up.poll() is None:
            time.sleep(0.005)
        up.kill()  # SIGKILL: no trap runs
        up.wait()
        assert what_is_left(), "up was killed before it made anything; nothing to clean"
    finally:
        down = hosts_sh("down")
    assert down.returncode == 0, down.stderr
    assert_nothing_left()


def test_ctrl_c_during_up_tears_everything_down(user_ssh_config):
    assert not what_is_left(), "another emulated pair is up (the addresses are fixed): run launch/hosts.sh down"
    # Ctrl-C signals the terminal's foreground process group, whose shell starts with SIGINT neither ignored
    # nor blocked. A suite may inherit either: started in the background (`cmd &` in a script) it ignores
    # SIGINT, and bash can neither trap nor reset a signal ignored on entry; a CI runner may block it, and
    # the blocked mask survives exec, so the signal stays pending while `up` finishes. So `up` starts as a
    # terminal's shell would, in its own group.
    def as_from_a_terminal():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    up = subprocess.Popen(["bash", str(HOSTS_SH), "up"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, preexec_fn=as_from_a_terminal)
    try:
        while not Path("/run/netns/nshard-h1").exists() and up.poll() is None:
            time.sleep(0.005)
        os.killpg(up.pid, signal.SIGINT)
        _, err = up.communicate(timeout=60)
        assert up.returncode != 0 and "tearing down" in err, err
        assert_nothing_left()
    finally:
        hosts_sh("down")


def test_up_refuses_a_bad_rate_and_a_pair_already_up(user_ssh_config):
    bad = hosts_sh("up", "fast")
    assert bad.returncode == 2 and "not a tc rate" in bad.stderr
    assert not what_is_left()
    subprocess.run(["ip", "netns", "add", "nshard-h2"], check=True)  # what a crashed up could leave
    try:
        again = hosts_sh("up")
        assert again.returncode == 2 and "launch/hosts.sh down" in again.stderr
    finally:
        assert hosts_sh("down").returncode == 0
    assert_nothing_left()


@pytest.mark.skipif(not CPUSETS.is_dir(), reason="no cgroup v1 cpuset controller")
def test_each_host_gets_its_own_core_and_everything_it_starts_inherits_it(user_ssh_config):
    """up none 1: each sshd in a cpuset of one core of its own; a process started over ssh sees that core only
    (os.cpu_count() still says the machine's count: nshard sizes threads from the affinity); down removes the
    groups."""
    assert not what_is_left(), "another emulated pair is up: run launch/hosts.sh down"
    cores = sorted(os.sched_getaffinity(0))
    require(len(cores) >= 2, "needs two cores")
    up = hosts_sh("up", "none", "1")
    try:
        assert up.returncode == 0, up.stderr
        seen = {}
        for i, host in enumerate(NAMESPACES, start=1):
            assert (CPUSETS / f"nshard-h{i}" / "cpuset.cpus").read_text().strip() == str(cores[i - 1])
            pid = (REPO / "runs" / "hosts" / f"sshd-{i}.pid").read_text().strip()
            assert pid in (CPUSETS / f"nshard-h{i}" / "tasks").read_text().split()
            seen[host] = subprocess.run(["ssh", "-o", "BatchMode=yes", host, "python3", "-c",
                                         "'import os; print(sorted(os.sched_getaffinity(0)))'"],
                                        capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        assert seen == {host: f"[{cores[i]}]" for i, host in enumerate(NAMESPACES)}
    finally:
        down = hosts_sh("down")
        assert down.returncode == 0, down.stderr
    assert_nothing_left()


def test_up_refuses_more_cores_than_the_machine_has(user_ssh_config):
    bad = hosts_sh("up", "none", str(len(os.sched_getaffinity(0))))
    assert bad.returncode == 2 and "needs" in bad.stderr and "this machine has" in bad.stderr
    assert hosts_sh("up", "none", "x").returncode == 2
    assert_nothing_left()


@pytest.mark.slow
@pytest.mark.skipif(not CPUSETS.is_dir(), reason="no cgroup v1 cpuset controller")
def test_a_study_with_emulated_placement_runs_each_arm_as_the_reference_did(user_ssh_config, tmp_path):
    """The tiny study on two emulated hosts (a core each, a 1gbit link): the one-rank arm on the first host,
    the two-rank arms across both, each rank on its own core; the speed screen compares them; nothing left."""

    assert not what_is_left(), "another emulated pair is up: run launch/hosts.sh down"
    (tmp_path / "dense.json").write_text(json.dumps(tiny_config("dense")))
    (tmp_path / "powersgd.json").write_text(json.dumps(tiny_config("dense", nshard={
        "reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1})))
    arms = "".join(f'\n[[study.arms]]\nname = "{n}"\nranks = {r}\nds_config = "{tmp_path / c}"\n'
                   for n, r, c in (("one-rank", 1, "dense.json"), ("dense", 2, "dense.json"),
                                   ("powersgd", 2, "powersgd.json")))
    plan = tmp_path / "tiny-emulated.toml"
    plan.write_text((REPO / "launch/plans/tiny.toml").read_text()
                    + '\n[study]\ncandidate = "powersgd"\nspeed_baseline = "one-rank"\neval_max_new_tokens = 8\n'
                    + 'placement = "emulated"\nlink = "1gbit"\ncores_per_host = 1\n' + arms)
    out = tmp_path / "out"
    # A cache of its own: the study fills it before the hosts come up (the tiny model), so an arm that still
    # filled a cache would say so in its receipts.
    proc = subprocess.run([sys.executable, "-m", "nshard.study", "--plan", str(plan), "--out", str(out)], cwd=REPO,
                          env=run_env({"NSHARD_CACHE": str(tmp_path / "cache")}), capture_output=True, text=True,
                          timeout=1200)
    assert_nothing_left()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    study = json.loads((out / "study.json").read_text())
    placement = study["placement"]
    assert placement["kind"] == "emulated" and placement["comparable"] and placement["link"] == "1gbit"
    assert placement["hosts"] == list(NAMESPACES) and len(set(placement["cores"])) == 2
    one = receipts(out / "arms" / "one-rank")
    assert [r["host"] for r in one] == ["198.51.100.1"]
    for arm in ("dense", "powersgd"):
        rs = receipts(out / "arms" / arm)
        assert [r["host"] for r in rs] == list(NAMESPACES) and rs[0]["net_namespace"] != rs[1]["net_namespace"]
        assert all(r["link"]["kernel_tx_bytes"] > 0 for r in rs)
    results = json.loads((out / "results.json").read_text())
    speed = results["screens"]["speed"]
    assert speed["comparable"] and isinstance(speed["passed"], bool)
    dense_gb = next(a for a in results["arms"] if a["name"] == "dense")["execution"]["kernel_tx_bytes"]
    psgd_gb = next(a for a in results["arms"] if a["name"] == "powersgd")["execution"]["kernel_tx_bytes"]
    assert 0 < psgd_gb < dense_gb
    report = (out / "report.md").read_text()
    assert "Placement: two emulated hosts on one machine, 1 core(s) each, link 1gbit." in report
    assert "emulated hosts down" in proc.stdout
    # Issue 25: a warm-up launch across both hosts before the first arm, so no arm pays a one-time cost the
    # others skip; every arm's start-up is in its receipts and the report.
    assert study["warm_up"]["ranks"] == 2 and not (out / "warm-up").exists() and "hosts warmed up" in proc.stdout
    for arm in ("one-rank", "dense", "powersgd"):
        for r in receipts(out / "arms" / arm):
            assert r["startup"]["one_time_work"] == [], (arm, r["startup"])
            assert 0 < r["startup"]["s"] < r["process_s"] and r["process_start_at"] > 0
        execution = next(a for a in results["arms"] if a["name"] == arm)["execution"]
        assert execution["launch_s"] > 0 and execution["teardown_s"] > 0
    assert "| One-time work inside the arm | none | none | none |" in report
    assert "| Start-up: process start to first update (slowest rank) |" in report


def test_without_root_an_emulated_placement_runs_locally_and_says_the_speed_screen_is_not_comparable(tmp_path):
    """describe() run as an unprivileged user (setpriv to nobody): the arms would run on this machine, and the
    placement says the speed screen is not comparable, and why."""
    import shutil

    require(shutil.which("setpriv") is not None, "no setpriv")
    plan = (REPO / "launch/plans/tiny.toml").read_text() + '\n[study]\nplacement = "emulated"\nlink = "1gbit"\n'
    # The plan goes in on stdin: the unprivileged process cannot read root's pytest directories.
    code = ("import json, pathlib, shutil, sys, tempfile; from nshard.run.plan import load_plan; "
            "from nshard.study.placement import describe; d = pathlib.Path(tempfile.mkdtemp()); "
            "(d / 'plan.toml').write_text(sys.stdin.read()); "
            "print(json.dumps(describe(load_plan(d / 'plan.toml'), cuda=False))); shutil.rmtree(d)")
    proc = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
                           code], cwd=REPO, input=plan, capture_output=True, text=True, timeout=120,
                          env={**run_env(), "HOME": "/nonexistent", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    placement = json.loads(proc.stdout)
    assert placement["kind"] == "local" and placement["requested"] == "emulated"
    assert placement["comparable"] is False and "need root" in placement["why"]


def preflight(hostfile: Path, out: Path, env: dict | None = None, args=()) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-m", "nshard.hosts", "check", "--hostfile",
                           str(hostfile), "--out", str(out), "--device", "cpu", *args], cwd=REPO,
                          env={**run_env(), **(env or {})}, capture_output=True, text=True, timeout=300)


@contextlib.contextmanager
def bound_in_host(pid: int, source: Path, target: Path):
    """Bind-mount `source` over `target` inside one emulated host's mount namespace (its sshd's, which
    `ip netns exec` made as a slave of this one): what that host's sessions see changes, nothing else does."""
    assert os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt"), "sshd shares our mount namespace"
    before = os.stat(target)
    subprocess.run(["nsenter", "-t", str(pid), "-m", "mount", "--bind", str(source), str(target)], check=True)
    try:
        after = os.stat(target)
        assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino), "the bind mount reached this namespace"
        yield
    finally:
        subprocess.run(["nsenter", "-t", str(pid), "-m", "umount", str(target)], check=True)


def test_the_preflight_passes_on_the_pair_and_names_the_host_whose_checkout_differs(hosts, tmp_path):
    """python -m nshard.hosts check over the emulated hosts' ssh: both agree; then the second host's checkout
    points at another commit (its .git, in its own mount namespace) and .deepspeed_env names a missing interface:
    one line per problem, each naming its host."""
    out = tmp_path / "shared-out"
    ok = preflight(hosts, out)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "198.51.100.1: ok" in ok.stdout and "198.51.100.2: ok" in ok.stdout and "every host agrees" in ok.stdout
    assert not list(out.glob(".nshard-preflight-*")), "the preflight left its files in --out"

    other = tmp_path / "other-checkout"
    # A clone of its own (no alternates that would point back at the .git it is mounted over).
    subprocess.run(["git", "clone", "-q", "--no-local", str(REPO), str(other)], check=True)
    subprocess.run(["git", "-C", str(other), "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q",
                    "--allow-empty", "-m", "another commit"], check=True)
    # A clone keeps .git as a directory, a worktree as a file naming its gitdir: mount the same kind over it.
    if (REPO / ".git").is_dir():
        gitfile = other / ".git"
    else:
        gitfile = tmp_path / "gitfile"
        gitfile.write_text(f"gitdir: {other / '.git'}\n")
    dsenv = tmp_path / "deepspeed_env"
    dsenv.write_text("GLOO_SOCKET_IFNAME=eth9\n")
    sshd = int((REPO / "runs" / "hosts" / "sshd-2.pid").read_text())
    with bound_in_host(sshd, gitfile, REPO / ".git"):
        bad = preflight(hosts, out, env={"DS_ENV_FILE": str(dsenv)})
    assert bad.returncode == 1, bad.stdout + bad.stderr
    lines = [line for line in bad.stderr.splitlines() if line.startswith("nshard: preflight: ")]
    assert len(lines) == 3, bad.stderr
    assert [l for l in lines if "commit" in l] == [l for l in lines if l.startswith("nshard: preflight: 198.51.100.2: checkout")]
    assert "the launching machine's at" in lines[-2] or "the launching machine's at" in lines[-1]
    assert sum("GLOO_SOCKET_IFNAME=eth9 names no interface there (it has eth0, lo)" in l for l in lines) == 2
    assert not list(out.glob(".nshard-preflight-*"))

    # With a plan: its data files must be on every host with the same bytes (every rank reads them itself). The
    # files lie outside the checkout, so that only the data check can see a difference.
    chat, plan = tmp_path / "chat_train.jsonl", tmp_path / "tiny-chat.toml"
    chat.write_text((REPO / "launch/data/chat_train.jsonl").read_text())
    plan.write_text((REPO / "launch/plans/tiny-chat.toml").read_text()
                    .replace('"launch/data/chat_train.jsonl"', f'"{chat}"')
                    .replace('"launch/data/', f'"{REPO}/launch/data/'))
    ok = preflight(hosts, out, args=["--plan", str(plan)])
    assert ok.returncode == 0, ok.stdout + ok.stderr
    other = tmp_path / "other_chat_train.jsonl"
    other.write_text(chat.read_text().splitlines(keepends=True)[0])
    with bound_in_host(sshd, other, chat):
        bad = preflight(hosts, out, args=["--plan", str(plan)])
    lines = [line for line in bad.stderr.splitlines() if line.startswith("nshard: preflight: ")]
    assert bad.returncode == 1 and len(lines) == 1, bad.stdout + bad.stderr
    assert lines[0].startswith(f"nshard: preflight: 198.51.100.2: data.chat_train {chat} differs from the launching "
                               "machine's (sha256 ")
    assert not list(out.glob(".nshard-preflight-*"))
    from nshard.files import cache_root
    assert not list(cache_root().glob(".nshard-preflight-*")), "the preflight left its file in the cache"


@pytest.mark.slow
def test_bench_link_runs_one_round_on_the_tiny_model(tmp_path):
    out = tmp_path / "bench_link"
    proc = script("launch.bench_link", "--rates", "1gbit", "--models", "tiny", "--updates", "1", "--rank", "4",
                  "--out", str(out))
    report = json.loads((out / "bench_link.json").read_text())
    arms = report["models"]["tiny"]["rates"]["1gbit"]["arms"]
    assert {"dense", "nshard", "hook"} <= set(arms) and (out / "bench_link.png").stat().st_size > 1000
    assert "wrote" in proc.stdout


@pytest.mark.slow
def test_bench_pooled_runs_two_arms_of_the_tiny_plan_over_a_shaped_link(tmp_path):
    out = tmp_path / "bench_pooled"
    proc = script("launch.bench_pooled", "--plan", "launch/plans/tiny.toml", "--updates", "2", "--rank", "4",
                  "--link", "100mbit", "--arms", "s2-powersgd@one,s2-powersgd-delta4", "--out", str(out))
    rows = {r["arm"]: r for r in json.loads((out / "bench_pooled.json").read_text())["arms"]}
    assert all(r["ranks_agree"] for r in rows.values())
    dense, delta = rows["s2-powersgd@one"], rows["s2-powersgd-delta4"]
    # "@one" reached both remote ranks through the launcher: their rings shared one connection per pair.
    assert dense["ring_connections"] == ["one per pair of ranks"] and delta["ring_connections"] == ["one per direction"]
    assert delta["grad_bytes_per_update"] == dense["grad_bytes_per_update"]
    assert 0 < delta["parameter_bytes_per_update"] < dense["parameter_bytes_per_update"] / 6  # fp32 vs 4 bits + scales
    assert delta["delta_gap_max"] > 0 and dense["delta_gap_max"] is None
    assert "| s2-powersgd-delta4 |" in proc.stdout


@pytest.mark.slow
def test_bench_duplex_times_each_way_of_a_ring_step_over_a_shaped_link(tmp_path):
    out = tmp_path / "bench_duplex"
    proc = script("launch.bench_duplex", "--link", "1gbit", "--mib", "1", "--repeats", "2", "--idle_s", "0",
                  "--out", str(out))
    body = json.loads((out / "bench_duplex.json").read_text())
    assert set(body["seconds"]) == {"one", "two", "all_reduce"}
    assert all(len(t) == 2 and all(s > 0 for s in t) for t in body["seconds"].values())
    assert "| two |" in proc.stdout and "mean vs two" in proc.stdout
