"""Launch real nshard runs from tests: the deepspeed launcher, gloo ranks, one master port each."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

import launches
import warm
from devices import pin_to_cpu
from spawn import free_port

REPO = Path(__file__).resolve().parent.parent
LAUNCH_ALLOWED = True
"""conftest sets it per test: False in a test not marked slow, so the fast tier cannot quietly launch runs."""
DEEPSPEED = str(Path(sys.executable).with_name("deepspeed"))


def run_env(extra: dict | None = None, cuda: bool = False) -> dict:
    """The environment of a launched run: pinned to the CPU (GPUs hidden, gloo), or with cuda=True on the GPUs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if cuda:
        env["DS_ACCELERATOR"] = "cuda"
    else:
        pin_to_cpu(env)
    env.update(extra or {})
    return env


def launch(out: Path, ds_config, world: int = 2, plan: str | Path = REPO / "launch/plans/tiny.toml",
           extra_args=(), check=True, timeout=600, mpi=False, env: dict | None = None,
           cuda: bool = False, shared: str | None = None, runner: bool = False) -> subprocess.CompletedProcess:
    """deepspeed --hostfile ... nshard/train.py with a ds_config path or dict; world 1 uses --num_gpus 1;
    mpi=True goes through DeepSpeed's openmpi launcher (mpirun) instead of its local one; env adds variables;
    cuda=True leaves the GPUs visible (one rank per GPU: the CUDA tests launch world 1); shared names the
    cached_run it makes (tests/launches.py counts those once per session).

    The ranks start warm (tests/warm.py: forked from a preloaded worker, without DeepSpeed's runner; a worker per
    signature of the variables read at import, so `env` and the session's own variables may be anything) unless
    runner=True, mpi, cuda, or NSHARD_TEST_RUNNER=1: the tests of a path users launch through DeepSpeed's runner
    keep one launch of it (RUNNER_RUNS and the tests that pass runner=True; docs/testing.md#warm-ranks)."""
    if not LAUNCH_ALLOWED:
        raise AssertionError("a test outside the slow tier launched DeepSpeed: mark it @pytest.mark.slow")
    if isinstance(ds_config, dict):
        path = out.parent / f"{out.name}-ds_config.json"
        path.write_text(json.dumps(ds_config))
        ds_config = path
    args = ["--ds_config", str(ds_config), "--plan", str(plan), "--out", str(out), *map(str, extra_args)]
    described = launches.describe_launch(ds_config, world, plan, env, extra_args, mpi=mpi, cuda=cuda)
    if not (runner or mpi or cuda or os.environ.get("NSHARD_TEST_RUNNER") == "1"):
        rank_env = run_env(env)
        worker = warm.worker(rank_env)
        with launches.launching("warm", described, shared), tempfile.TemporaryDirectory(prefix="nshard-warm-") as logs:
            proc = worker.launch(args, world, rank_env, Path(logs), timeout)
        return checked(proc, check)
    if world == 2:
        where = ["--hostfile", str(REPO / "hostfile"), "--no_ssh_check", "--master_addr", "127.0.0.1"]
    else:
        where = ["--num_gpus", str(world)]
    if mpi:
        where = ["--launcher", "openmpi", "--force_multi", *where, "--launcher_args",
                 "--allow-run-as-root --mca btl_tcp_if_include lo -x OMP_NUM_THREADS -x NSHARD_CACHE -x PATH"]
    cmd = [DEEPSPEED, *where, "--master_port", str(free_port()), str(REPO / "nshard/train.py"), *args]
    with launches.launching("mpirun" if mpi else "deepspeed", described, shared):
        proc = subprocess.run(cmd, cwd=REPO, env=run_env(env, cuda), capture_output=True, text=True, timeout=timeout)
    return checked(proc, check)


def checked(proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def shm_workspaces() -> set[Path]:
    return set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))


def leftover_shm_workspaces(before: set[Path]) -> list[Path]:
    """DeepSpeed CPU shm workspaces made since `before` that no live process maps: left behind, not in use by a
    run of another test (pytest-xdist runs two at a time)."""
    new = shm_workspaces() - before
    if not new:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(maxsplit=5)[-1].strip() for line in maps.read_text().splitlines()
                          if "deepspeed_allreduce_buffer_" in line)
        except OSError:  # the process ended while we looked
            pass
    return sorted(p for p in new if str(p) not in mapped and p.exists())


def ds_config(name: str = "dense", **overrides) -> dict:
    config = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    config.update(overrides)
    return config


def receipts(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / "receipts").glob("rank-*.json"))]


