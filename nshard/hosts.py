"""A preflight for real hosts, over the same plain `ssh HOST` that DeepSpeed's launcher uses:

    python -m nshard.hosts check --hostfile HOSTFILE --out DIR [--device auto|cuda|cpu]

Run it from the checkout, with the venv's python, on the machine that will launch. DeepSpeed's launcher
runs `cd <this directory>; <this python> -m deepspeed.launcher.launch ...` on every host, so every host must hold
the same checkout at the same path, on the same nshard commit, and the same venv with the same torch, deepspeed
and transformers. Each host must see as many GPUs as its slots, `--out` must be one shared directory (a file
written here is read there, and one written there is read here), and the interfaces that GLOO_SOCKET_IFNAME and
NCCL_SOCKET_IFNAME name (as the ranks will see them: .deepspeed_env over the launcher's NCCL_* over the host's
own) must exist. Each failure is one line naming the host and the fix; exit 1 if there is any, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

from nshard.cli import SPELLING_NOTE, ArgumentParser, prog

PACKAGES = ("torch", "deepspeed", "transformers")
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
NO_CHECKOUT, NO_PYTHON = 90, 91  # the remote shell's exit codes before the probe runs


def probe(checkout: str, out: str, token: str, label: str) -> dict:
    """What one host has. Runs on that host with the venv's python, from this very file sent over ssh: standard
    library and torch only, so a host whose checkout differs still answers."""
    import importlib.metadata
    import socket

    import hashlib

    def git(*args: str) -> bytes:
        done = subprocess.run(["git", "-C", checkout, *args], capture_output=True)
        return done.stdout.strip() if done.returncode == 0 else b""

    facts = {"python": sys.executable, "hostname": socket.gethostname(), "commit": git("rev-parse", "HEAD").decode(),
             "changes": hashlib.sha256(git("diff", "HEAD", "--binary")).hexdigest(),  # uncommitted edits, by content
             "versions": {}, "interfaces": sorted(name for _, name in socket.if_nameindex()),
             "env": {v: os.environ.get(v) for v in IFNAME_VARIABLES}}
    try:
        facts["hostname_address"] = socket.gethostbyname(facts["hostname"])
    except OSError:
        facts["hostname_address"] = None
    for package in PACKAGES:
        try:
            facts["versions"][package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            facts["versions"][package] = None
    try:
        import torch

        facts["versions"]["torch"] = torch.__version__  # the build too: 2.13.0+cu128 is not 2.13.0+cpu
        facts["gpus"] = torch.cuda.device_count()
    except ImportError:
        facts["gpus"] = None
    shared = Path(out) / f".nshard-preflight-{token}"
    try:
        facts["read"] = shared.read_text()
    except OSError as exc:
        facts["read"] = None
        facts["read_error"] = exc.strerror
    try:
        (Path(out) / f".nshard-preflight-{token}.{label}").write_text(label)
        facts["wrote"] = True
    except OSError as exc:
        facts["wrote"], facts["write_error"] = False, exc.strerror
    return facts


def ask(host: str, checkout: str, python: str, args: list[str]) -> tuple[int, str, str]:
    """Run the probe on `host` as DeepSpeed would reach it: plain ssh, the user's ssh configuration."""
    remote = (f"cd {shlex.quote(checkout)} 2>/dev/null || exit {NO_CHECKOUT}; "
              f"[ -x {shlex.quote(python)} ] || exit {NO_PYTHON}; exec {shlex.join([python, '-', *args])}")
    done = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", host, remote],
                          input=Path(__file__).read_text(), capture_output=True, text=True, timeout=120)
    return done.returncode, done.stdout, done.stderr


def deepspeed_env() -> dict[str, str]:
    """The variables DeepSpeed's launcher exports to every rank from .deepspeed_env (home, then here: here wins);
    a line it cannot split on '=' is an error here, as it would crash the launcher."""
    from nshard.run.hostfile import HostfileError

    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    found = {}
    for folder in (Path.home(), Path(".")):
        path = folder / name
        if not path.is_file():
            continue
        for lineno, line in enumerate(path.read_text().splitlines(keepends=True), start=1):
            if "=" not in line:
                raise HostfileError(f"{path}:{lineno}: {line.rstrip()!r} is not KEY=VALUE; DeepSpeed's launcher "
                                    "stops on such a line (blank lines included): remove it")
            key, value = line.split("=", 1)
            found[key] = value.strip()
    return found


def interface_problems(host: str, facts: dict, exported: dict[str, str]) -> list[str]:
    problems = []
    for variable in IFNAME_VARIABLES:
        value = exported.get(variable)
        if value is None and variable.startswith("NCCL"):
            value = os.environ.get(variable)  # DeepSpeed exports the launcher's NCCL_* on CUDA
        if value is None:
            value = facts["env"].get(variable)
        if not value or value.startswith("^"):  # unset, or NCCL's exclusion list: nothing named to look for
            continue
        exact = value.startswith("=") or variable.startswith("GLOO")
        for name in value.lstrip("=").split(","):
            have = facts["interfaces"]
            if not (name in have if exact else any(i.startswith(name) for i in have)):
                problems.append(f"{host}: {variable}={value} names no interface there (it has {', '.join(have)}): "
                                "set it in .deepspeed_env to an interface every host has")
    if not (exported.get("GLOO_SOCKET_IFNAME") or facts["env"].get("GLOO_SOCKET_IFNAME")) \
            and (facts.get("hostname_address") or "").startswith("127."):
        problems.append(f"{host}: GLOO_SOCKET_IFNAME is unset and its hostname {facts['hostname']} resolves to "
                        f"{facts['hostname_address']}, so gloo (nshard's long-wait group, CPU runs) would use loopback: "
                        "put GLOO_SOCKET_IFNAME=<interface> in .deepspeed_env")
    return problems


