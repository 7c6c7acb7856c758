"""A preflight for real hosts, over the same plain `ssh HOST` that DeepSpeed's launcher uses:

    .venv/bin/python -m nshard.hosts check --hostfile HOSTFILE --out DIR [--plan PLAN] [--device auto|cuda|cpu]

Run it from the directory you will launch from, with the venv's python, on the machine that will launch.
DeepSpeed's launcher runs `cd <this directory>; <this python> -m deepspeed.launcher.launch ...` on every host, so
every host must hold this directory and the same checkout at the same path, on the same nshard commit, and the same
venv with the same torch, deepspeed and transformers. Each host must see at least as many GPUs as its slots (its
ranks use GPUs 0 to slots-1 unless the launch names others with --include), `--out` must be one shared directory (a
file written here is read there, and one written there is read here), and the interfaces that GLOO_SOCKET_IFNAME
and NCCL_SOCKET_IFNAME name (as the ranks will see them: .deepspeed_env over the launcher's NCCL_* over the host's
own) must exist.

The cache variables (NSHARD_CACHE, HF_HOME) must read the same in this shell, where the study process and its
one-rank arm run, as in .deepspeed_env, which only the launched ranks read; NSHARD_CACHE must be one directory that
every host shares, since the study fills it once before its first arm. With --plan, the plan is checked as a run
would check it, and every file it names (the plan itself, data.chat_train, data.chat_heldout, data.replay_file, a
local model.spec) must be on every host, at the same path, with the same bytes: every rank reads them itself. A hub
model.spec must be in each host's Hugging Face cache, or HF_HOME must be shared.

Each failure is one line naming the host and the fix; exit 1 if there is any, 2 on bad input.
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
from nshard.log import log

PACKAGES = ("torch", "deepspeed", "transformers")
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
CACHE_VARIABLES = ("NSHARD_CACHE", "HF_HOME")
NO_CHECKOUT, NO_PYTHON = 90, 91  # the remote shell's exit codes before the probe runs


def probe(checkout: str, out: str, token: str, label: str, wanted: str = "{}") -> dict:
    """What one host has. Runs on that host with the venv's python, from this very file sent over ssh: standard
    library and torch only, so a host whose checkout differs still answers. `wanted` (JSON) names what the launch
    will need there: files by plan key, the cache variables as the ranks will see them, a launch directory and a
    hub model."""
    import importlib.metadata
    import socket

    import hashlib

    wanted = json.loads(wanted)
    for variable, value in (wanted.get("env") or {}).items():  # .deepspeed_env's values, as the ranks get them
        os.environ[variable] = value

    def fingerprint(path: str) -> str | None:
        """A file's sha256; a directory's, over its files' relative names and sizes (a model directory of many
        GB is not read whole); None when missing."""
        target = Path(path)
        if target.is_file():
            digest = hashlib.sha256()
            with open(target, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            return digest.hexdigest()
        if target.is_dir():
            listing = sorted(f"{p.relative_to(target)} {p.stat().st_size}" for p in target.rglob("*") if p.is_file())
            return "dir:" + hashlib.sha256("\n".join(listing).encode()).hexdigest()
        return None

    def read_token(folder: str | None) -> bool:
        try:
            return bool(folder) and (Path(folder) / f".nshard-preflight-{token}").read_text() == token
        except OSError:
            return False

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
    facts["files"] = {key: fingerprint(path) for key, path in (wanted.get("files") or {}).items()}
    facts["cwd_exists"] = Path(wanted.get("cwd") or checkout).is_dir()
    cache = os.environ.get("NSHARD_CACHE") or str(Path.home() / ".cache" / "nshard")
    facts["cache"] = {"NSHARD_CACHE": cache, "shared": read_token(cache)}
    if wanted.get("hub_model"):
        hf_home = os.environ.get("HF_HOME") or str(Path.home() / ".cache" / "huggingface")
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = isinstance(try_to_load_from_cache(wanted["hub_model"], "config.json"), str)
        except Exception:  # noqa: BLE001 -- an old or missing huggingface_hub: not cached, as far as we can tell
            cached = False
        facts["hub"] = {"HF_HOME": hf_home, "cached": cached, "shared": read_token(hf_home)}
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
    if device == "cuda" and (facts.get("gpus") or 0) < slots:
        problems.append(f"{host}: sees {facts.get('gpus')} GPU(s) for slots={slots}: set slots={facts.get('gpus')} in "
                        "the hostfile, or make that many GPUs visible there")
    if not facts.get("cwd_exists", True):
        problems.append(f"{host}: has no directory {here['cwd']}, where DeepSpeed's launcher runs `cd {here['cwd']}` "
                        f"before starting its ranks: launch from the checkout ({here['checkout']}), or make that path "
                        "there")
    for key, theirs in (facts.get("files") or {}).items():
        path, ours = here["wanted"]["files"][key], here["files"].get(key)
        if theirs is None:
            problems.append(f"{host}: {key} {path} is missing there: every rank reads it itself, so copy it to the "
                            "same path on every host, or keep it on the shared filesystem")
        elif ours is not None and theirs != ours:
            problems.append(f"{host}: {key} {path} differs from the launching machine's (sha256 {theirs[:12]} there, "
                            f"{ours[:12]} here): copy the same file there")
    cache = facts.get("cache") or {}
    if cache and not cache.get("shared"):
        problems.append(f"{host}: NSHARD_CACHE ({cache.get('NSHARD_CACHE')} as its ranks see it) is not the launching "
                        f"machine's cache {here['cache']['NSHARD_CACHE']} (it reads no file written there): the study "
                        "fills that cache once before its first arm, so mount one shared directory at the same path on "
                        "every host and set NSHARD_CACHE to it, in .deepspeed_env and in this shell")
    hub = facts.get("hub")
    if hub and not hub["cached"] and not hub["shared"]:
        model = here["wanted"]["hub_model"]
        problems.append(f"{host}: {model} is not in its Hugging Face cache (HF_HOME={hub['HF_HOME']}), which the "
                        "launching machine does not share: its ranks would download it inside the first timed arm. "
                        "Share HF_HOME (in .deepspeed_env and in this shell), or download it there first: "
                        f".venv/bin/python -c \"from huggingface_hub import snapshot_download; "
                        f"snapshot_download('{model}')\"")
    if facts.get("read") != token:
        why = facts.get("read_error") or "other contents"
        problems.append(f"{host}: reads no file of the launching machine's in --out {out} ({why}): mount one shared "
                        f"filesystem at {out} on every host (each rank writes its receipts and ZeRO files there)")
    elif not facts.get("wrote"):
        problems.append(f"{host}: cannot write in --out {out} ({facts.get('write_error')}): make it writable there")
    return problems


def plan_inputs(plan_path: str) -> dict:
    """What a plan makes every rank read: the plan file and the data files it names, resolved as a run resolves
    them from this directory (nshard.run.plan.find_beside), and its model: a local directory, or a hub id that each
    host must find in its cache. The plan is checked first (a PlanError is bad input)."""
    from nshard.run.models import spec_kind
    from nshard.run.plan import load_plan

    plan = load_plan(plan_path)
    files = {"plan": str(Path(plan_path).resolve())}
    for key in ("chat_train", "chat_heldout", "replay_file"):
        value = getattr(plan.data, key)
        if value:
            if not Path(value).exists():
                raise FileNotFoundError(f"data.{key}={value} does not exist here (a relative path is found from this "
                                        "directory, then beside the plan and in the folders above it): give an "
                                        "absolute path on the shared filesystem")
            files[f"data.{key}"] = str(Path(value).resolve())
    spec = plan.model.spec
    kind = spec_kind(spec)
    if kind is None:
        raise FileNotFoundError(f"model.spec={spec} does not exist here: give a local transformers directory "
                                "(an absolute path every host has) or a hub id (org/name)")
    if kind == "local":
        files["model.spec"] = str(Path(spec).expanduser().resolve())
    return {"files": files, "hub_model": spec if kind == "hub" else None}


def cache_problems(exported: dict[str, str]) -> list[str]:
    """The launching machine's own: a cache variable that .deepspeed_env gives the ranks but this shell does not
    have, so the study process and its one-rank arm (which read this shell) would fill another cache."""
    problems = []
    for variable in CACHE_VARIABLES:
        if variable in exported and os.environ.get(variable) != exported[variable]:
            problems.append(f"this machine: .deepspeed_env sets {variable}={exported[variable]} for the ranks, but "
                            f"this shell has {variable}={os.environ.get(variable) or '(unset)'}; the study process and "
                            "its one-rank arm read this shell, so the first timed arm would fill the ranks' cache: "
                            f"export {variable}={exported[variable]} here too")
    return problems


def check(hostfile: str, out: str, device: str, plan: str | None = None) -> list[str]:
    from nshard.files import cache_root
    from nshard.run.hostfile import parse_hostfile
    from nshard.run.plan import REPO_ROOT

    hosts = parse_hostfile(hostfile)
    exported = deepspeed_env()
    wanted = plan_inputs(plan) if plan else {"files": {}, "hub_model": None}
    wanted.update(cwd=os.getcwd(), env={v: exported[v] for v in CACHE_VARIABLES if v in exported})
    Path(out).mkdir(parents=True, exist_ok=True)
    out = str(Path(out).resolve())
    token = uuid.uuid4().hex
    tokens = [Path(out) / f".nshard-preflight-{token}", cache_root() / f".nshard-preflight-{token}"]
    if wanted["hub_model"]:
        tokens.append(Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
                      / f".nshard-preflight-{token}")
    checkout, python = str(REPO_ROOT), sys.executable
    try:
        for mine in tokens:
            mine.parent.mkdir(parents=True, exist_ok=True)
            mine.write_text(token)
        here = probe(checkout, out, token, "here", json.dumps({**wanted, "env": {}}))
        here.update(checkout=checkout, cwd=wanted["cwd"], wanted=wanted)
        if device == "auto":
            device = "cuda" if here.get("gpus") else "cpu"
        problems = cache_problems(exported)
        for i, (host, slots) in enumerate(hosts.items()):
            label = f"host{i}"
            rc, stdout, stderr = ask(host, checkout, python, ["probe", checkout, out, token, label, json.dumps(wanted)])
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
                f"torch {facts['versions'].get('torch')}, {facts.get('gpus')} GPU(s), slots={slots}"
                f"{devices_used(host, slots, facts.get('gpus')) if device == 'cuda' else ''})")
        return problems
    finally:
        for folder in {mine.parent for mine in tokens}:
            for path in folder.glob(f".nshard-preflight-{token}*"):
                path.unlink(missing_ok=True)


def devices_used(host: str, slots: int, gpus: int | None) -> str:
    """Which GPUs the host's ranks will use: DeepSpeed's launcher sets CUDA_VISIBLE_DEVICES to the first `slots`
    of them unless the launch names others with --include."""
    if not gpus or gpus < slots:
        return ""
    used = ",".join(str(i) for i in range(slots))
    if gpus == slots:
        return f"; ranks on GPU {used}"
    return (f"; ranks on GPU {used} of its {gpus} (DeepSpeed's launcher takes the first {slots}; to use others, "
            f"launch with --include {host}:{','.join(str(i) for i in range(gpus - slots, gpus))})")


def say(message: str) -> None:
    print(f"nshard.hosts: {message}", flush=True)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["probe"]:  # on a host, sent by `check`
        print(json.dumps(probe(*args[1:6])))
        return 0
    from nshard.run.hostfile import HostfileError
    from nshard.run.plan import PlanError

    parsed = build_parser().parse_args(args)
    try:
        problems = check(parsed.hostfile, parsed.out, parsed.device, parsed.plan)
    except (HostfileError, PlanError, OSError) as exc:
        log.error("%s", exc)
        return 2
    for line in problems:  # the preflight's report, one line per problem: printed as it is, not logged
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
    cmd.add_argument("--plan", default=None,
                     help="the plan the launch will run: checked, and every file it names must be on every host")
    cmd.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                     help="cuda: each host must see at least as many GPUs as its slots (auto: cuda if this machine "
                          "has one)")
    return parser


if __name__ == "__main__":
    sys.exit(main())
