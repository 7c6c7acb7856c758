"""Process environment for a launched rank: thread count, MPI rank mapping, CUDA allocator."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port free on loopback now, for one job's --master_port (everything defaults to 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_workspace(addr: str, port, rank) -> Path:
    """Where DeepSpeed's CPU shared-memory all-reduce keeps a rank's workspace (rank "*" globs them all)."""
    return Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}")


def extensions_dir() -> str:
    """Where torch compiles and finds DeepSpeed's JIT ops (its CPU collective): $TORCH_EXTENSIONS_DIR, else beside
    this venv. torch's default (~/.cache/torch_extensions/py311_cpu/<op>) is one directory for every venv of a
    user, keyed by the op's name: a second venv (another checkout, a CI clone) recompiles the op over the first's
    (its build file names the venv's sources), and a process killed while compiling leaves a lock file that makes
    every later one wait forever. One directory per venv builds once per venv, at the same path on every host."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(sys.prefix) / "torch_extensions")


def pin_ninja() -> str | None:
    """Put this interpreter's bin directory first on PATH when it holds a `ninja`; return that ninja.

    torch builds DeepSpeed's JIT ops with whichever `ninja` PATH finds first, and two ninjas hash a build's
    command differently: PyPI's 1.13 (in the venv) and Debian's 1.11 (/usr/bin) read each other's log as "command
    line changed". A process that ran the venv's python without the venv's bin on PATH (`.venv/bin/python -m
    nshard.study`, pytest) found Debian's, the ranks on emulated hosts (whose ssh puts the venv's bin first) PyPI's,
    and each compiled the CPU collective again (20-45 s) after the other, although nothing had changed. With the
    pin every process of a venv uses one ninja."""
    bindir = Path(sys.executable).parent
    ninja = bindir / "ninja"
    if not ninja.is_file():
        return None
    parts = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    if not parts or parts[0] != str(bindir):
        os.environ["PATH"] = os.pathsep.join([str(bindir), *parts])
    return str(ninja)


def plain_cuda_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST without architecture-specific suffixes ("9.0a" -> "9.0", "10.0a+PTX" -> "10.0+PTX").

    DeepSpeed 0.19.8's JIT op builder sorts the list by int() of each part, so an entry such as "9.0a" (what CUDA
    images for Hopper set) stops it with "invalid literal for int() with base 10: '0a'" before it compiles anything:
    seen on an H200 with `"optimizer": {"type": "AdamW"}` (FusedAdam, docs/gpu.md). The ops DeepSpeed builds use no
    architecture-specific instructions, so the plain architecture builds them."""
    import re

    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)


def prepare_process_env() -> None:
    """Fix what the launchers leave unset, before torch starts any thread pool."""
    env = os.environ
    env["TORCH_EXTENSIONS_DIR"] = extensions_dir()
    pin_ninja()
    if "TORCH_CUDA_ARCH_LIST" in env:
        env["TORCH_CUDA_ARCH_LIST"] = plain_cuda_arch_list(env["TORCH_CUDA_ARCH_LIST"])
    # mpirun (DeepSpeed's openmpi launcher) sets no RANK; map Open MPI's variables, and keep the
    # rendezvous on loopback for a single host (DeepSpeed's discovery would pick `hostname -I`).
    if "OMPI_COMM_WORLD_RANK" in env and "RANK" not in env:
        env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
    env.setdefault("DS_ACCELERATOR", "cuda" if _has_cuda() else "cpu")
    from nshard.run.device import share_gpus

    share_gpus(env)  # NSHARD_DIST_BACKEND=gloo: ranks that share a GPU compute on one that exists
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    import torch

    if "OMP_NUM_THREADS" not in env:
        # The deepspeed launcher leaves OMP_NUM_THREADS unset; two ranks x all cores of OpenMP
        # threads spin against each other and run 50-200x slower. Split the cores instead.
        local_world = int(env.get("LOCAL_WORLD_SIZE") or env.get("LOCAL_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
        torch.set_num_threads(max(1, usable_cores() // max(local_world, 1)))


def usable_cores() -> int:
    """The cores this process may run on: its affinity (a cpuset cgroup or taskset narrows it while
    os.cpu_count() still counts the whole machine), where the platform reports one."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