def compare(host: str, slots: int, facts: dict, here: dict, device: str, out: str, token: str) -> list[str]:
    """Every way `host` differs from the launching machine, one line each with the fix."""
    problems = []
    if facts["commit"] != here["commit"]:
        problems.append(f"{host}: checkout {here['checkout']} is at commit {facts['commit'][:12] or '(no git)'}, "
                        f"the launching machine's at {here['commit'][:12]}: git -C {here['checkout']} checkout "
                        f"{here['commit'][:12]} there")
    elif facts["changes"] != here["changes"]:
        problems.append(f"{host}: checkout {here['checkout']} holds other uncommitted changes than the launching "
                        "machine's (git diff HEAD differs): commit them and check out that commit on every host")
    for package in PACKAGES:
        theirs, ours = facts["versions"].get(package), here["versions"].get(package)
        if theirs != ours:
            problems.append(f"{host}: {package} {theirs or 'missing'} in {here['python']}, the launching machine has "
                            f"{ours}: install {package}=={ours} into that venv (CUDA torch: NSHARD_TORCH_INDEX with "
                            "launch/setup.sh)")
    if device == "cuda" and facts.get("gpus") != slots:
        problems.append(f"{host}: sees {facts.get('gpus')} GPU(s) for slots={slots}: set slots={facts.get('gpus')} in "
                        "the hostfile, or make that many GPUs visible there")
    if facts.get("read") != token:
        why = facts.get("read_error") or "other contents"
        problems.append(f"{host}: reads no file of the launching machine's in --out {out} ({why}): mount one shared "
                        f"filesystem at {out} on every host (each rank writes its receipts and ZeRO files there)")
    elif not facts.get("wrote"):
        problems.append(f"{host}: cannot write in --out {out} ({facts.get('write_error')}): make it writable there")
    return problems


def check(hostfile: str, out: str, device: str) -> list[str]:
    from nshard.run.hostfile import parse_hostfile
    from nshard.run.plan import REPO_ROOT

    hosts = parse_hostfile(hostfile)
    exported = deepspeed_env()
    Path(out).mkdir(parents=True, exist_ok=True)
    out = str(Path(out).resolve())
    token = uuid.uuid4().hex
    mine = Path(out) / f".nshard-preflight-{token}"
    mine.write_text(token)
    checkout, python = str(REPO_ROOT), sys.executable
    try:
        here = probe(checkout, out, token, "here")
        here.update(checkout=checkout)
        if device == "auto":
            device = "cuda" if here.get("gpus") else "cpu"
        problems = []
        for i, (host, slots) in enumerate(hosts.items()):
            label = f"host{i}"
            rc, stdout, stderr = ask(host, checkout, python, ["probe", checkout, out, token, label])
            if rc == 255:
                last = (stderr.strip().splitlines() or ["no answer"])[-1]
                problems.append(f"{host}: ssh {host} failed ({last}): set up passwordless ssh from this machine "
                                "(DeepSpeed's launcher runs plain `ssh HOST`)")
                continue
            if rc == NO_CHECKOUT:
                problems.append(f"{host}: no checkout at {checkout}: clone nshard at that same path there")
                continue
            if rc == NO_PYTHON:
                problems.append(f"{host}: no {python}: create the venv at that same path there "
                                f"(cd {checkout} && bash launch/setup.sh)")
                continue
            try:
                facts = json.loads(stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                last = (stderr.strip().splitlines() or [f"exit {rc}"])[-1]
                problems.append(f"{host}: the probe failed ({last}): run `{python} -c 'import torch'` there")
                continue
            found = compare(host, slots, facts, here, device, out, token)
            found += interface_problems(host, facts, exported)
            if not (Path(out) / f".nshard-preflight-{token}.{label}").is_file() and facts.get("wrote"):
                found.append(f"{host}: its file in --out {out} is not seen here: mount one shared filesystem at {out}")
            problems += found
            say(f"{host}: {'ok' if not found else f'{len(found)} problem(s)'} (commit {facts['commit'][:12]}, "
                f"torch {facts['versions'].get('torch')}, {facts.get('gpus')} GPU(s), slots={slots})")
        return problems
    finally:
        for path in Path(out).glob(f".nshard-preflight-{token}*"):
            path.unlink(missing_ok=True)


def say(message: str) -> None:
    print(f"nshard.hosts: {message}", flush=True)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["probe"]:  # on a host, sent by `check`
        print(json.dumps(probe(*args[1:5])))
        return 0
    from nshard.run.hostfile import HostfileError

    parsed = build_parser().parse_args(args)
    try:
        problems = check(parsed.hostfile, parsed.out, parsed.device)
    except (HostfileError, OSError) as exc:
        print(f"nshard: error: {exc}", file=sys.stderr)
        return 2
    for line in problems:
        print(f"nshard: preflight: {line}", file=sys.stderr)
    say("every host agrees" if not problems else f"{len(problems)} problem(s); fix each line above and run it again")
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    epilog = ("Writes nothing that stays: check leaves a probe file in --out on each host and removes it; it prints "
              "one line per problem on stderr. " + SPELLING_NOTE)
    parser = ArgumentParser(prog=prog("nshard.hosts"), description=__doc__, epilog=epilog)
    sub = parser.add_subparsers(dest="command", required=True)
    cmd = sub.add_parser("check", help="check every host of a hostfile before a launch")
    cmd.add_argument("--hostfile", required=True, help="the DeepSpeed hostfile the launch will use")
    cmd.add_argument("--out", required=True, help="the run or study directory the launch will write (shared)")
    cmd.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                     help="cuda: each host must see as many GPUs as its slots (auto: cuda if this machine has one)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