def final_params(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model" / "model.safetensors"))


@contextlib.contextmanager
def _locked(path: Path):
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


RUNNER_RUNS = {"ds-one", "ds-dense", "ds-zero1", "ds-zero2", "psgd-z0", "psgd-z1", "psgd-z2", "delta4-z2-fp32"}
"""Shared runs launched through DeepSpeed's runner, not warm: one rank; two at stage 0, ZeRO-1 and ZeRO-2 with
DeepSpeed's reduction and with PowerSGD; delta parameter sync. (Kill and resume: tests/test_resume.py; Open MPI:
mpi=True; the emulated pair: tests/test_hosts.py.)"""


def cached_run(tmp_root: Path, name: str, config: dict, world: int = 2, mpi: bool = False,
               plan: Path = REPO / "launch/plans/tiny.toml") -> Path:
    """Launch once per test session per name; later tests (in any pytest-xdist worker: tmp_root is shared and each
    name locked) reuse the run directory, for the same config and plan text only."""
    key = json.dumps([config, world, mpi, Path(plan).read_text()], sort_keys=True)
    out = tmp_root / name
    launches.requested(name)
    with _locked(tmp_root / f".{name}.test-launch"):  # not .NAME.lock: that is the trainer's own (nshard/lock.py)
        done = tmp_root / f".{name}.key"
        if not done.is_file():
            shutil.rmtree(out, ignore_errors=True)  # a launch that failed earlier in the session
            launch(out, config, world=world, mpi=mpi, plan=plan, shared=name, runner=name in RUNNER_RUNS)
            done.write_text(key)
        assert done.read_text() == key, f"run {name!r} was launched before with another configuration"
    return out


def tiny_config(base: str = "dense", lr: float = 2e-3, stage: int | None = None, nshard: dict | None = None,
                bf16: bool = False, eps: float = 1e-4) -> dict:
    """A ds_config for the tiny plan: a learning rate that visibly moves a random model.

    eps 1e-4, not 1e-8: Adam's first steps are about lr * g / (|g| + eps), so with a tiny eps the fp32
    summation noise of a near-zero gradient (1e-9, different for 1 and 2 ranks) becomes a +-lr step
    and fp32-tolerance comparisons between arms measure that noise instead of the arms."""
    config = ds_config(base)
    config["optimizer"]["params"].update(lr=lr, eps=eps)
    config["scheduler"]["params"].update(warmup_min_lr=lr / 10, warmup_max_lr=lr)
    if stage is not None:
        config["zero_optimization"] = {"stage": stage, "reduce_scatter": False, "overlap_comm": False}
        config["zero_allow_untested_optimizer"] = True
    if nshard is not None:
        config["nshard"] = nshard
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


RESUME_UPDATES, RESUME_EVERY = 8, 2
RESUME_PLAN = (REPO / "launch/plans/tiny.toml").read_text().replace("updates = 3", f"updates = {RESUME_UPDATES}") + (
    f"\n[checkpoint]\nevery = {RESUME_EVERY}\nreplica_check_every = 1\n")
"""The plan of the kill/resume and elastic tests: 8 updates, a complete state every 2 (the newest two kept)."""
RESUME_POWERSGD = {"reducer": "powersgd", "rank": 4, "dense_warmup_updates": 1}


def resume_plan(tmp_root: Path) -> Path:
    """RESUME_PLAN as a file in the session's shared runs folder (the same bytes from every worker)."""
    path = tmp_root / "resume.toml"
    if not path.is_file() or path.read_text() != RESUME_PLAN:
        tmp = tmp_root / f".resume.toml.{os.getpid()}"
        tmp.write_text(RESUME_PLAN)
        tmp.replace(path)
    return path


def resume_config(stage: int, bf16: bool = False, overlap: bool = False) -> dict:
    section = {**RESUME_POWERSGD, "overlap_backward": True} if overlap else RESUME_POWERSGD
    return tiny_config(stage=stage, nshard=section, bf16=bf16)


def resume_reference(tmp_root: Path, stage: int, bf16: bool = False, world: int = 2) -> Path:
    """An uninterrupted run of RESUME_PLAN under PowerSGD, once per session: the reference of the kill/resume tests
    (tests/test_resume.py) and the saved state the elastic tests continue on another world size (test_elastic.py)."""
    name = f"resume-whole-z{stage}{'-bf16' if bf16 else ''}{'-1r' if world == 1 else ''}"
    return cached_run(tmp_root, name, resume_config(stage, bf16), world=world, plan=resume_plan(tmp_root))
